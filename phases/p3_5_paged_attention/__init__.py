"""Phase 3.5 adds paged decode attention to phase 3.4's gather: a fused Triton kernel reads every sequence's K/V in place from the pool through its block table (no gather, no padded copy), a whole batch at different lengths in one launch, plus a kernel that writes new K/V into the pool by slot.

The files, in reading order: README.md.
"""
