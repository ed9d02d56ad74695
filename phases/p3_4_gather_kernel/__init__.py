"""Phase 3.4 adds a Triton gather to phase 3.3: many sequences' K/V read from the block pool in one launch instead of a Python loop per block.

The files, in reading order: README.md.
"""
