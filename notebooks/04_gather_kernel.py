# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 · The gather kernel: one launch for the whole batch
#
# Phase 3.3's `PagedCache` hands attention each sequence's K/V as one contiguous tensor, and builds it with a
# Python loop: one slice per block the sequence owns, then a `torch.cat` (`gather_python`). That loop runs once
# per sequence, per layer, per decode step. Phase 3.4 reads **every sequence of a batch at once**:
#
# * `gather_reference`: one PyTorch indexing op for the whole batch (the CPU path, and the oracle);
# * `gather_triton`: one Triton kernel launch for the whole batch, one program per
#   (sequence, logical block, KV head).
#
# This notebook builds a small pool with scattered blocks, counts the work each gather does, **draws** the kernel's
# launch grid (which program reads which block of the pool and where it writes in the output), checks that the
# kernel, the reference and the Python loop agree bit for bit, and times the three. The kernel runs under Triton's
# CPU interpreter, so its time here says nothing about a GPU; the GPU numbers quoted below were measured on an H100.
# Last, the blog's road not taken (`extras/p3_4_gather_kernel/pad_stack.py`): one forward pass over a padded stack of gathered K/V.

# %%
# %matplotlib inline
import os
os.environ["TRITON_INTERPRET"] = "1"   # before any kernel module is imported: Triton runs each program in Python
import json
import statistics
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch

from measure.report import read_markdown
from phases.p3_3_paged_cache.gather import gather_python
from measure.paged_inputs import random_paged_batch
from phases.p3_4_gather_kernel.kernel import gather_triton
from phases.p3_4_gather_kernel.reference import gather_reference

# %% [markdown]
# ## 1. A pool with scattered blocks
#
# `random_paged_batch` fills a pool the way a busy engine leaves it: each sequence's blocks come from a shuffled
# free list, so they are scattered. Three sequences of 6, 13 and 3 tokens, blocks of 4 tokens, 2 KV heads of
# dimension 8, 2 layers, and two spare blocks nobody owns. Everything in fp32 (the interpreter computes in numpy).

# %%
LENS, BLOCK, KV_HEADS, HEAD_DIM, LAYER = [6, 13, 3], 4, 2, 8, 1
batch = random_paged_batch(LENS, block_size=BLOCK, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM, n_layers=2,
                           dtype=torch.float32, spare_blocks=2, seed=1)
pool = batch.kv_store                                   # [n_blocks, n_layers, 2 (K,V), n_kv_heads, block_size, head_dim]
N_BLOCKS = pool.shape[0]
print("pool:", tuple(pool.shape), " = [n_blocks, n_layers, 2, n_kv_heads, block_size, head_dim]")
print("block_tables:\n", batch.block_tables, "  [B, max_blocks] int32, padded with 0")
print("seq_lens:", batch.seq_lens.tolist())
for b, ids in enumerate(batch.block_ids):
    print(f"  seq {b}: {LENS[b]:2d} tokens in physical blocks {ids}")

# %% [markdown]
# ## 2. Phase 3.3's gather, and the kernel's launch
#
# `gather_python(pool, block_ids, n_tokens, layer)` returns one sequence's `[1, n_kv_heads, n_tokens, head_dim]` K and
# V. Its cost is not the bytes it copies but the number of things it does: one Python iteration and two slices
# (K and V) per block, two `torch.cat`s per sequence, and all of it again for every layer. The kernel does the same
# copy as **one launch per layer**, whose grid is `(B, ceil(max_len / block_size), n_kv_heads)`.

