"""`tp_demo`: the same requests on one worker and on a tensor-parallel group; what each worker holds and sends.

Both engines run phase 4.5's engine (chunked prefill, prefix caching,
preemption) on the same requests, EOS ignored, after a warm-up each:

1. outputs: identical token for token, and the step time of each;
2. per worker: the heads and MLP features it holds, its weight bytes, the
   bytes of one KV block, and how many blocks the KV memory of the one-worker
   pool buys it (at equal memory per device, a worker holding half the heads
   holds twice the blocks);
3. communication per forward pass: the all-reduces (count, bytes, time on
   this backend), the logits gathered, the control message;
4. on paper: the same all-reduces over NVLink and PCIe, from their bandwidth.
"""

from __future__ import annotations

import torch

from common.clock import now
from common.processes import backend_for
from common.prompts import SHORT_PROMPTS, LONG_PROMPTS
from measure.collectives import count_collectives, count_messages
from measure.demos import Option, RunConfig, demo
from measure.harness import run_prompts
from measure.report import Report
from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE
from phases.p4_5_speculative_decoding.engine import SpeculativeEngine
from phases.p4_6_model_sharding.lockstep import param_bytes
from phases.p4_7_tensor_parallel.engine import TensorParallelEngine
from phases.p4_7_tensor_parallel.workers import launch

QUICK = dict(n_requests=2, max_new_tokens=3, max_running=2, n_blocks=64)
WARMUP_NEW_TOKENS = 2
PASS_TOKENS = (1, 64, 256, 2048)   # a decode pass of 1 and 64 sequences, and prefill-sized passes
# Links a tensor-parallel group's all-reduces cross, in GB per second each way per GPU (the vendors' figures):
# NVLink 4 on an H100 SXM (half of its 900 both ways), PCIe 5.0 x16 and PCIe 4.0 x16.
LINKS_GB_S = {"NVLink 4 (H100)": 450.0, "PCIe 5.0 x16": 64.0, "PCIe 4.0 x16": 32.0}


def ring_all_reduce_s(n_bytes: int, world: int, gb_s: float) -> float:
    """A ring all-reduce of n_bytes moves 2 (world - 1) / world of them in and out of every GPU: its time at
    the link's bandwidth, latency left out (so a lower bound)."""
    return 2 * (world - 1) / world * n_bytes / (gb_s * 1e9)


def _run(engine, prompts: list[str], max_new_tokens: int, label: str) -> dict:
    steps_before = engine.n_steps
    t0, seqs = run_prompts(engine, prompts, max_new_tokens, label, ignore_eos=True)
    seqs = seqs[-len(prompts):]          # an engine's run returns every sequence it has finished
    wall = now(engine.lm.device) - t0
    steps = engine.n_steps - steps_before
    return dict(outputs=[s.output_ids for s in seqs], wall_s=wall, steps=steps, ms_per_step=1000 * wall / steps,
                tok_s=sum(len(s.output_ids) for s in seqs) / wall)


@demo("tp_demo", phase="p4_7",
      help="tensor parallelism: 1 worker vs N on the same requests; bytes per worker, blocks at equal memory, "
           "all-reduces per pass",
      options=[
          Option("tp", int, cpu=2, gpu=2, help="workers in the tensor-parallel group"),
          Option("n_requests", int, cpu=8, gpu=64, help="requests, all arriving at t = 0"),
          Option("max_new_tokens", int, cpu=16, gpu=64, help="tokens generated per request (EOS ignored)"),
          Option("max_running", int, cpu=8, gpu=64, help="sequences running at once"),
          Option("block_size", int, cpu=DEFAULT_BLOCK_SIZE, help="tokens per KV block"),
          Option("n_blocks", int, cpu=256, gpu=2048, help="KV pool blocks of the one-worker engine"),
      ])
