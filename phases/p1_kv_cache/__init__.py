"""Phase 1 adds a KV cache to phase 0's loop: one prefill pass, then one token per decode step.

`generate(lm, prompt)` returns the same `GenerationResult` as phase 0 and
produces the same greedy tokens, but keeps every layer's keys and values in a
`transformers.DynamicCache`, so a decode step costs about the same at position
1000 as at position 10. `demo.py` holds `decode_sweep`, which times both loops.
"""

from phases.p1_kv_cache.generate import generate, generate_ids

__all__ = ["generate", "generate_ids"]