# %%
per_layer_slices = 2 * sum(len(ids) for ids in batch.block_ids)         # a K and a V slice per block
per_layer_cats = 2 * len(LENS)                                           # a K and a V cat per sequence
max_len = max(LENS)
grid = (len(LENS), -(-max_len // BLOCK), KV_HEADS)                       # what gather_triton launches
print(f"python gather, one layer: {len(LENS)} calls, {per_layer_slices} slices, {per_layer_cats} torch.cat")
print(f"kernel, one layer: 1 launch, grid {grid} = {np.prod(grid)} programs, "
      f"each moving a [{BLOCK}, {HEAD_DIM}] tile of K and one of V")
SMOL_LAYERS = 30                                                         # SmolLM2-135M
print(f"per decode step of SmolLM2-135M ({SMOL_LAYERS} layers): "
      f"{SMOL_LAYERS * (per_layer_slices + per_layer_cats)} small torch ops vs {SMOL_LAYERS} launches")

k_py = [gather_python(pool, ids, n, LAYER) for ids, n in zip(batch.block_ids, LENS)]   # B x ([1, H, n, D], [1, H, n, D])
k_ref, v_ref = gather_reference(pool, LAYER, batch.block_tables, batch.seq_lens)      # [B, H, max_len, D] each
k_tri, v_tri = gather_triton(pool, LAYER, batch.block_tables, batch.seq_lens)         # [B, H, max_len, D] each
print("python shapes:", [tuple(k.shape) for k, _ in k_py], " batched shape:", tuple(k_ref.shape))

# %% [markdown]
# ## 3. The launch grid, drawn
#
# Program `(b, j, h)` handles logical block `j` of sequence `b` for KV head `h`. It reads `block_tables[b, j]`, loads
# the K tile `pool[phys, layer, 0, h]` and the V tile `pool[phys, layer, 1, h]` (each `[block_size, head_dim]`,
# contiguous in the pool), and stores them at rows `j * block_size ...` of `k_out[b, h]` and `v_out[b, h]`. Rows past
# the sequence's length are masked on load and written as zeros. The grid spans the **longest** sequence, so a short
# sequence's later programs find `j * block_size >= seq_len`: they do not even read their table entry (the 0s that
# pad the table are never dereferenced) and only write zeros.
#
# Each arrow below is the `KV_HEADS` programs `(b, j, 0..KV_HEADS-1)`: from the physical block they read on the left to
# the tile of the output they write on the right.

# %%
colors = ["tab:blue", "tab:orange", "tab:green"]
owner = {blk: b for b, ids in enumerate(batch.block_ids) for blk in ids}
fig, ax = plt.subplots(figsize=(12, 6))
POOL_X, OUT_X, TILE_W, GAP = 0.0, 4.0, 1.7, 0.55
for blk in range(N_BLOCKS):                                   # the pool, block 0 at the top
    y = N_BLOCKS - 1 - blk
    c = colors[owner[blk]] if blk in owner else "lightgrey"
    ax.add_patch(plt.Rectangle((POOL_X, y + 0.1), 1.6, 0.8, color=c, alpha=0.85, zorder=2))
    ax.text(POOL_X + 0.8, y + 0.5, f"block {blk}" + ("" if blk in owner else " (free)"),
            ha="center", va="center", fontsize=8, zorder=3)
ax.text(POOL_X + 0.8, N_BLOCKS + 0.2, "pool (physical blocks)", ha="center", fontsize=10)
for b, n in enumerate(LENS):                                  # one output row per sequence
    y = N_BLOCKS - 2 - 3 * b
    ax.text(OUT_X, y + 1.05, f"k_out[{b}, h] and v_out[{b}, h]  (seq {b}, {n} tokens)", fontsize=8)
    for j in range(grid[1]):
        x = OUT_X + j * (TILE_W + GAP)
        valid = max(0, min(BLOCK, n - j * BLOCK))              # rows of this tile inside the sequence
        ax.add_patch(plt.Rectangle((x, y + 0.1), TILE_W, 0.8, fc="white", ec="black", lw=0.6, zorder=2))
        if valid:
            phys = batch.block_ids[b][j]
            ax.add_patch(plt.Rectangle((x, y + 0.1), TILE_W * valid / BLOCK, 0.8, color=colors[b], alpha=0.85,
                                       zorder=2))
            label = f"pid ({b},{j},h): block {phys}\n-> rows {j * BLOCK}-{j * BLOCK + valid - 1}"
            ax.annotate("", xy=(x, y + 0.5), xytext=(POOL_X + 1.6, N_BLOCKS - 1 - phys + 0.5), zorder=1,
                        arrowprops=dict(arrowstyle="->", color=colors[b], lw=1.2, alpha=0.7))
            ax.text(x + TILE_W / 2, y + 0.5, label, ha="center", va="center", fontsize=7, zorder=3)
        else:
            ax.add_patch(plt.Rectangle((x, y + 0.1), TILE_W, 0.8, fill=False, hatch="///", ec="lightgrey", lw=0,
                                       zorder=2))
            ax.text(x + TILE_W / 2, y + 0.5, f"pid ({b},{j},h)\nzeros, table unread", ha="center", va="center",
                    fontsize=7, color="dimgrey", zorder=3, bbox=dict(fc="white", ec="none", pad=0.5))
ax.text(OUT_X + 2 * (TILE_W + GAP), N_BLOCKS + 0.2, f"output [B, n_kv_heads, max_len={max_len}, head_dim]",
        ha="center", fontsize=10)
ax.set_xlim(-0.3, OUT_X + grid[1] * (TILE_W + GAP)); ax.set_ylim(-0.5, N_BLOCKS + 0.8); ax.axis("off")
ax.set_title(f"gather_triton's grid {grid}: program (seq b, logical block j, KV head h); coloured = valid rows")
plt.show()

# %% [markdown]
# ### The picture, checked by the kernel itself
#
# To see that the arrows are what the kernel does and not what we think it does, fill every block of a copy of the
# pool with its own id + 1, run the kernel, and read back the first row of every output tile: it names the block the
# program read, and 0 means a tile of zeros.

# %%
tagged = torch.zeros_like(pool)
tagged += torch.arange(1, N_BLOCKS + 1, dtype=torch.float32).view(-1, 1, 1, 1, 1, 1)   # block i holds i + 1 everywhere
k_tag, _ = gather_triton(tagged, LAYER, batch.block_tables, batch.seq_lens)        # [B, H, max_len, D]
read = (k_tag[:, 0, ::BLOCK, 0] - 1).int()                                         # [B, n_tiles]: block read, -1 = zeros
for b in range(len(LENS)):
    print(f"seq {b}: tiles read blocks {read[b].tolist()}   (its table: {batch.block_ids[b]}, -1 = zeros)")
print("matches the table:", all(read[b, :len(ids)].tolist() == ids and (read[b, len(ids):] == -1).all()
                                for b, ids in enumerate(batch.block_ids)))

# %% [markdown]
# ## 4. Three gathers, one answer
#
# A gather only copies, so the three must agree **exactly**: `torch.equal`, no tolerance. The batched outputs are
# zero past each sequence's length; the Python one is not padded, so we compare it with the valid rows.

# %%
print("kernel == reference (K and V):", torch.equal(k_tri, k_ref) and torch.equal(v_tri, v_ref))
same_as_python = all(torch.equal(k_ref[b, :, :n], kp[0]) and torch.equal(v_ref[b, :, :n], vp[0])
                     for b, (n, (kp, vp)) in enumerate(zip(LENS, k_py)))
print("reference == python per-block gather:", same_as_python)
print("padding is zeros:", all(not k_ref[b, :, n:].any() and not v_ref[b, :, n:].any() for b, n in enumerate(LENS)))

# %% [markdown]
# ## 5. Timing, and what it does not tell you
#
# Now a batch with SmolLM2-135M's shapes (3 KV heads of dimension 64, blocks of 16 tokens): 8 sequences of 100 to
# 256 tokens, one layer. As `gather_bench --threads 1` does, torch gets one intra-op thread: on this shared 2-core
# machine a two-thread op can wait at a barrier for a core another job holds, and then the timings measure that.
# Three numbers come out, and only the first two mean something here. Triton's interpreter runs every program of the
# grid one after the other in Python on numpy arrays, so the kernel's time measures the interpreter, not the kernel,
# and says nothing about its speed on a GPU. It is slow, so we run it once and keep its output for the check.

# %%
torch.set_num_threads(1)

def median_ms(fn, reps=10):
    fn()                                                      # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)

bench_lens = [200, 256, 130, 190, 240, 150, 256, 100]
big = random_paged_batch(bench_lens, block_size=16, n_kv_heads=3, head_dim=64, n_layers=2, seed=0)
args = (big.kv_store, LAYER, big.block_tables, big.seq_lens)
timed = {
    "python per-block\n(phase 3.3)": median_ms(
        lambda: [gather_python(big.kv_store, ids, n, LAYER) for ids, n in zip(big.block_ids, bench_lens)]),
    "torch reference\n(one indexing op)": median_ms(lambda: gather_reference(*args)),
}
t = time.perf_counter()
k_big, v_big = gather_triton(*args)                           # [8, 3, 256, 64] each; one interpreted run
timed["Triton kernel\n(interpreter!)"] = 1e3 * (time.perf_counter() - t)
n_programs = len(bench_lens) * -(-max(bench_lens) // 16) * 3
print(f"{sum(bench_lens)} tokens, torch threads: {torch.get_num_threads()}")
for name, ms in timed.items():
    print(f"{name.replace(chr(10), ' '):<42} {ms:9.3f} ms")
print(f"the kernel launched {n_programs} programs, each run in Python by the interpreter")
k_ref_big, v_ref_big = gather_reference(*args)
print("kernel == reference here too:", torch.equal(k_big, k_ref_big) and torch.equal(v_big, v_ref_big))

# %% [markdown]
# ### The numbers that matter: an H100
#
# On a GPU each of phase 3.3's slices is a kernel launch of its own, and that launch overhead is what one batched
# launch removes. `gather_bench` measured this on an H100 80GB (`dummy:qwen3-0.6b` shapes: 8 KV heads x head_dim 128,
# bf16, blocks of 16; the report `results/gpu-baseline/gather-bench_nvidia-h100-80gb-hbm3_dummy-qwen3-0.6b.md`,
# whose header names its commit). The cell below reads that report's table; this notebook does not measure it. The
# Python loop over the kernel goes from **10.7x** (one sequence of 512 tokens: 0.60 ms vs 0.06 ms) to **262.7x**
# (64 sequences of up to 8192 tokens: 382 ms vs 1.45 ms), and the kernel beats the torch reference by 2.3-9.4x.

# %%
# (batch, context, python ms, reference ms, kernel ms), read from the H100 report's markdown table
h100_meta, h100_tables = read_markdown("results/gpu-baseline/gather-bench_nvidia-h100-80gb-hbm3_dummy-qwen3-0.6b.md")
h100_commit = h100_meta["commit"]
header, *rows = next(iter(h100_tables.values()))            # the report's one table
H100 = [(int(r[header.index("batch")]), int(r[header.index("context")]),
         *(float(r[header.index(col)]) for col in ("python ms", "ref ms", "kernel ms"))) for r in rows]
print(f"{len(H100)} rows from the H100 report (commit {h100_commit}); the largest:", H100[-1])

fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [1, 2]})
left.bar(list(timed), list(timed.values()), color=["tab:red", "tab:blue", "lightgrey"], hatch=["", "", "//"])
left.set_yscale("log"); left.set_ylabel("ms per gather, one layer (log)")
left.set_title(f"this CPU, {len(bench_lens)} sequences, {sum(bench_lens)} tokens (kernel interpreted)")
labels = [f"{b}x{c}" for b, c, *_ in H100]
x = np.arange(len(H100))
for i, (name, color) in enumerate([("python per-block", "tab:red"), ("torch reference", "tab:blue"),
                                   ("Triton kernel", "tab:green")]):
    right.bar(x + (i - 1) * 0.27, [row[2 + i] for row in H100], 0.27, label=name, color=color)
right.set_yscale("log"); right.set_xticks(x, labels, rotation=45)
right.set_xlabel("batch x context"); right.set_ylabel("ms (log)")
right.set_title(f"H100 80GB, bf16 (gather-bench's report, commit {h100_commit})")
right.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 6. The road not taken: one pass over a padded stack
#
# Before writing its kernel, the blog asks why not gather every sequence's K/V into a padded tensor, stack them and
# run one batched forward pass, and answers that the padding and copying make that slower than N calls "in the
# common case". `PadStackScheduler` (`extras/p3_4_gather_kernel/pad_stack.py`) is phase 3.3's scheduler with exactly that decode step: gather
# every decoding sequence's K/V (all layers), right-pad and stack them into one `DynamicCache` with a padding mask,
# run **one** pass of `input_ids [N, 1]`, scatter the new K/V back into the pool.
#
# A forward hook on the model counts the passes each scheduler makes per step, on the tiny random model
# (4 prompts of 3 to 22 tokens, 6 greedy tokens each).

# %%
from common.model import load_model
from phases.p3_3_paged_cache.scheduler import PagedScheduler
from extras.p3_4_gather_kernel.pad_stack import PadStackScheduler

lm = load_model("tiny", device="cpu", dtype=torch.float32)
gen = torch.Generator().manual_seed(0)
prompts = [torch.randint(100, 1000, (n,), generator=gen).tolist() for n in (3, 9, 14, 22)]
outputs, passes = {}, {}
for cls in (PagedScheduler, PadStackScheduler):
    shapes = []                                              # input_ids shape of every forward pass
    hook = lm.model.register_forward_hook(                   # phase 3.3 passes input_ids by position, 3.4 by name
        lambda m, args, kw, out: shapes.append(tuple(kw.get("input_ids", args[0] if args else None).shape)),
        with_kwargs=True)
    engine = cls(lm, max_running=4, block_size=4, n_blocks=64)
    seqs = [engine.add(p, 6, ignore_eos=True) for p in prompts]
    per_step = []
    while engine.has_work:
        before = len(shapes)
        engine.step()
        per_step.append(shapes[before:])
    hook.remove()
    outputs[cls.__name__], passes[cls.__name__] = [s.output_ids for s in seqs], per_step
    print(f"{cls.__name__:>18}: {len(shapes)} forward passes; passes per step {[len(s) for s in per_step]}; "
          f"a decode step's input_ids: {per_step[1]}")
print("same greedy tokens:", outputs["PagedScheduler"] == outputs["PadStackScheduler"])

# %% [markdown]
# Fewer passes is not automatically faster: each stacked step copies every sequence's whole context out of the pool,
# padded to the longest. `stack_bench` timed one decode step both ways on the packaged SmolLM2-135M (bf16, this
# 2-core CPU, prompts of 16-256 tokens; `results/stack-bench_cpu_smollm2-135m.json`). The blog's claim holds here
# only at batch 1, where the stack is pure overhead (1.48x slower). From two sequences on the single padded pass
# wins, by about 2.2x at 8 and 16, despite 0.5-0.8 wasted cache slots per real token: a CPU decode pass is mostly
# weight matmuls, which N passes run N times. Phases 3.5 and 3.6 keep the one pass and drop the padded copy.

# %%
res = json.loads(Path("results/stack-bench_cpu_smollm2-135m.json").read_text())
rows, meta = res["data"]["rows"], res["meta"]
print(f"stack_bench: {meta['model']} on {meta['device']}, {meta['dtype']}, {meta['date']}, commit {meta['commit']}")
for r in rows:
    print(f"  batch {r['batch']:2d}: N calls {r['n_calls_ms']:8.1f} ms   pad + stack {r['pad_stack_ms']:7.1f} ms   "
          f"ratio {r['pad_stack_ms'] / r['n_calls_ms']:.2f}   padded slots/token {r['padding_per_token']:.2f}")
x = np.arange(len(rows))
fig, ax = plt.subplots(figsize=(8, 3.8))
ax.bar(x - 0.2, [r["n_calls_ms"] for r in rows], 0.4, label="N passes of batch 1 (phase 3.3)", color="tab:red")
ax.bar(x + 0.2, [r["pad_stack_ms"] for r in rows], 0.4, label="one pass over a padded stack", color="tab:blue")
ax.set_xticks(x, [f"batch {r['batch']}" for r in rows]); ax.set_ylabel("ms per decode step")
ax.set_title(f"stack_bench, {meta['model']} {meta['dtype']} on a 2-core CPU (from results/)")
ax.legend()
plt.show()

# %% [markdown]
# ## What this phase does not fix yet
#
# The gather is now one launch per layer for the whole batch, but what it produces is still a **copy**: a contiguous,
# padded K/V per sequence, written out only to be read once by attention. Phase 3.5 drops the copy altogether: its
# attention kernel walks the same block tables and reads K/V tiles straight from the pool, and phase 3.6 builds one
# batched decode pass per step on it, with no padded stack.
