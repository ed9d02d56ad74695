"""Phase 3.8 adds chunked prefill to phase 3.6's engine: ONE forward pass per step, decode tokens and prefill chunks together under a token budget, the chunks on phase 3.7's varlen prefill kernel.

The files, in reading order: README.md.
"""
