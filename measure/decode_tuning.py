"""The decode kernel's launch settings, measured: every LaunchConfig and split count on one GPU.

For each (batch, context) cell, one layer's decode attention over a pool of the
model's shape (mixed lengths in [context / 2, context], blocks scattered) is
timed for: SDPA on contiguous K/V (what a non-paged engine reads), phase 3.5's
kernel, and phase 3.9's kernel under every LaunchConfig in the grid and every
split count in SPLIT_CHOICES. `ms` is GPU time per call from CUDA-graph replays
(measure/kernel_bench.gpu_time: no host launch latency, as in the engine's
replayed decode step; `timing` says if a call could not be captured);
`ms_per_call` is CUDA events around one call from Python, launch latency
included. Bandwidth
is the K/V bytes the sequences hold (what any exact attention must read once)
over `ms`.

`best_config(rows)` is the config with the lowest total time over the cells a
serving batch lands in (batch >= 32); the winner is written into
extras/p3_9_tuned_decode_kernel/launch_configs.py's DEFAULT_CONFIG by hand, with
the table in the README. Runs on CUDA only: on a CPU the kernel runs in Triton's interpreter and timing it means nothing.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict

import torch

from extras.p3_5_paged_attention.contiguous import sdpa_decode_contiguous
from extras.p3_9_tuned_decode_kernel.launch_configs import LaunchConfig
from measure.kernel_bench import CALLS_PER_GRAPH, GRAPH_REPLAY, PER_CALL, gpu_time, lengths_for, median_ms
from phases.p3_1_block_allocator.allocator import blocks_for
from phases.p3_5_paged_attention.kernels import paged_decode_attention_triton
from phases.p3_9_tuned_decode_kernel.decode_kernel import tiled_decode_attention
from phases.p3_9_tuned_decode_kernel.split_rule import sm_count

TILE_CHOICES = (1, 2, 4, 8)
WARP_CHOICES = (2, 4, 8)
STAGE_CHOICES = (1, 2, 3)   # 4 builds the same kernel as 3 (identical PTX for sm_90 with triton 3.7: measure/decode_aot_check.py),
                            # so timing it would measure only noise
SPLIT_CHOICES = (1, 2, 4, 8)
POOL_LAYERS = 2          # the layer read is not the first in its block (the pool interleaves layers per block)
LAYER = 1
SPARE_BLOCKS = 1         # one block no sequence owns, as in a busy pool


def config_grid() -> list[LaunchConfig]:
    return [LaunchConfig(t, w, s) for t, w, s in itertools.product(TILE_CHOICES, WARP_CHOICES, STAGE_CHOICES)]


def decode_case(batch: int, context: int, n_heads: int, n_kv_heads: int, head_dim: int, block_size: int,
                dtype: torch.dtype, device: str, seed: int = 0):
    """A pool made on the device (random K/V, shuffled blocks), q, and the same K/V contiguous for SDPA.
    (Phase 3.4's random_paged_batch draws on the CPU: minutes for the gigabytes of a GPU-sized pool.)"""
    lens = lengths_for(context, batch, seed)
    per_seq = [blocks_for(n, block_size) for n in lens]
    width = max(per_seq)
    gen = torch.Generator(device=device).manual_seed(seed)
    n_blocks = sum(per_seq) + SPARE_BLOCKS
    pool = torch.randn(n_blocks, POOL_LAYERS, 2, n_kv_heads, block_size, head_dim, device=device, dtype=dtype,
                       generator=gen)
    order = torch.randperm(n_blocks, device=device, generator=gen)
    tables = torch.zeros(batch, width, dtype=torch.int32, device=device)
    used = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = order[used:used + n].to(torch.int32)
        used += n
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(batch, n_heads, head_dim, device=device, dtype=dtype, generator=gen)
    # Contiguous K/V [B, n_kv_heads, width * block_size, head_dim] from the same blocks.
    blocks = pool[tables.long(), LAYER]                      # [B, width, 2, H_kv, bs, D]
    k = blocks[:, :, 0].permute(0, 2, 1, 3, 4).reshape(batch, n_kv_heads, width * block_size, head_dim)
    v = blocks[:, :, 1].permute(0, 2, 1, 3, 4).reshape(batch, n_kv_heads, width * block_size, head_dim)
    kv_bytes = sum(lens) * n_kv_heads * head_dim * 2 * pool.element_size()
    return q, pool, tables, seq_lens, k.contiguous(), v.contiguous(), kv_bytes


def tune(batches: list[int], contexts: list[int], n_heads: int, n_kv_heads: int, head_dim: int,
         block_size: int = 16, dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
         configs: list[LaunchConfig] | None = None, splits=SPLIT_CHOICES, warmup: int = 3, iters: int = 20,
         progress=None) -> list[dict]:
    """One row per (batch, context, kernel, config, splits): ms (GPU time, graph replay), ms_per_call (launch
    included), GB/s (over ms) and max |out - SDPA|."""
    configs = configs or config_grid()
    rows = []
    for batch, context in itertools.product(batches, contexts):
        q, pool, tables, lens, k, v, kv_bytes = decode_case(batch, context, n_heads, n_kv_heads, head_dim,
                                                            block_size, dtype, device)
        scale = head_dim ** -0.5
        sdpa_out = sdpa_decode_contiguous(q, k, v, lens, scale)

        def row(kernel, fn, config=None, n_splits=1):
            err = float((fn().float() - sdpa_out.float()).abs().max())
            per_call = median_ms(fn, device, warmup, iters)
            gpu = gpu_time(fn, device, warmup, iters)
            rows.append(dict(batch=batch, context=context, kernel=kernel, splits=n_splits, ms=gpu.ms,
                             ms_per_call=per_call, timing=gpu.how, gb_per_s=kv_bytes / gpu.ms / 1e6, err=err,
                             kv_bytes=kv_bytes, **(asdict(config) if config else {})))

        row("sdpa_contiguous", lambda: sdpa_decode_contiguous(q, k, v, lens, scale))
        row("p3_5", lambda: paged_decode_attention_triton(q, pool, LAYER, tables, lens, scale))
        for config, n_splits in itertools.product(configs, splits):
            row("p3_9", lambda: tiled_decode_attention(q, pool, LAYER, tables, lens, scale, n_splits=n_splits,
                                                       config=config, check_values=False), config, n_splits)
        if progress:
            progress(batch, context, rows)
        del pool, k, v
        torch.cuda.empty_cache()
    return rows


def best_config(rows: list[dict], min_batch: int = 32) -> dict | None:
    """(tile_blocks, num_warps, num_stages) with the least total ms over cells with batch >= min_batch,
    each config at its best split count per cell; None when no cell is that large (a quick run)."""
    totals: dict[tuple, float] = {}
    cells: dict[tuple, dict[tuple, float]] = {}
    for r in rows:
        if r["kernel"] != "p3_9" or r["batch"] < min_batch:
            continue
        key = (r["tile_blocks"], r["num_warps"], r["num_stages"])
        cell = (r["batch"], r["context"])
        cells.setdefault(key, {})
        cells[key][cell] = min(cells[key].get(cell, float("inf")), r["ms"])
    for key, per_cell in cells.items():
        totals[key] = sum(per_cell.values())
    if not totals:
        return None
    best = min(totals, key=totals.get)
    return dict(tile_blocks=best[0], num_warps=best[1], num_stages=best[2], total_ms=totals[best])


# --- `python -m measure.decode_tuning --out DIR`: the sweep behind DEFAULT_CONFIG, split_rule.py
GRID_BATCHES, GRID_CONTEXTS = [32, 64, 128, 256], [512, 1024, 2048]
SPLIT_BATCHES, SPLIT_CONTEXTS = [1, 4, 16, 32, 64, 128, 256], [512, 2048, 8192]
QWEN3_0_6B = dict(n_heads=16, n_kv_heads=8, head_dim=128)   # the shape the GPU runs use (dummy:qwen3-0.6b)


def main() -> None:
    import argparse
    import json
    from pathlib import Path

    p = argparse.ArgumentParser(description="time every decode-kernel launch config and split count (CUDA)")
    p.add_argument("--out", default="results", help="folder for decode-tune_<gpu>.json")
    args = p.parse_args()
    shape = dict(QWEN3_0_6B, block_size=16, dtype=torch.bfloat16)
    name = torch.cuda.get_device_name(0)

    def say(batch, context, rows):
        cell = [r for r in rows if r["batch"] == batch and r["context"] == context and r["kernel"] == "p3_9"]
        best = min(cell, key=lambda r: r["ms"])
        print(f"batch {batch} context {context}: best {best['ms']:.4f} ms GPU ({best['gb_per_s']:.0f} GB/s; "
              f"{best['ms_per_call']:.4f} ms per call) tile {best['tile_blocks']} warps {best['num_warps']} stages "
              f"{best['num_stages']} x{best['splits']}", flush=True)

    slug = name.lower().replace(" ", "-")
    path = Path(args.out) / f"decode-tune_{slug}_qwen3-0.6b-shape.json"

    def save(grid, best, splits):       # after each sweep: a run cut short keeps the grid
        path.write_text(json.dumps(dict(device=name, shape={k: str(v) for k, v in shape.items()}, grid=grid,
                                        best=best, splits=splits, sms=sm_count("cuda"),
                                        timing=f"ms: {GRAPH_REPLAY} ({CALLS_PER_GRAPH} calls per graph); "
                                               f"ms_per_call: {PER_CALL}; split-KV merge: merge_kernel.py",
                                        made_by="python -m measure.decode_tuning")))

    grid = tune(GRID_BATCHES, GRID_CONTEXTS, splits=(1, 2), progress=say, **shape)
    best = best_config(grid)
    save(grid, best, [])
    print(f"best {best}", flush=True)
    chosen = LaunchConfig(best["tile_blocks"], best["num_warps"], best["num_stages"])
    one_block = LaunchConfig(1, 4, 1)        # a one-block tile, as phase 3.5 reads, for comparison
    splits = tune(SPLIT_BATCHES, SPLIT_CONTEXTS, configs=[chosen, one_block], splits=SPLIT_CHOICES + (16,),
                  progress=say, **shape)
    save(grid, best, splits)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
