"""The tuned kernel on the clock: one layer's decode attention beside SDPA and phase 3.5's kernel, and the sweep.

Two report sections, each `section(cfg, lm, report)` (measure/demos.run_sections):
  kernel  one layer's decode attention, the model's shape, mixed lengths in [context / 2, context]:
          SDPA on contiguous K/V, phase 3.5's kernel and this phase's (launch_config, split count
          from split_rule.py); median GPU ms per call from CUDA-graph replays (no host launch latency,
          measure/kernel_bench.gpu_time) and this phase's per call from Python (launch included), GB/s
          of K/V read and that as a share of the GPU's HBM bandwidth (nominal, and a measured
          device-to-device copy). CPU: the kernels only run in Triton's interpreter, so they are
          checked on the first cell, not timed.
  tune    (GPU) every LaunchConfig x split count (measure/decode_tuning.py): the best configs and, per cell,
          the best split count beside the rule's choice.
`cfg` carries kernel_batches, kernel_contexts and block_size.
"""

from __future__ import annotations

import torch

from extras.p3_5_paged_attention.contiguous import sdpa_decode_contiguous
from measure.demos import Option, RunConfig
from measure.kernel_bench import CALLS_PER_GRAPH, GRAPH_REPLAY, PER_CALL, gpu_time, median_ms
from measure.report import Report
from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE
from phases.p3_5_paged_attention.kernels import paged_decode_attention_triton
from extras.p3_9_tuned_decode_kernel.launch_configs import DEFAULT_CONFIG, launch_config
from phases.p3_9_tuned_decode_kernel.decode_kernel import tiled_decode_attention
from phases.p3_9_tuned_decode_kernel.split_rule import choose_splits, sm_count
from measure.decode_tuning import LAYER, best_config, decode_case, tune