def tp_demo(cfg: RunConfig) -> Report:
    cfg.use_quick(**QUICK)
    lm = cfg.load()
    opts = cfg.options
    if opts["n_requests"] < 1 or opts["max_new_tokens"] < 1:
        raise ValueError("n_requests and max_new_tokens must be >= 1")
    report = cfg.new_report("tp_demo")
    prompts = [(SHORT_PROMPTS + LONG_PROMPTS)[i % (len(SHORT_PROMPTS) + len(LONG_PROMPTS))]
               for i in range(opts["n_requests"])]
    kwargs = dict(max_running=opts["max_running"], block_size=opts["block_size"], n_blocks=opts["n_blocks"])
    tp = opts["tp"]

    one = SpeculativeEngine(lm, cuda_graphs=False, **kwargs)
    _run(one, prompts[:2], WARMUP_NEW_TOKENS, "warm-up, 1 worker")
    threads = torch.get_num_threads()
    r1 = _run(one, prompts, opts["max_new_tokens"], "1 worker")
    r1_thread = None
    if not cfg.on_gpu and threads > 1:
        # What one worker does on one core: each worker of the group below gets threads // tp of them.
        torch.set_num_threads(max(1, threads // tp))
        try:
            r1_thread = _run(one, prompts, opts["max_new_tokens"], "1 worker, fewer threads")
        finally:
            torch.set_num_threads(threads)
    group, tlm = launch(cfg.model, tp, device=lm.device, dtype=lm.dtype)
    try:
        many = TensorParallelEngine(tlm, group, **kwargs)
        _run(many, prompts[:2], WARMUP_NEW_TOKENS, f"warm-up, {tp} workers")
        s, messages = count_collectives(group.comm), count_messages(group)   # from here on, on the driver
        passes = tlm.model.n_passes
        rn = _run(many, prompts, opts["max_new_tokens"], f"{tp} workers")
        n_ar, ar_bytes, ar_s, g_bytes = s.n_all_reduce, s.all_reduce_bytes, s.all_reduce_seconds, s.gather_bytes
        msg_bytes, passes = sum(messages.bytes.values()), tlm.model.n_passes - passes
        held = dict(group.held)
        pool_bytes_one = one.allocator.kv_store.numel() * one.allocator.kv_store.element_size()
        block_bytes = {r: pool_bytes_one // opts["n_blocks"] * h["n_kv_heads"] // lm.n_kv_heads
                       for r, h in held.items()}
    finally:
        group.close()

    runs = report.table("Same requests, 1 worker and a tensor-parallel group",
                        ["workers", "threads each", "backend", "outputs identical", "steps", "ms/step", "tok/s"])
    each = "-" if cfg.on_gpu else threads
    runs.add_row(1, each, "-", True, r1["steps"], r1["ms_per_step"], r1["tok_s"])
    if r1_thread is not None:
        runs.add_row(1, max(1, threads // tp), "-", r1_thread["outputs"] == r1["outputs"], r1_thread["steps"],
                     r1_thread["ms_per_step"], r1_thread["tok_s"])
    same = sum(a == b for a, b in zip(r1["outputs"], rn["outputs"]))
    runs.add_row(tp, "-" if cfg.on_gpu else max(1, threads // tp), backend_for(lm.device), same == len(prompts),
                 rn["steps"], rn["ms_per_step"], rn["tok_s"])
    runs.notes += [f"{len(prompts)} requests, {opts['max_new_tokens']} new tokens each (EOS ignored), "
                   f"{opts['max_running']} running at once; {same}/{len(prompts)} outputs identical to 1 worker's",
                   f"{report.meta.get('cpu_count')} CPU cores: the group's {tp} processes split the threads of one"
                   if not cfg.on_gpu else f"GPU: {report.meta.get('device_name')}, one per worker",
                   "in bf16 a row-parallel layer rounds each worker's partial sum before adding them, so a near-tie "
                   "can break the other way than in one matmul; in fp32 the tests require identical tokens"]

    workers = report.table("What each worker holds",
                           ["rank", "query heads", "KV heads", "MLP features", "weights (MB)", "KV bytes/block",
                            "blocks at equal memory"])
    workers.add_row("1 worker", lm.n_heads, lm.n_kv_heads, lm.model.config.intermediate_size,
                    param_bytes(lm.model) / 2**20, pool_bytes_one // opts["n_blocks"], opts["n_blocks"])
    for rank, h in sorted(held.items()):
        lo, hi = h["intermediate"]
        workers.add_row(rank, h["n_heads"], h["n_kv_heads"], hi - lo, h["param_bytes"] / 2**20, block_bytes[rank],
                        pool_bytes_one // block_bytes[rank])
    workers.notes += [f"blocks at equal memory: how many of its blocks fit in the {pool_bytes_one / 2**20:.1f} MB of "
                      f"the one-worker pool ({opts['n_blocks']} blocks); the group holds as many as its fullest "
                      "worker allows",
                      "heads are cut by KV-head group (a query head stays with the KV head it reads); the "
                      "vocabulary rows of the embedding and LM head are cut evenly"]

    per_pass = report.table("Communication per forward pass (measured on the driver)",
                            ["all-reduces", "bytes each (mean)", "all-reduce ms", "logits gathered (bytes)",
                             "control message (bytes)"])
    per_pass.add_row(n_ar / passes, ar_bytes / max(n_ar, 1), 1000 * ar_s / passes, g_bytes / passes,
                     msg_bytes / passes)
    per_pass.notes += [f"{passes} passes; per layer one all-reduce after o_proj and one after down_proj, plus one "
                       f"for the embedding: {2 * lm.n_layers + 1} per pass",
                       "an all-reduce's bytes are tokens in the pass x hidden size x bytes per element"]

    paper = report.table("The same all-reduces on GPU links, from bandwidth alone",
                         ["tokens in the pass", "bytes per all-reduce", *[f"{k} (us/pass)" for k in LINKS_GB_S]])
    elem = torch.tensor([], dtype=lm.dtype).element_size()
    hidden = lm.model.config.hidden_size
    for tokens in PASS_TOKENS:
        n = tokens * hidden * elem
        paper.add_row(tokens, n, *[1e6 * (2 * lm.n_layers + 1) * ring_all_reduce_s(n, tp, gb)
                                   for gb in LINKS_GB_S.values()])
    paper.notes.append(f"ring all-reduce over {tp} GPUs, latency left out: a lower bound; a small all-reduce "
                       "costs a few microseconds of latency on any link")
    report.data.update(one=dict((k, v) for k, v in r1.items() if k != "outputs"),
                       one_fewer_threads=None if r1_thread is None else
                       dict((k, v) for k, v in r1_thread.items() if k != "outputs"),
                       many=dict((k, v) for k, v in rn.items() if k != "outputs"), tp=tp, identical=same,
                       held={str(k): v for k, v in held.items()}, all_reduce_per_pass=n_ar / passes,
                       all_reduce_ms_per_pass=1000 * ar_s / passes, message_bytes_per_pass=msg_bytes / passes)
    return report
