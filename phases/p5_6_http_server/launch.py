"""Run the server: `python -m common serve`, its flags (`--help`), and uvicorn on the app.

Tests, the benchmark and the notebook serve the app in-process instead (measure/background_server.py).
"""

from __future__ import annotations

import argparse

import uvicorn

from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE
from phases.p3_6_batched_engine.engine import DEFAULT_MAX_RUNNING
from phases.p3_8_chunked_prefill.engine import DEFAULT_MAX_NUM_BATCHED_TOKENS
from phases.p4_4_preemption.engine import PREEMPTION_MODES
from phases.p4_5_speculative_decoding.engine import DEFAULT_NUM_SPECULATIVE_TOKENS, SPECULATIVE_METHODS
from phases.p5_2_async_engine.async_engine import DEFAULT_MAX_WAITING

LOCALHOST = "127.0.0.1"
DEFAULT_PORT = 8000
GRACEFUL_SHUTDOWN_S = 2  # open streams get this long to finish before uvicorn cancels them


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m common serve",
                                description="Serve a model over an OpenAI-compatible HTTP API (phase 5).")
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m (default), tiny, dummy:<arch>, a HF id/path")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: bf16 where native, else fp32)")
    p.add_argument("--host", default=LOCALHOST, help=f"address to listen on (default {LOCALHOST}: this machine only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--max-running", type=int, default=DEFAULT_MAX_RUNNING, help="sequences decoded together at most")
    p.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING, help="requests waiting at most; then 503")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block")
    p.add_argument("--n-blocks", type=int, default=None, help="KV pool size in blocks (default: sized from memory)")
    p.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                   help="tokens in one step's forward pass at most: decode tokens, then prefill chunks")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off (on by default)")
    p.add_argument("--preemption-mode", choices=PREEMPTION_MODES, default="recompute",
                   help="how a preempted request comes back: recompute its KV (default), or swap to a CPU pool")
    p.add_argument("--speculative", choices=SPECULATIVE_METHODS, default=None,
                   help="speculative decoding (off by default): ngram (prompt lookup) or draft (a self-draft)")
    p.add_argument("--num-speculative-tokens", type=int, default=DEFAULT_NUM_SPECULATIVE_TOKENS,
                   help="tokens proposed per sequence and step at most")
    p.add_argument("--draft-layers", type=int, default=None, help="layers of the self-draft (default: half)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="workers the model is cut across (phase 4.7)")
    p.add_argument("--kv-events-endpoint", default=None,
                   help="publish vLLM's KV events (msgpack over ZMQ) here, e.g. tcp://*:5557 (needs prefix caching)")
    p.add_argument("--kv-events-topic", default="", help="the ZMQ topic of the KV events (default: none)")
    p.add_argument("--log-level", default="info")
    return p


def main(argv: list[str] | None = None) -> int:
    from common.model import load_model
    from phases.p5_6_http_server.server import create_app

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tensor_parallel_size < 1:
        parser.error(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    if args.kv_events_endpoint and args.no_prefix_caching:
        parser.error("--kv-events-endpoint needs the prefix cache: the events are its blocks")
    group = None
    if args.tensor_parallel_size == 1:
        lm = load_model(args.model, device=args.device, dtype=args.dtype)
    else:
        from phases.p4_7_tensor_parallel.workers import launch
        group, lm = launch(args.model, args.tensor_parallel_size, device=args.device, dtype=args.dtype)
    app = create_app(lm, max_running=args.max_running, max_waiting=args.max_waiting,
                     block_size=args.block_size, n_blocks=args.n_blocks, prefix_caching=not args.no_prefix_caching,
                     preemption_mode=args.preemption_mode, max_num_batched_tokens=args.max_num_batched_tokens,
                     speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
                     draft_layers=args.draft_layers, kv_events_endpoint=args.kv_events_endpoint,
                     kv_events_topic=args.kv_events_topic, tensor_parallel=group)
    pool = app.state.engine.engine.allocator
    settings = ", ".join(f"{k} {v}" for k, v in vars(args).items() if k not in ("host", "port", "model"))
    print(f"serving '{lm.name}' on http://{args.host}:{args.port}/v1 (the pool, live: /pool): KV pool "
          f"{pool.n_blocks} blocks x {pool.block_size} tokens; {settings}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    return 0
