"""Phase 5.6 adds the HTTP server to phase 5.5: the served engine behind an OpenAI-compatible API, with streaming, aborts, a bounded queue, /health, /metrics and the /pool page.

Files, in reading order:
- server.py    `create_app(lm)`: the routes, the engine built for them, each error in OpenAI's shape
- launch.py    `python -m common serve` (its flags: --help)
- demo.py      `bench_serve`: latency and throughput against the request rate; --workload fewshot
               (prefix caching on vs off) and undersized (preemption); the harness is measure/'s
- README.md    the idea, its files, how to run it; its tables: docs/measurements/p5_6_http_server.md
"""
