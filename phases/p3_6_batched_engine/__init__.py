"""Phase 3.6 adds the batched engine to phase 3.5's kernels: continuous batching in batched forward passes over the block pool, an unmodified Hugging Face model's attention reading the pool, the engine in four parts.

The files, in reading order: README.md.
"""
