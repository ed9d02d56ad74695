"""Phase 2.3 adds continuous batching to phase 2.2: a finished sequence's slot is refilled at once, so each sequence owns its own KV cache.

Phase 2.2's scheduler ran static batches to their end. Here the scheduler
swaps sequences in and out every step. Because running sequences are now at
different lengths, they can no longer share one padded cache: each sequence
gets its own `DynamicCache` and its own forward pass per step.

Files:
- scheduler.py  `ContinuousScheduler(Scheduler)`: admission (`can_admit`: a free slot), the KV state
                (`new_kv` / `free_kv` / `kv_bytes`: one DynamicCache per sequence) and the per-sequence
                `_prefill` / `_decode` passes
- demo.py       `latency_demo` (static vs continuous per sequence) and `wall`
                (KV memory: StaticCache reservation vs what DynamicCache holds)
- README.md     the idea, its files, how to run it; its tables: docs/measurements/p2_3_continuous_batching.md
"""
