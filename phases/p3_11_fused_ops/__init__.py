"""Phase 3.11 adds fused kernels to phase 3.10's decode step: RMSNorm, rotary embedding and SwiGLU's gate, one launch each.

The files, in reading order: README.md.
"""
