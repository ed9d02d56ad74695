"""Phase 3.9 adds a tuned paged decode kernel to phase 3.5's: tiles of blocks, tensor-core dots, a split-KV rule.

The files, in reading order: README.md. The launch sweep and the sm_90 compile check live in measure/.
"""
