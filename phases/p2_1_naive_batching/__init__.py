"""Phase 2.1 adds naive (static) batching to phase 1: many prompts share one padded forward pass and one KV cache.

Prompts are left-padded to the longest one and decoded in lock-step: every
forward pass advances every row by one token, finished or not. Throughput
grows with batch size, but finished rows ride along until the slowest one is
done (the waste). The files, in reading order: README.md.
"""
