"""Phase 3.10 adds decode at GPU speed to phase 3.8's engine: static buffers, buckets, CUDA graphs.

The files, in reading order: README.md.
"""
