"""Pick the next token from logits: greedy, temperature, top-k, top-p.

Every engine calls `sample(logits, params, generator)` on the last position's
logits, one row per sequence. Greedy (temperature 0) is an argmax, so engines
can be checked token-for-token against Hugging Face `generate(do_sample=False)`.

`SamplingParams` checks itself when it is made (`validate()`), so no engine
ever meets a value that would crash a step: a temperature below
`GREEDY_BELOW_TEMPERATURE` is greedy (dividing logits by 1e-40 overflows to
inf, and `torch.multinomial` refuses the NaN probabilities that follow: vLLM
draws the same line), NaN and infinity are refused, and a seed must be one
`torch.Generator` takes. A request of `n` samples seeds sample i with
`seed + i`, so every one of those must fit too: `validate(n_samples=n)`.
A refusal is an `InvalidSamplingParams` (a ValueError) that names the
parameter, so a server can answer 400 with `param` set.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

GREEDY_BELOW_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it samples greedily
# Seeds are 64-bit signed integers, as in vLLM's API; torch.Generator.manual_seed takes all of them.
SEED_MIN = -2**63
SEED_MAX = 2**63 - 1


class InvalidSamplingParams(ValueError):
    """A sampling parameter out of range; `param` names it (temperature, top_k, top_p, seed)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_finite(x) -> bool:
    """A real number (not a bool) that is neither NaN nor infinite (nor an int too big for a float)."""
    if not isinstance(x, numbers.Real) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0 (or anything below GREEDY_BELOW_TEMPERATURE) means greedy
    top_k: int = 0             # 0 means no top-k cut
    top_p: float = 1.0         # 1 means no nucleus cut
    seed: int | None = None    # sample i of a group draws with seed + i

    def __post_init__(self):
        self.validate()

    def validate(self, n_samples: int = 1) -> None:
        """Raise InvalidSamplingParams unless every value is in range for a request of `n_samples` samples."""
        t, k, p = self.temperature, self.top_k, self.top_p
        if not _is_finite(t) or t < 0:
            raise InvalidSamplingParams("temperature", f"must be a finite number >= 0, got {t!r}")
        if not _is_int(k) or k < 0:
            raise InvalidSamplingParams("top_k", f"must be an integer >= 0 (0: no cut), got {k!r}")
        if not _is_finite(p) or not 0 < p <= 1:
            raise InvalidSamplingParams("top_p", f"must be in (0, 1], got {p!r}")
        if self.seed is not None:
            last = self.seed + n_samples - 1 if _is_int(self.seed) else None
            if last is None or not SEED_MIN <= self.seed <= SEED_MAX or last > SEED_MAX:
                what = "" if n_samples == 1 else f" (sample i draws with seed + i, up to seed + {n_samples - 1})"
                raise InvalidSamplingParams("seed", f"must be an integer in [{SEED_MIN}, {SEED_MAX}]{what}, "
                                                    f"got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


GREEDY = SamplingParams()


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Mask (to -inf) every logit outside the top-k and outside the top-p nucleus.

    logits: [B, V] (already divided by the temperature). Returns [B, V].
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]           # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [B, V]
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p. The most likely
        # token is always kept, explicitly: a top_p below fp32's smallest number (5e-324 is a
        # valid float64) rounds to 0 in the comparison, which would drop every token.
        before = probs.cumsum(-1) - probs
        drop_sorted = before >= top_p
        drop_sorted[..., 0] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: SamplingParams = GREEDY,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits: [B, V] for the last position. Returns token ids [B] (int64)."""
    if params.greedy:
        return logits.argmax(-1)
    scaled = filter_logits(logits.float() / params.temperature, params.top_k, params.top_p)
    probs = scaled.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def make_generator(params: SamplingParams, device: str | torch.device = "cpu") -> torch.Generator | None:
    """A seeded generator when the request names a seed (reproducible samples), else None."""
    if params.seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(params.seed)
    return g


class Sampler:
    """The sampler part of an engine: one token per row of a pass's logits, each row its own request's.

    Greedy rows are one argmax for the whole batch; a sampled row draws with its request's generator, made
    from its seed the first time it samples (`forget` drops it when the request is over)."""

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = device
        self.generators: dict[int, torch.Generator | None] = {}   # seq_id -> its random stream

    def sample(self, seqs: list, logits: torch.Tensor) -> list[int]:
        """Row i of logits [S, V] is seqs[i]'s (anything with `seq_id` and `sampling`). Returns S token ids."""
        tokens = logits.float().argmax(-1)  # [S]; fp32 first: CPU argmax over bf16 is slower, same answer
        for i, seq in enumerate(seqs):
            if not seq.sampling.greedy:
                if seq.seq_id not in self.generators:
                    self.generators[seq.seq_id] = make_generator(seq.sampling, self.device)
                tokens[i] = sample(logits[i:i + 1], seq.sampling, self.generators[seq.seq_id])[0]
        # One copy to the host for the whole batch, after every row is picked (on a GPU each
        # read of a token is a wait for the stream).
        return tokens.tolist()

    def forget(self, seq) -> None:
        self.generators.pop(seq.seq_id, None)
