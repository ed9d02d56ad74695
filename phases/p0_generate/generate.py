"""The baseline decode loop: every step runs the model over the whole sequence so far.

    ids = prompt
    repeat:
        logits = model(ids)            # all len(ids) positions, recomputed from scratch
        next = argmax(logits[-1])      # only the last position is used
        ids = ids + [next]

Nothing from step i is kept for step i + 1, so the keys and values of the
prompt are recomputed at every step. Step i costs ~len(prompt) + i token-passes
(plus attention over all of them), and ms/tok grows with the position: the
growth is the cost of recomputing the past.

`GenerationResult`, `check_request` and `start_request` stand apart from the
loop: they are what a single-sequence loop returns, what input it refuses and
how it starts, whatever it does between the steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.clock import SeqTiming, now
from common.model import LoadedModel
from common.sampling import GREEDY, SamplingParams, make_generator, sample

# Only the last position's logits pick the next token. Asking the model for just
# that row skips the [T, vocab] output projection of the other T - 1 positions,
# which would otherwise dominate a small model's step (vocab 49152 vs hidden 576).
LAST_POSITION_ONLY = 1


@dataclass
class GenerationResult:
    """One request's ids, text and clock readings.

    `output_ids` ends with the EOS token when the model produced one (like
    Hugging Face `generate`); `text` is the decoded output without special tokens.
    """
    prompt_ids: list[int]
    max_new_tokens: int
    timing: SeqTiming
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "eos" or "length"

    def append_token(self, token_id: int, t: float, eos_ids: set[int], ignore_eos: bool = False) -> bool:
        """Record a token produced at clock `t`; return True when the request is finished."""
        self.output_ids.append(token_id)
        self.timing.token(t)
        if not ignore_eos and token_id in eos_ids:
            self.finish_reason = "eos"
        elif len(self.output_ids) >= self.max_new_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None

    @property
    def n_generated(self) -> int:
        return len(self.output_ids)

    @property
    def step_ms(self) -> list[float]:
        """Milliseconds each token took: [0] is the TTFT (prefill), [i] the decode step for token i."""
        clock = [self.timing.arrival] + self.timing.token_times
        return [(b - a) * 1e3 for a, b in zip(clock, clock[1:])]

    @property
    def positions(self) -> list[int]:
        """The sequence length each step ran at: step i sees len(prompt) + i tokens."""
        return [len(self.prompt_ids) + i for i in range(self.n_generated)]

    @property
    def tok_s(self) -> float:
        """End-to-end tokens per second of this request (prefill included)."""
        latency_s = self.timing.latency_ms / 1e3
        return self.n_generated / latency_s if latency_s > 0 else float("nan")


def check_request(lm: LoadedModel, prompt_ids: list[int], max_new_tokens: int) -> None:
    """Refuse, before any model work, a request that cannot run to completion."""
    if not prompt_ids:
        raise ValueError("empty prompt: give at least one token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise ValueError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    bad = [i for i in prompt_ids if not 0 <= i < lm.vocab_size]
    if bad:
        raise ValueError(f"prompt has token ids outside the vocabulary [0, {lm.vocab_size}): {bad[:5]}")
    total = len(prompt_ids) + max_new_tokens
    if total > lm.max_context:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) = {total} "
                         f"tokens exceeds {lm.name}'s context of {lm.max_context} tokens; "
                         "shorten the prompt or lower max_new_tokens")


def start_request(lm: LoadedModel, prompt_ids: list[int], max_new_tokens: int,
                  sampling: SamplingParams) -> tuple[GenerationResult, torch.Generator | None]:
    """What every single-sequence loop does before its first forward pass: refuse a request that cannot
    run (`check_request`), seed the sampler, start the request's clock. Returns (result, generator)."""
    check_request(lm, prompt_ids, max_new_tokens)
    generator = make_generator(sampling, lm.device)
    return GenerationResult(list(prompt_ids), max_new_tokens, SeqTiming(arrival=now(lm.device))), generator


def prompt_to_ids(lm: LoadedModel, prompt: str | list[int]) -> list[int]:
    """Text becomes chat-template ids (how every engine in this repo tokenizes); ids pass through."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("empty prompt: give at least one character of text")
        return lm.prompt_ids(prompt)
    if isinstance(prompt, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        return list(prompt)
    raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")


def generate(lm: LoadedModel, prompt: str | list[int], max_new_tokens: int = 64,
             sampling: SamplingParams = GREEDY, ignore_eos: bool = False) -> GenerationResult:
    """Generate from a text prompt (chat template applied) or from token ids. See `generate_ids`."""
    return generate_ids(lm, prompt_to_ids(lm, prompt), max_new_tokens, sampling, ignore_eos)


@torch.inference_mode()
def generate_ids(lm: LoadedModel, prompt_ids: list[int], max_new_tokens: int = 64,
                 sampling: SamplingParams = GREEDY, ignore_eos: bool = False) -> GenerationResult:
    """Decode up to `max_new_tokens` tokens after `prompt_ids`, re-reading the whole sequence each step.

    Stops at an EOS token unless `ignore_eos` (fixed-length benchmark runs).
    """
    result, generator = start_request(lm, prompt_ids, max_new_tokens, sampling)
    ids = torch.tensor([prompt_ids], device=lm.device)                     # [1, T]
    while True:
        # use_cache=False: the model builds no cache, so every position of `ids`
        # is embedded, projected to K/V and attended over again.
        out = lm.model(input_ids=ids, use_cache=False, logits_to_keep=LAST_POSITION_ONLY)
        logits = out.logits[:, -1, :]                                      # [1, V]
        token = sample(logits, sampling, generator)                        # [1]
        ids = torch.cat([ids, token[:, None]], dim=1)                      # [1, T + 1]
        if result.append_token(int(token), now(lm.device), lm.eos_token_ids, ignore_eos):
            break
    result.text = lm.decode(result.output_ids)
    return result
