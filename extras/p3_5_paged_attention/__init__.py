"""Off the reading path: p3_5_paged_attention's alternative and speed-only paths."""
