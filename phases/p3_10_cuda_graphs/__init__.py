"""Phase 3.10: phase 3.8's engine with decode steps at GPU speed: static buffers, buckets, CUDA graphs.

buffers.py (the static rows), attention.py (the decode pass over them, phase 3.9's kernel), graphs.py
(capture), runner.py (`StaticRunner`), engine.py (`StaticDecodeEngine`, with common/sampling.py's
`DeviceSampler`); demo.py: `graph_bench`, `graph_workload`. README.md has the idea.
"""
