"""Phase 1 adds a KV cache to phase 0's loop: one prefill pass, then one token per decode step.

`generate(lm, prompt)` returns the same `GenerationResult` as phase 0 and
produces the same greedy tokens, but keeps every layer's keys and values in a
`transformers.DynamicCache`, so a decode step costs about the same at position
1000 as at position 10.

Files:
- generate.py  `generate` / `generate_ids`: prefill once, then one token per step through the cache
- demo.py      `decode_sweep`: phase 0's loop vs this one, tok/s, ms/tok, TTFT and memory per length
- README.md    the idea, its files, how to run it; its tables: docs/measurements/p1_kv_cache.md
"""

from phases.p1_kv_cache.generate import generate, generate_ids

__all__ = ["generate", "generate_ids"]
