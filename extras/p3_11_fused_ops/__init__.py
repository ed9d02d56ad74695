"""Beside phase 3.11: `FusedOverlappedEngine` (overlap.py), the fused step with phase 3.10's overlapped steps."""
