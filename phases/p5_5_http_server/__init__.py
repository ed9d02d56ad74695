"""Phase 5 adds serving to phase 4.4's engine with 4.5's speculation: the last engine of the line (samples, prefix caching, preemption, speculation) behind an OpenAI-compatible HTTP API, with streaming, aborts, a bounded queue, and failures isolated to the request that caused them.

Files, in reading order:
- detokenize.py    token ids -> text deltas (incremental detokenization) and stop strings
- isolation.py     `ServingEngine(PreemptingEngine)`, speculating with phase 4.5's parts when asked: a step
                   that raises fails only its culprit (rollback by recomputation, narrower passes until the
                   culprit fails alone); finished requests forgotten
- samples.py       `n` samples of one prompt behind one adapter
- metrics.py       the engine snapshot behind /health, and /metrics with prometheus-client
- vllm_metrics.py  vLLM's metric names on /metrics, beside ours
- async_engine.py  `AsyncEngine`: one thread steps the engine; requests come and go on an asyncio loop
- kv_events.py     KV events in vLLM's format (msgpack over ZMQ) from the prefix cache, off by default
- pool_stream.py   one frame of the pool per step, to the /pool page (pool_page/) while one watches
- protocol.py      the OpenAI request/response bodies (pydantic), error bodies
- formats.py       completion vs chat answers and stream chunks
- server.py        `create_app(lm)` and its module-level routes
- launch.py        `python -m common serve` (its flags: --help), and `BackgroundServer` (uvicorn in a
                   thread) for tests and the benchmark
- demo.py          `bench_serve`: latency and throughput against the request rate; --workload fewshot
                   (prefix caching on vs off) and undersized (preemption); the harness is measure/'s
- workload_demo.py `serve_workload`: the served engine on workload_bench's equal and mixed work, beside
                   phases 3.6 and 3.10 (no HTTP stack)
- pool_replay.py   `pool_replay <demo>`: a demo's run as one HTML file that draws its pool step by step
"""
