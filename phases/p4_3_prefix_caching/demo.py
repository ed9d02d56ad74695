"""`prefix_demo`: many requests behind one long system prompt, with and without prefix caching.

The vLLM paper's shared-prefix experiment (§6.4): a task description with one
example (one-shot) or five (few-shot) is put in front of every request, then a
different short input. Here the task is English -> French translation (the
prompt set is in common/prompts.py), the shared part is the system prompt of
the chat template, and each request asks for one sentence. For each prompt style the same requests run twice on the
same engine settings, on PrefixCachingEngine with the cache off (every prompt
prefilled in full, as phase 4.1's engine does) and on (a prompt's cached full
blocks are mapped in, only the rest is prefilled).

All requests arrive at t = 0 and at most `max_running` run at once, so the
first wave computes the system prompt (nothing is cached yet, and requests
admitted together cannot use each other's blocks); every later request finds
it cached. Outputs have a fixed length (EOS ignored) so both runs do the same
decode work and differ only in prefill.
"""

from __future__ import annotations

import torch

from common.clock import now
from common.prompts import shared_prefix_len, translation_input, translation_system_prompt
from measure.bench import summarize
from measure.demos import Option, RunConfig, demo
from measure.harness import run_prompts
from measure.report import Report
from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE
from phases.p4_3_prefix_caching.engine import PrefixCachingEngine

QUICK = dict(n_requests=4, max_new_tokens=3, max_running=2, shots=[1])
WARMUP_REQUESTS, WARMUP_NEW_TOKENS = 2, 2


def request_ids(lm, n_shots: int, n_requests: int) -> list[list[int]]:
    """n_requests translation prompts behind the same `n_shots`-shot system prompt (common/prompts.py)."""
    system = translation_system_prompt(n_shots)
    return [lm.prompt_ids(translation_input(i), system=system) for i in range(n_requests)]


def _run(engine, prompts: list[list[int]], max_new_tokens: int, label: str) -> dict:
    t0, seqs = run_prompts(engine, prompts, max_new_tokens, label, ignore_eos=True)
    wall = now(engine.lm.device) - t0
    metrics = summarize([s.timing for s in seqs], wall)
    stats = engine.cache_stats if engine.prefix_caching else None
    prompt_tokens = sum(len(p) for p in prompts)
    skipped = stats.tokens_skipped if stats else 0
    return dict(outputs=[s.output_ids for s in seqs], wall_s=wall, mean_ttft_ms=metrics.mean_ttft_ms,
                total_tok_s=metrics.total_tok_s, prompt_tokens=prompt_tokens, prefill_tokens=prompt_tokens - skipped,
                tokens_skipped=skipped, hit_rate=stats.hit_rate if stats else float("nan"),
                blocks_hit=stats.blocks_hit if stats else 0, blocks_queried=stats.blocks_queried if stats else 0,
                evictions=engine.allocator.n_evictions if stats else 0)


def plot_prefix(report: Report, png_path) -> None:
    """Per prompt style, cache off vs on: prefill tokens computed, mean TTFT, throughput."""
    from measure import plots

    runs = report.data["runs"]
    shots = sorted({r["shots"] for r in runs})

    def by_cache(key: str) -> dict[str, list]:
        return {f"prefix cache {'on' if caching else 'off'}":
                [next(r[key] for r in runs if r["shots"] == s and r["caching"] == caching) for s in shots]
                for caching in (False, True)}

    m = report.meta
    plots.draw_panels(png_path, [
        plots.bar_panel([f"{s}-shot" for s in shots], by_cache(key), title=title, legend=first)
        for first, (title, key) in zip((True, False, False), [("prefill tokens computed", "prefill_tokens"),
                                                              ("mean TTFT (ms)", "mean_ttft_ms"),
                                                              ("total throughput (tok/s)", "total_tok_s")])
    ], title=f"prefix caching on a shared system prompt ({m.get('model')}, {m.get('device_name')})",
        panel_size=(4, 4))


