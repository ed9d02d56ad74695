"""Phase 5.3 adds measurement to phase 5.2's async engine: a snapshot of the engine after every step, the token rate, TTFT and ITL, exported for Prometheus under our names and vLLM's.

Files, in reading order:
- metrics.py       `EngineStats` (the snapshot behind /health), `MeteredAsyncEngine` (the async engine,
                   measured), and the Prometheus collector behind /metrics
- vllm_metrics.py  vLLM's metric names (`vllm:num_requests_waiting`, ...) beside ours, each equal to one of ours
- README.md        the idea, its files, how to run it; its tables: docs/measurements/p5_3_metrics.md
"""
