"""Phase 3.5's demos: `tput` with every engine, and `workload_bench` (vLLM-style equal and mixed work).

`tput` takes over phase 3.3's demo of that name (`extends="p3_3"`): the same
batch-size sweep over the blog's prompts, now with static batching (p2_1),
per-sequence continuous batching (p2_3), per-sequence paged (p3_3), the
batched paged engine (p3_5) and transformers' `generate_batch`; on CUDA also
transformers' compiled static-cache `generate` (`hf_compiled`).

`workload_bench` compares engines on the kind of trace vLLM's benchmarks use:
N requests with random-token prompts of 16-128 tokens and fixed per-request
output lengths, EOS ignored, so every engine does exactly the same work.
  equal: every request wants the same number of tokens (64);
  mixed: the same prompts, output lengths spread over 16-256 — a static
         batch must carry every row to the longest, continuous engines don't.
Then: how close the batched engine gets to this machine's compute roofline,
and a profile of one full-batch decode step (where the time goes).

Fair peers: every engine is warmed up on the workload's own shapes right
before its timed run (`measure` in phase 3.3's tput.py: on CUDA the same
requests, since compiled code is built per shape), and each row's settings
(cache, compile, page/block size, pool, max_running) are in the table notes
and in `report.data`, so a reader can rerun any row.
"""

from __future__ import annotations

from common.demos import Option, RunConfig, demo
from common.report import Report
from common.workload import EQUAL_WORK_N, equal_work, mixed_work
from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE, blocks_for
from phases.p3_3_paged_cache.tput import (EngineRunner, format_settings, measure, plot_tput, run_tput,
                                          tput_options, warmup_rule)
from phases.p3_5_paged_attention.engine import BatchedPagedEngine
from phases.p3_5_paged_attention.roofline import (measure_matmul_flops, profile_decode_step,
                                                  roofline_tokens_per_s)
from phases.p3_5_paged_attention.runners import (ALL_ENGINES, HF_COMPILED, HF_STATIC, ON_REQUEST,
                                                 default_engines, run_hf_cb)

# (page_size, max_batch_tokens) tried for generate_batch; the table keeps its best.
HF_CB_CONFIGS = ["16:256", "16:1024", "32:512"]
QUICK = dict(n=4, prompt_len=(4, 12), output_len=4, mixed_output=(2, 6))
WORKLOAD_ENGINES = ["hf_static", "hf_cb", "paged", "batched"]
WORKLOAD_ENGINES_GPU = ["hf_static", "hf_compiled", "hf_cb", "paged", "batched"]
TARGETS = {  # (workload, faster engine, slower engine) -> the ratio the issue asks for
    ("equal", "batched", "hf_cb"): 3.0,
    ("equal", "batched", "hf_static"): 1.0,
    ("mixed", "batched", "hf_static"): 1.5,
    ("mixed", "batched", "paged"): 3.0,
}


@demo("tput", phase="p3_5", extends="p3_3", options=tput_options(), plot=plot_tput,
      help="KV memory and tok/s per batch size for every engine, ours and transformers'")
def tput(cfg: RunConfig) -> Report:
    return run_tput(cfg, default_engines(cfg.on_gpu), on_request=ON_REQUEST)


def _hf_cb_runner(config: str) -> EngineRunner:
    page, mbt = (int(x) for x in config.split(":"))
    return EngineRunner(f"hf_cb[{config}]", f"generate_batch page_size {page}, max_batch_tokens {mbt}",
                        lambda lm, reqs, mr: run_hf_cb(lm, reqs, mr, page_size=page, max_batch_tokens=mbt))


def _workloads(cfg: RunConfig, vocab: int) -> dict:
    n, plen, out, mixed = cfg.n_requests, (cfg.prompt_min, cfg.prompt_max), cfg.output_len, (cfg.mixed_min, cfg.mixed_max)
    if cfg.quick:
        n, plen, out, mixed = QUICK["n"], QUICK["prompt_len"], QUICK["output_len"], QUICK["mixed_output"]
    return {"equal": equal_work(vocab, n, plen, out), "mixed": mixed_work(vocab, n, plen, mixed)}