@demo("prefix_demo", phase="p4_3",
      help="shared system prompt (one-shot / few-shot): hit rate, prefill skipped, TTFT, tok/s with vs without prefix caching",
      options=[
          Option("shots", int, cpu=[1, 5], gpu=[1, 5], many=True,
                 help="worked examples in the shared system prompt (1: one-shot, 5: few-shot)"),
          Option("n_requests", int, cpu=16, gpu=256, help="requests per run, all arriving at t = 0"),
          Option("max_new_tokens", int, cpu=16, gpu=64, help="tokens generated per request (EOS ignored)"),
          Option("max_running", int, cpu=4, gpu=64, help="sequences running at once"),
          Option("block_size", int, cpu=DEFAULT_BLOCK_SIZE, help="tokens per KV block"),
          Option("n_blocks", int, cpu=1024, gpu=0, help="KV pool blocks (0: size the pool from free memory)"),
      ], plot=plot_prefix)
def prefix_demo(cfg: RunConfig) -> Report:
    cfg.use_quick(**QUICK)
    lm = cfg.load()
    report = cfg.new_report("prefix_demo")
    opts = cfg.options
    if opts["n_requests"] < 1 or opts["max_new_tokens"] < 1:
        raise ValueError("n_requests and max_new_tokens must be >= 1")
    engine_kwargs = dict(max_running=opts["max_running"], block_size=cfg.block_size, n_blocks=cfg.n_blocks or None)

    workload = report.table("Shared-prefix workload (English -> French translation)",
                            ["shots", "requests", "shared prefix (tok)", "full blocks", "mean prompt (tok)",
                             "new tok each"])
    runs = report.table("With and without prefix caching (same engine settings, same requests)",
                        ["shots", "prefix cache", "hit rate", "blocks hit/looked up", "prefilled tok",
                         "skipped tok", "mean TTFT (ms)", "total tok/s", "wall (s)"])
    gains = report.table("Speedup from prefix caching", ["shots", "TTFT speedup", "throughput speedup",
                                                         "outputs identical"])
    report.data.update(block_size=cfg.block_size, runs=[])
    # Warm-up on a throwaway engine: the first forward passes pay one-off costs.
    _run(PrefixCachingEngine(lm, prefix_caching=False, **engine_kwargs), request_ids(lm, 0, WARMUP_REQUESTS),
         WARMUP_NEW_TOKENS, "warm-up")
    for shots in opts["shots"]:
        prompts = request_ids(lm, shots, opts["n_requests"])
        shared = shared_prefix_len(prompts)
        workload.add_row(shots, len(prompts), shared, shared // cfg.block_size,
                         round(sum(map(len, prompts)) / len(prompts), 1), opts["max_new_tokens"])
        result = {}
        for name in ("off", "on"):
            engine = PrefixCachingEngine(lm, prefix_caching=name == "on", **engine_kwargs)
            r = result[name] = _run(engine, prompts, opts["max_new_tokens"], f"{shots}-shot, prefix cache {name}")
            runs.add_row(shots, name, "-" if name == "off" else f"{r['hit_rate']:.0%}",
                         "-" if name == "off" else f"{r['blocks_hit']}/{r['blocks_queried']}",
                         r["prefill_tokens"], r["tokens_skipped"], r["mean_ttft_ms"], r["total_tok_s"], r["wall_s"])
            report.data["runs"].append(dict({k: v for k, v in r.items() if k != "outputs"},
                                            shots=shots, caching=name == "on"))
        off, on = result["off"], result["on"]
        same = sum(a == b for a, b in zip(off["outputs"], on["outputs"]))
        gains.add_row(shots, f"{off['mean_ttft_ms'] / on['mean_ttft_ms']:.2f}x",
                      f"{on['total_tok_s'] / off['total_tok_s']:.2f}x", f"{same}/{len(prompts)}")
    runs.notes += [
        f"CPU threads: {torch.get_num_threads()}" if not cfg.on_gpu else f"GPU: {report.meta.get('device_name')}",
        f"all requests arrive at t = 0; {opts['max_running']} run at once; block size {cfg.block_size}; "
        f"TTFT includes the time a request waits in the queue",
        "hit rate = prompt blocks found in the cache / full prompt blocks looked up ((len - 1) // block_size "
        "per request: the last prompt token is always computed)",
        "the first wave of requests is admitted together, before anything is cached: those all miss",
    ]
    gains.notes.append("outputs identical: greedy tokens equal with and without the cache (in bf16 a reused "
                       "prefix can round differently from a recomputed one; in fp32 the tests require equality)")
    return report
