"""A streaming load generator in the style of vLLM's serving benchmark.

Requests arrive as a Poisson process at a given rate (measure.workload), each
one a streaming chat completion over HTTP, and every client measures what a
user would see:

- TTFT: from sending the request to the first chunk with text;
- inter-token latency (ITL): the gaps between consecutive text chunks;
- end-to-end latency, and the output tokens the server reports in `usage`.

Every request has its own timeout and the whole run a deadline: whatever is
still open then is cancelled and counted as failed, so a run always ends.
A request that fails is recorded with its HTTP status (`RequestResult.status`),
so a run can tell a server error (5xx) from a refusal. `load_at_rates` warms
a server up and then offers the same requests at each of several rates;
`scrape_metrics` reads a server's Prometheus /metrics.

It speaks plain HTTP to any OpenAI-compatible server (phase 5's, vLLM's), so
it lives here with the other measurement code. Also a command for any running
server (default: this machine's):
  python -m measure.load_gen --rate 2 --n 16 --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx

from common.prompts import interleaved_latency_prompts
from measure.bench import percentile
from measure.workload import poisson_arrivals

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
REQUEST_TIMEOUT_S = 120.0   # one request, first byte to [DONE]
RUN_SLACK_S = 120.0         # the run's deadline: last arrival + this
SSE_DATA = "data: "
SSE_DONE = "[DONE]"
WARMUP_REQUESTS = 2         # `load_at_rates` sends these first: first passes pay for lazy init and allocator growth
WARMUP_MAX_TOKENS = 4
SCRAPE_TIMEOUT_S = 10


@dataclass
class RequestResult:
    ok: bool
    status: int | None = None           # the HTTP status (None: no answer at all)
    sent_s: float = float("nan")        # when it was sent, from the start of the run
    ttft_s: float = float("nan")
    latency_s: float = float("nan")
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    error: str | None = None


def chat_payloads(model: str, n: int, max_tokens: int, prompts: list[str] | None = None,
                  ignore_eos: bool = False, system: str | None = None) -> list[dict]:
    """n streaming chat requests, greedy, cycling through `prompts` (the blog's short/long mix by default),
    each behind the same `system` message if one is given (a shared prefix, as a few-shot task has)."""
    prompts = prompts or interleaved_latency_prompts()
    head = [{"role": "system", "content": system}] if system else []
    return [{"model": model, "messages": head + [{"role": "user", "content": prompts[i % len(prompts)]}],
             "max_tokens": max_tokens, "temperature": 0, "stream": True,
             "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos} for i in range(n)]


async def stream_one(client: httpx.AsyncClient, url: str, payload: dict) -> RequestResult:
    """Send one streaming request and time its chunks as they arrive."""
    start = time.perf_counter()
    first = last = None
    res = RequestResult(ok=False)
    async with client.stream("POST", url, json=payload) as resp:
        res.status = resp.status_code
        if resp.status_code != 200:
            body = (await resp.aread()).decode(errors="replace")
            res.error = f"HTTP {resp.status_code}: {body[:200]}"
            return res
        async for line in resp.aiter_lines():
            if not line.startswith(SSE_DATA):
                continue  # blank separators between events
            data = line[len(SSE_DATA):]
            if data == SSE_DONE:
                res.ok = res.error is None
                break
            chunk = json.loads(data)
            if "error" in chunk:
                res.error = chunk["error"].get("message", "error event")
                continue
            if chunk.get("usage"):
                res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                res.output_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                text = (choice.get("delta") or {}).get("content") or choice.get("text")
                if text:
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        res.itl_s.append(now - last)
                    last = now
                    res.text += text
    end = time.perf_counter()
    res.ttft_s = (first - start) if first is not None else float("nan")
    res.latency_s = end - start
    return res


async def run_load(base_url: str, payloads: list[dict], arrivals_s: list[float],
                   endpoint: str = "/chat/completions", request_timeout_s: float = REQUEST_TIMEOUT_S,
                   run_timeout_s: float | None = None,
                   on_done: Callable[[RequestResult], None] | None = None) -> tuple[list[RequestResult], float]:
    """Send payloads[i] at arrivals_s[i] (seconds from now); return the results and the run's wall time."""
    if len(payloads) != len(arrivals_s):
        raise ValueError(f"{len(payloads)} payloads but {len(arrivals_s)} arrival times")
    deadline = run_timeout_s if run_timeout_s is not None else max(arrivals_s, default=0) + RUN_SLACK_S
    limits = httpx.Limits(max_connections=len(payloads) + 1, max_keepalive_connections=len(payloads) + 1)
    url = base_url.rstrip("/") + endpoint
    # trust_env=False: a proxy from the environment must never sit between us and the server.
    async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s), limits=limits, trust_env=False) as client:
        t0 = time.perf_counter()

        async def one(payload: dict, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            sent = time.perf_counter() - t0
            try:
                res = await stream_one(client, url, payload)
            except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
                res = RequestResult(ok=False, error=f"{type(e).__name__}: {e}")
            res.sent_s = sent
            if on_done is not None:
                on_done(res)
            return res

        tasks = [asyncio.create_task(one(p, a)) for p, a in zip(payloads, arrivals_s)]
        done, pending = await asyncio.wait(tasks, timeout=deadline)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - t0
    results = [t.result() if t in done else RequestResult(ok=False, error=f"still open after {deadline:.0f} s")
               for t in tasks]
    return results, wall


def summarize(results: list[RequestResult], wall_s: float) -> dict:
    """vLLM's serving metrics: throughput over the run, TTFT and ITL percentiles (ms) over requests."""
    ok = [r for r in results if r.ok]
    itls = [g for r in ok for g in r.itl_s]
    out_tokens = sum(r.output_tokens for r in ok)
    ms = 1e3
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "wall_s": wall_s,
        "server_errors": sum(1 for r in results if r.status is not None and r.status >= 500),
        "req_per_s": len(ok) / wall_s if wall_s > 0 else float("nan"),
        "output_tok_per_s": out_tokens / wall_s if wall_s > 0 else float("nan"),
        "output_tokens": out_tokens,
        "ttft_p50_ms": percentile([r.ttft_s * ms for r in ok], 50),
        "ttft_p99_ms": percentile([r.ttft_s * ms for r in ok], 99),
        "itl_p50_ms": percentile([g * ms for g in itls], 50),
        "itl_p99_ms": percentile([g * ms for g in itls], 99),
        "e2e_p50_ms": percentile([r.latency_s * ms for r in ok], 50),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


def load_at_rates(base_url: str, payloads: list[dict], rates: list[float], seed: int,
                  description: str) -> list[tuple[float, dict, list[RequestResult]]]:
    """Warm the server up, then send `payloads` at each rate (Poisson arrivals, the same `seed` at every
    rate) under a progress bar: [(rate, summary, results)]."""
    from rich.progress import Progress

    warm = chat_payloads(payloads[0]["model"], WARMUP_REQUESTS, WARMUP_MAX_TOKENS)  # no shared prefix in them
    asyncio.run(run_load(base_url, warm, [0.0] * WARMUP_REQUESTS))
    rows = []
    with Progress(transient=True) as progress:
        task = progress.add_task(description, total=len(payloads) * len(rates))
        for rate in rates:
            progress.update(task, description=f"{description}: {rate:g} req/s")
            results, wall = asyncio.run(run_load(base_url, payloads, poisson_arrivals(len(payloads), rate, seed),
                                                 on_done=lambda _: progress.advance(task)))
            rows.append((rate, summarize(results, wall), results))
    return rows


def scrape_metrics(url: str) -> dict[str, float]:
    """A server's /metrics under `url` (its root, not /v1), sample name -> value: what a Prometheus scrape sees."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url.rstrip("/") + "/metrics", timeout=SCRAPE_TIMEOUT_S, trust_env=False).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m measure.load_gen",
                                description="Poisson load of streaming chat requests against a running server.")
    p.add_argument("--base-url", default=DEFAULT_BASE_URL)
    p.add_argument("--model", default=None, help="model id (default: the server's first /v1/models entry)")
    p.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    p.add_argument("--n", type=int, default=16, help="number of requests")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--ignore-eos", action="store_true", help="every request runs to max_tokens")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    model = args.model
    if model is None:
        with httpx.Client(trust_env=False, timeout=10) as c:
            model = c.get(args.base_url.rstrip("/") + "/models").json()["data"][0]["id"]
    payloads = chat_payloads(model, args.n, args.max_tokens, ignore_eos=args.ignore_eos)
    results, wall = asyncio.run(run_load(args.base_url, payloads, poisson_arrivals(args.n, args.rate, args.seed)))
    for k, v in summarize(results, wall).items():
        print(f"{k:>18}: {v:.2f}" if isinstance(v, float) else f"{k:>18}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
