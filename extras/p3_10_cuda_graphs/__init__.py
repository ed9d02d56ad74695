"""Beside phase 3.10: `OverlappedDecodeEngine` (overlap.py), the host building step N+1 while the GPU runs step N."""
