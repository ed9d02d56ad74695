"""Phase 2.1 adds naive (static) batching to phase 1: many prompts share one padded forward pass and one KV cache.

Phase 1 decoded one prompt with a KV cache. Here a list of prompts is
left-padded to the longest one and decoded in lock-step: every forward pass
advances every row by one token, whether that row still needs tokens or has
already finished. That keeps the hardware busy (throughput grows with batch
size) but carries finished rows until the slowest one is done (the waste).

Files:
- validate.py  turns prompts into token ids and rejects bad input early
- padding.py   left padding, the attention mask and per-row position ids
- batch.py     `PaddedBatch`: one shared `DynamicCache`, prefill + lock-step decode
- generate.py  `generate_batch(lm, prompts)` -> `BatchResult` (outputs, steps, timings)
- demo.py      the `sweep` and `waste_demo` demos, and `STATIC`: this phase's engine as the
               measurement harness runs it (static batches of max_running)
- README.md    the idea, its files, how to run it; its tables: docs/measurements/p2_1_naive_batching.md
"""
