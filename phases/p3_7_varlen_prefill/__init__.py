"""Phase 3.7 adds a varlen paged prefill kernel to phase 3.5's decode kernel: every prompt of a packed prefill attended in ONE launch per layer, each prompt's K/V read in place from the pool.

The files, in reading order: README.md.
"""
