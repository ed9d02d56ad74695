"""Phase 5.1 adds the served engine to phase 4.7's: a step that raises fails only the request that caused it, and a request's records go once it is over.

Files, in reading order:
- engine.py         `ServingEngine(TensorParallelEngine)`, the whole engine line: a failing step
                    is narrowed until its culprit fails alone (`StepFailed` says who failed, who is retried,
                    what was made); `forget` drops a finished request's records
- workload_demo.py  `serve_workload`: the served engine on workload_bench's equal and mixed work, beside
                    phases 3.6 and 3.10 (no HTTP)
- README.md         the idea, its files, how to run it; its tables: docs/measurements/p5_1_served_engine.md
"""