@demo("workload_bench", phase="p3_5",
      help="engines on equal and mixed work (vLLM-style trace), ratios vs targets, roofline, step profile",
      options=[
          Option("n_requests", int, cpu=EQUAL_WORK_N, gpu=256, help="requests per workload"),
          Option("prompt_min", int, cpu=16, help="shortest prompt (tokens)"),
          Option("prompt_max", int, cpu=128, help="longest prompt (tokens)"),
          Option("output_len", int, cpu=64, help="new tokens per request, equal workload"),
          Option("mixed_min", int, cpu=16, help="shortest output, mixed workload"),
          Option("mixed_max", int, cpu=256, help="longest output, mixed workload"),
          Option("workloads", str, cpu=["equal", "mixed"], many=True, help="equal and/or mixed"),
          Option("engines", str, cpu=WORKLOAD_ENGINES, gpu=WORKLOAD_ENGINES_GPU, many=True,
                 help="from: static dyn paged batched hf_static hf_compiled hf_cb"),
          Option("hf_cb_configs", str, cpu=HF_CB_CONFIGS, many=True, help="page_size:max_batch_tokens for hf_cb"),
      ])
def workload_bench(cfg: RunConfig) -> Report:
    from rich.progress import Progress

    lm = cfg.load()
    report = cfg.new_report("workload_bench")
    workloads = {k: v for k, v in _workloads(cfg, lm.vocab_size).items() if k in cfg.workloads}
    hf_cb_configs = cfg.hf_cb_configs[:1] if cfg.quick else cfg.hf_cb_configs
    by_name = {e.name: e for e in ALL_ENGINES + [HF_STATIC, HF_COMPILED]}
    unknown = set(cfg.engines) - set(by_name)
    if unknown:
        raise ValueError(f"unknown engine(s) {sorted(unknown)}; choose from {sorted(by_name)}")
    max_running = max(len(r) for r in workloads.values())

    results: dict[str, dict[str, dict]] = {}
    n_runs = len(workloads) * (len(cfg.engines) - ("hf_cb" in cfg.engines) + ("hf_cb" in cfg.engines) * len(hf_cb_configs))
    with Progress(transient=True) as progress:
        task = progress.add_task("workload_bench", total=n_runs)
        for wname, requests in workloads.items():
            results[wname] = {}
            for name in cfg.engines:
                runners = [_hf_cb_runner(c) for c in hf_cb_configs] if name == "hf_cb" else [by_name[name]]
                rows = []
                for runner in runners:
                    progress.update(task, description=f"{wname}: {runner.name}")
                    rows.append(measure(lm, runner, requests, max_running))   # warms up on these requests first
                    progress.advance(task)
                best = max(rows, key=lambda r: r["tok_s"])
                if len(rows) > 1:
                    best["note"] = (f"best of {len(rows)} configs: " +
                                    ", ".join(f"{r['engine']} {r['tok_s']:.1f} tok/s" for r in rows))
                best["engine"] = name
                results[wname][name] = best
    _workload_tables(report, workloads, results, warmup_rule(lm.device))
    _targets_table(report, results)
    _roofline_and_profile(report, lm, workloads, results, cfg)
    report.data["results"] = {w: {e: {k: v for k, v in row.items() if k != "outputs"} for e, row in rows.items()}
                              for w, rows in results.items()}
    return report


