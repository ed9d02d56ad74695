"""Continuous batching: a finished sequence's slot is refilled at once, so each sequence owns its own KV cache.

Phase 2.2's scheduler ran static batches to their end. Here the scheduler
swaps sequences in and out every step. Because running sequences are now at
different lengths, they can no longer share one padded cache: each sequence
gets its own `DynamicCache` and its own forward pass per step.

- `scheduler.py`  `ContinuousScheduler(lm, max_running)` (subclass of phase 2.2's `Scheduler`)
- `demo.py`       `latency_demo` (static vs continuous per sequence) and `wall`
                  (KV memory: StaticCache reservation vs what DynamicCache holds)
"""
