"""`bench_serve`: the server under Poisson load - throughput and latency against the request rate.

The server runs in this process (uvicorn in a thread on a free 127.0.0.1
port); the load generator (measure/load_gen.py) sends `n_requests` streaming
chat requests at each rate, the same requests in the same order at every
rate, and measures from the client side, as vLLM's serving benchmark does.
The harness is measure/serve_bench.py (it imports no phase: this file hands it
this phase's `create_app` and `BackgroundServer`). Three workloads (`--workload`):

- `chat` (default): the blog's short and long prompts. Below the engine's
  capacity, TTFT is about one prefill and ITL about one decode step of a
  small batch. As the rate approaches capacity the batch grows (ITL rises
  with it), then requests queue for a slot and TTFT climbs steeply: that
  knee is the rate this server can sustain.
- `fewshot`: every request behind the same 5-shot system prompt (phase
  4.3's translation task), on a server with prefix caching on and on one
  with it off (`--no-prefix-caching`): the hit rate and TTFT of each, read
  over HTTP from the server's own /metrics.
- `undersized`: a KV pool a fraction (`pool_fraction`) of what the running
  requests need at once, against an unconstrained pool, on the same
  greedy, fixed-length requests: requests are preempted (recomputed) and
  all complete, no 5xx, and every output equals the unconstrained run's
  (token for token in fp32: `--dtype fp32`).
"""

from __future__ import annotations

from measure.demos import RunConfig, demo
from measure.report import Report
from measure.serve_bench import ServingStack, bench_serve_options, plot_bench_serve, run_bench_serve
from measure.background_server import BackgroundServer
from phases.p5_6_http_server.server import create_app

# The app keeps its AsyncEngine in app.state.engine; the engine it steps is that one's `.engine`.
STACK = ServingStack(create_app=create_app, serve=BackgroundServer, engine_of=lambda app: app.state.engine.engine)


@demo("bench_serve", phase="p5_6", options=bench_serve_options(), plot=plot_bench_serve,
      help="OpenAI-compatible server under Poisson load: req/s, output tok/s, TTFT and ITL p50/p99 per request "
           "rate; --workload fewshot (prefix caching on vs off) or undersized (preemption under load)")
def bench_serve(cfg: RunConfig) -> Report:
    return run_bench_serve(cfg, STACK)