# Nominal HBM bandwidth (bytes/s) by GPU name: the datasheets' figures.
HBM_BYTES_PER_S = {"H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12, "H200": 4.8e12, "A100-SXM4-80GB": 2.04e12}
COPY_BYTES = 2 << 30     # the measured-bandwidth copy: 2 GiB read and 2 GiB written

# The options the two sections read, for every demo that runs them; and their quick settings.
KERNEL_OPTIONS = [Option("kernel_batches", int, cpu=[2, 8], gpu=[32, 64, 128, 256], many=True,
                         help="kernel section batch sizes"),
                  Option("kernel_contexts", int, cpu=[64], gpu=[512, 1024, 2048], many=True,
                         help="kernel section context lengths"),
                  Option("block_size", int, cpu=DEFAULT_BLOCK_SIZE, help="tokens per KV block")]
KERNEL_QUICK = dict(kernel_batches=[2], kernel_contexts=[32])


def nominal_hbm(device_name: str) -> float | None:
    return next((bw for name, bw in HBM_BYTES_PER_S.items() if name in device_name), None)


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy, counting bytes read and written (what HBM can give a kernel)."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), "cuda", warmup=2, iters=5)
    del src, dst
    return 2 * COPY_BYTES / (ms / 1e3)


# --- kernel --------------------------------------------------------------------------------------
def kernel_section(cfg: RunConfig, lm, report: Report) -> None:
    on_gpu = torch.device(lm.device).type == "cuda"   # the kernels are timed only there (CPU: the interpreter)
    name = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    nominal, measured = (nominal_hbm(name), copy_bandwidth()) if on_gpu else (None, None)
    t = report.table(f"decode attention, one layer ({lm.n_heads} query heads over {lm.n_kv_heads} KV heads, "
                     f"head_dim {lm.head_dim}, block_size {cfg.block_size}, {str(lm.dtype).removeprefix('torch.')})",
                     ["batch", "context", "splits", "SDPA ms", "p3_5 ms", "p3_9 ms", "p3_9 ms per call", "p3_9 GB/s",
                      "% of HBM", "% of copy", "p3_9/SDPA", "p3_5/SDPA", "p3_9 err"])
    rows = []
    for i, (batch, context) in enumerate((b, c) for b in cfg.kernel_batches for c in cfg.kernel_contexts):
        q, pool, tables, lens, k, v, kv_bytes = decode_case(batch, context, lm.n_heads, lm.n_kv_heads, lm.head_dim,
                                                            cfg.block_size, lm.dtype, lm.device)
        splits = choose_splits(batch, lm.n_kv_heads, sm_count(lm.device), tables.shape[1])
        ref = sdpa_decode_contiguous(q, k, v, lens)
        ours = lambda: tiled_decode_attention(q, pool, LAYER, tables, lens, n_splits=splits,   # noqa: E731
                                              check_values=False)
        if not on_gpu:
            err = float((ours().float() - ref.float()).abs().max()) if i == 0 else None
            t.add_row(batch, context, splits, median_ms(lambda: sdpa_decode_contiguous(q, k, v, lens), lm.device),
                      "-", "not timed (CPU)", "-", "-", "-", "-", "-", "-", f"{err:.1e}" if err is not None else "-")
            continue
        # GPU time from graph replays (no host launch latency, as in the engine's replayed step); one per-call
        # figure beside it, launch included, as an eager engine would pay it.
        sdpa = gpu_time(lambda: sdpa_decode_contiguous(q, k, v, lens), lm.device)
        old = gpu_time(lambda: paged_decode_attention_triton(q, pool, LAYER, tables, lens), lm.device)
        new = gpu_time(ours, lm.device)
        per_call = median_ms(ours, lm.device)
        gbs = kv_bytes / new.ms / 1e6
        err = float((ours().float() - ref.float()).abs().max())
        share = 100 * gbs * 1e9 / nominal if nominal else None
        t.add_row(batch, context, splits, sdpa.cell(), old.cell(), new.cell(), per_call, gbs, share if share else "-",
                  100 * gbs * 1e9 / measured, new.ms / sdpa.ms, old.ms / sdpa.ms, f"{err:.1e}")
        rows.append(dict(batch=batch, context=context, splits=splits, sdpa_ms=sdpa.ms, p3_5_ms=old.ms, p3_9_ms=new.ms,
                         p3_9_per_call_ms=per_call, gb_per_s=gbs, hbm_share=share,
                         copy_share=100 * gbs * 1e9 / measured, err=err,
                         timing=dict(sdpa=sdpa.how, p3_5=old.how, p3_9=new.how)))
    notes = [f"ms: {GRAPH_REPLAY}, {CALLS_PER_GRAPH} calls captured in one CUDA graph and replayed back to back "
             "(no host launch latency, as in the engine's replayed step; a cell that says otherwise could not be "
             f"captured); p3_9 ms per call: {PER_CALL} (CUDA events around one call from Python, what an eager "
             "engine pays). GB/s: the K/V bytes the sequences hold over the p3_9 GPU time."]
    if nominal:
        notes.append(f"% of HBM: of the datasheet's {nominal / 1e12:.2f} TB/s.")
    if measured:
        notes.append(f"% of copy: of a measured device-to-device copy ({measured / 1e12:.2f} TB/s, read + write).")
    config = launch_config(lm.head_dim, lm.dtype)
    t.notes.append(" ".join(notes + [f"p3_9 launch: {config} (launch_configs.launch_config); splits: "
                                     "split_rule.choose_splits."]))
    report.data["kernel"] = dict(rows=rows, nominal_hbm=nominal, copy_bandwidth=measured, config=vars(config))


# --- tune ------------------------------------------------------------------------------------------
def tune_section(cfg: RunConfig, lm, report: Report) -> None:
    if torch.device(lm.device).type != "cuda":
        report.table("tuning sweep", ["note"]).add_row("GPU only: the kernels run in Triton's interpreter on a CPU")
        return
    shape = dict(n_heads=lm.n_heads, n_kv_heads=lm.n_kv_heads, head_dim=lm.head_dim, block_size=cfg.block_size,
                 dtype=lm.dtype)
    rows = tune(cfg.kernel_batches, cfg.kernel_contexts, splits=(1, 2), **shape)
    best = best_config(rows)
    t = report.table("launch configs, total ms over the batch >= 32 cells (each at its better split count)",
                     ["tile_blocks", "num_warps", "num_stages", "total ms"])
    totals: dict[tuple, dict] = {}
    for r in rows:
        if r["kernel"] == "p3_9" and r["batch"] >= 32:
            key = (r["tile_blocks"], r["num_warps"], r["num_stages"])
            cell = (r["batch"], r["context"])
            totals.setdefault(key, {})[cell] = min(totals[key].get(cell, float("inf")), r["ms"])
    for key, per_cell in sorted(totals.items(), key=lambda kv: sum(kv[1].values()))[:10]:
        t.add_row(*key, sum(per_cell.values()))
    t.notes.append(f"best: {best or 'none (no cell with batch >= 32)'}; launch_configs.DEFAULT_CONFIG is "
                   f"{DEFAULT_CONFIG}")
    report.data["tune"] = dict(rows=rows, best=best)
