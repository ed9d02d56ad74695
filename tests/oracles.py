"""Hugging Face `generate` as the oracle every engine is checked against."""

from __future__ import annotations

import weakref

import torch

# (id of the LoadedModel, prompt ids, max_new_tokens, ignore_eos) -> (a weak reference to that model, new ids).
# Several test files check their engines on the same prompts with the same
# session-scoped models; the oracle's answer cannot change, so compute it once.
# An id alone is not enough: tests that load a model of their own free it, and
# the next model loaded can get the freed id. The weak reference tells whether
# an entry's model is the one asked about (a dead one answers None).
_MEMO: dict[tuple, tuple[weakref.ref, tuple[int, ...]]] = {}


@torch.inference_mode()
def hf_greedy(lm, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    """Greedy new tokens of one unpadded prompt, stopping at EOS like the engines (EOS included)."""
    key = (id(lm), tuple(prompt_ids), max_new_tokens, ignore_eos)
    model_ref, new_ids = _MEMO.get(key, (None, None))
    if model_ref is None or model_ref() is not lm:
        ids = torch.tensor([prompt_ids], device=lm.device)
        eos = None if ignore_eos else (sorted(lm.eos_token_ids) or None)
        out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, eos_token_id=eos, pad_token_id=lm.pad_token_id,
                                min_new_tokens=max_new_tokens if ignore_eos else None)
        new_ids = tuple(out[0, len(prompt_ids):].tolist())
        _MEMO[key] = (weakref.ref(lm), new_ids)
    return list(new_ids)


def run_ignoring_eos(engine, prompts: list[list[int]], new_tokens: int | list[int]) -> list[list[int]]:
    """Add every prompt (EOS ignored: each runs its full `new_tokens`, one count or one per prompt), run the
    engine until it has no work, and check that every block went back to the pool. Returns each output's ids."""
    counts = [new_tokens] * len(prompts) if isinstance(new_tokens, int) else list(new_tokens)
    seqs = [engine.add(p, n, ignore_eos=True) for p, n in zip(prompts, counts)]
    engine.run()
    assert engine.allocator.n_free == engine.allocator.n_blocks, "blocks leaked"
    engine.allocator.check_invariants()
    return [s.output_ids for s in seqs]
