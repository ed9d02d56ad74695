"""Adds to phase 0 a KV cache: each decode step feeds the model one new token, not the whole sequence.

At every layer, attention for the newest token needs the keys and values of
every earlier token. Those never change once computed (a token only attends
backwards), so phase 0 recomputed them for nothing. Here they live in a
`transformers.DynamicCache`: per layer, K and V tensors of shape
[batch=1, n_kv_heads, seq_len, head_dim] that grow by one row per step.

    prefill:  model(prompt)          -> fills the cache with T rows, logits of position T-1
    decode:   model([token], cache)  -> appends 1 row, logits of the new position

A decode step now does a fixed amount of projection/MLP work (one token) plus
an attention read over the cached rows, so ms/tok stays nearly flat as the
sequence grows. Same return type and same input checks as phase 0.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from common.clock import now
from common.model import LoadedModel
from common.sampling import GREEDY, SamplingParams, sample
from phases.p0_generate.generate import LAST_POSITION_ONLY, GenerationResult, prompt_to_ids, start_request


@torch.inference_mode()
def generate_ids(lm: LoadedModel, prompt_ids: list[int], max_new_tokens: int = 64,
                 sampling: SamplingParams = GREEDY, ignore_eos: bool = False) -> GenerationResult:
    """Decode up to `max_new_tokens` tokens after `prompt_ids`: one prefill, then one token per step.

    Stops at an EOS token unless `ignore_eos` (fixed-length benchmark runs).
    """
    result, generator = start_request(lm, prompt_ids, max_new_tokens, sampling)
    cache = DynamicCache(config=lm.config)

    # Prefill: the whole prompt in one pass, writing K/V of positions 0..T-1 into the cache.
    n_prompt = len(prompt_ids)
    input_ids = torch.tensor([prompt_ids], device=lm.device)                      # [1, T]
    position_ids = torch.arange(n_prompt, device=lm.device)[None, :]              # [1, T]
    while True:
        out = lm.model(input_ids=input_ids, position_ids=position_ids, past_key_values=cache,
                       use_cache=True, logits_to_keep=LAST_POSITION_ONLY)
        token = sample(out.logits[:, -1, :], sampling, generator)                # [1]
        if result.append_token(int(token), now(lm.device), lm.eos_token_ids, ignore_eos):
            break
        # Decode: only the new token goes in. Its position is explicit (RoPE
        # rotates its query/key by it); everything before it comes from the cache.
        input_ids = token[:, None]                                                # [1, 1]
        position_ids = torch.tensor([[n_prompt + result.n_generated - 1]], device=lm.device)  # [1, 1]
    result.text = lm.decode(result.output_ids)
    return result


def generate(lm: LoadedModel, prompt: str | list[int], max_new_tokens: int = 64,
             sampling: SamplingParams = GREEDY, ignore_eos: bool = False) -> GenerationResult:
    """Phase 0's `generate` with this loop: a text prompt goes through the chat template, ids pass through."""
    return generate_ids(lm, prompt_to_ids(lm, prompt), max_new_tokens, sampling, ignore_eos)
