"""Off the reading path: p3_7_varlen_prefill's alternative and speed-only paths."""