def _workload_tables(report: Report, workloads: dict, results: dict, warmup: str) -> None:
    for wname, rows in results.items():
        reqs = workloads[wname]
        outs = [r.max_new_tokens for r in reqs]
        t = report.table(f"{wname} work: {len(reqs)} requests, prompts {min(len(r.prompt_ids) for r in reqs)}-"
                         f"{max(len(r.prompt_ids) for r in reqs)} tokens, outputs {min(outs)}-{max(outs)} tokens "
                         f"(EOS ignored)",
                         ["engine", "total tok/s", "mean ms/tok", "mean TTFT (ms)", "KV MB", "wall s",
                          "batched speedup"])
        base = rows.get("batched")
        for name, row in rows.items():
            speedup = base["tok_s"] / row["tok_s"] if base and row["tok_s"] else float("nan")
            t.add_row(name, row["tok_s"], row["ms_per_tok"], row["ttft_ms"], row["kv_peak_mb"], row["wall_s"],
                      f"{speedup:.2f}x")
        ref = next(iter(rows.values()))
        for name, row in rows.items():
            same = sum(a == b for a, b in zip(row["outputs"], ref["outputs"]))
            t.notes.append(f"{name}: {same}/{len(reqs)} outputs identical to {ref['engine']}'s"
                           + (f"; {row['note']}" if row.get("note") else ""))
        t.notes.append("Greedy outputs can differ in bf16 (different batch shapes round differently); "
                       "the fp32 tests assert token-for-token equality with HF generate.")
        t.notes.append(f"every engine: {warmup}")
        if any(name in rows for name in ("hf_static", "hf_compiled")):
            t.notes.append("hf_static, hf_compiled: every row's token i is timed when step i+1's logits are "
                           "ready (CUDA events on a GPU: no synchronize per step), so TTFT runs to the end of the "
                           "first decode step and ms/tok is the mean step time of the one padded batch")
        for name, row in rows.items():
            if row.get("settings"):
                t.notes.append(f"{name} settings: {format_settings(row['settings'])}")


def _targets_table(report: Report, results: dict) -> None:
    t = report.table("Ratios the phase aims for (same requests, one run)",
                     ["workload", "comparison", "measured", "target", "met"])
    for (wname, fast, slow), target in TARGETS.items():
        rows = results.get(wname, {})
        if fast in rows and slow in rows and rows[slow]["tok_s"]:
            ratio = rows[fast]["tok_s"] / rows[slow]["tok_s"]
            t.add_row(wname, f"{fast} / {slow} tok/s", f"{ratio:.2f}x", f">= {target:.1f}x", ratio >= target)


def _roofline_and_profile(report: Report, lm, workloads: dict, results: dict, cfg: RunConfig) -> None:
    flops = measure_matmul_flops(lm.dtype, lm.device, n=512 if cfg.quick else 2048)
    ceiling = roofline_tokens_per_s(flops, lm.n_params)
    t = report.table("Compute roofline", ["workload", "matmul GFLOP/s", "params (M)", "ceiling tok/s",
                                          "batched tok/s", "share of ceiling"])
    for wname, rows in results.items():
        if "batched" in rows:
            got = rows["batched"]["tok_s"]
            t.add_row(wname, flops / 1e9, lm.n_params / 1e6, ceiling, got, f"{100 * got / ceiling:.1f}%")
    t.notes.append(f"ceiling = measured {str(lm.dtype).removeprefix('torch.')} matmul FLOP/s / (2 x parameters): "
                   "every parameter costs a multiply and an add per token")
    # Profile one decode step with every request of the first workload running.
    requests = next(iter(workloads.values()))
    engine = BatchedPagedEngine(lm, max_running=len(requests), block_size=DEFAULT_BLOCK_SIZE,
                                n_blocks=sum(blocks_for(len(r.prompt_ids) + r.max_new_tokens, DEFAULT_BLOCK_SIZE)
                                             for r in requests))
    for r in requests:
        engine.add(r.prompt_ids, r.max_new_tokens, ignore_eos=True)
    while engine.waiting:
        engine.step()       # admit and prefill everything first
    ops = profile_decode_step(engine)
    p = report.table(f"Where one decode step's time goes ({len(engine.running)} sequences, torch.profiler self time)",
                     ["op", "self ms", "share"])
    for op in ops:
        p.add_row(op["op"], op["self_ms"], f"{100 * op['share']:.1f}%")
    report.data["roofline"] = dict(matmul_flops=flops, ceiling_tok_s=ceiling, n_params=lm.n_params)
    report.data["profile"] = ops
