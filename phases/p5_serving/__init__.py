"""Phase 5: serving - the last engine of the line (samples, beams, prefix caching, preemption) behind an OpenAI-compatible HTTP API, with streaming, aborts and a bounded queue.

Files, in reading order:
- detokenize.py    token ids -> text deltas (incremental detokenization) and stop strings
- samples.py       `ServingEngine(PreemptingEngine)` (forgets finished requests), and `n` samples of one
                   prompt behind one adapter
- async_engine.py  `AsyncEngine`: one thread steps the engine; requests come and go on an asyncio loop
- protocol.py      the OpenAI request/response bodies (pydantic), error bodies
- server.py        `create_app(lm)`: the FastAPI routes
- launch.py        `python -m common serve` (--no-prefix-caching, --preemption-mode recompute|swap), and
                   `BackgroundServer` (uvicorn in a thread) for tests and the benchmark
- load_gen.py      a streaming load generator with Poisson arrivals (TTFT, inter-token latency)
- demo.py          `bench_serve`: latency and throughput against the request rate
"""
