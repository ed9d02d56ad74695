"""Off the reading path: p3_4_gather_kernel's alternative and speed-only paths."""
