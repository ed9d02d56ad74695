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
# # Phases 3.5 and 3.6: paged decode attention, and one batched decode pass for everyone
#
# Phase 3.3 gave every sequence its own forward pass and gathered its K/V block by block in Python.
# Here attention reads K/V **in place** from the pool, through each sequence's block table, for a whole
# batch of sequences at different lengths at once. This notebook
#
# 1. lays out a small pool with three sequences whose blocks are scattered,
# 2. pictures the decode kernel's grid: which program reads which blocks,
# 3. checks the kernel (under the Triton interpreter) and its PyTorch reference against SDPA on contiguous K/V,
# 4. compares engines' throughput on a few requests (tiny model, so it runs in seconds), and plots the
#    measured `workload_bench` results if they are in `results/`.

# %%
import os
os.environ.setdefault("TRITON_INTERPRET", "1")   # before any kernel module is imported: CPU has no Triton backend
import torch
import matplotlib.pyplot as plt
from phases.p3_1_block_allocator.allocator import BlockAllocator
from phases.p3_2_block_table.block_table import BlockTable
torch.manual_seed(0)

# %% [markdown]
# ## 1. A pool with scattered blocks
#
# Three sequences grow in turns, so the allocator hands out interleaved block ids.
# Pool layout: `[n_blocks, n_layers, 2, n_kv_heads, block_size, head_dim]`.

# %%
BLOCK, LAYERS, KV_HEADS, HEAD_DIM, N_BLOCKS = 4, 1, 2, 16, 12
alloc = BlockAllocator(N_BLOCKS, LAYERS, KV_HEADS, HEAD_DIM, block_size=BLOCK, dtype=torch.float32)
lengths = [5, 12, 9]
tables = [BlockTable(BLOCK) for _ in lengths]
for step in range(max(lengths)):            # one token per sequence per step, like decoding
    for t, n in zip(tables, lengths):
        if step < n:
            t.append_slots(alloc, 1)
alloc.kv_store.normal_()                      # stand-in K/V values
for i, t in enumerate(tables):
    print(f"seq {i}: {t.n_filled:2d} tokens in blocks {t.block_ids}")

# %%
fig, ax = plt.subplots(figsize=(10, 1.8))
colors = ["tab:blue", "tab:orange", "tab:green"]
for b in range(N_BLOCKS):
    owner = next((i for i, t in enumerate(tables) if b in t.block_ids), None)
    ax.add_patch(plt.Rectangle((b, 0), 0.95, 1, color=colors[owner] if owner is not None else "lightgrey"))
    label = f"s{owner}" if owner is not None else "free"
    ax.text(b + 0.47, 0.5, f"{b}\n{label}", ha="center", va="center", fontsize=8)
ax.set_xlim(0, N_BLOCKS); ax.set_ylim(0, 1); ax.axis("off")
ax.set_title("physical blocks in the pool, coloured by owning sequence")
plt.show()

# %% [markdown]
# ## 2. The decode kernel's grid
#
# One program per **(sequence, KV head)**. A program loads the query rows of every query head that shares
# its KV head (grouped-query attention), then walks its sequence's block table: for logical block `j` it reads
# physical block `block_tables[seq, j]`, a `[block_size, head_dim]` tile of K and of V, straight from the pool,
# masks positions past `seq_lens[seq]`, and folds the tile into a running max / running sum / running output
# (online softmax). Nothing is gathered into a padded copy; a short sequence's programs simply stop early.

# %%
fig, ax = plt.subplots(figsize=(10, 3))
for s, t in enumerate(tables):
    for h in range(KV_HEADS):
        y = s * KV_HEADS + h
        ax.text(-0.3, y, f"program (seq {s}, kv head {h})", ha="right", va="center", fontsize=8)
        for j, b in enumerate(t.block_ids):
            fill = min(BLOCK, t.n_filled - j * BLOCK)
            ax.add_patch(plt.Rectangle((j, y - 0.4), 0.9 * fill / BLOCK, 0.8, color=colors[s], alpha=0.8))
            ax.text(j + 0.45, y, f"blk {b}", ha="center", va="center", fontsize=7)
ax.set_xlim(-0.1, max(t.n_blocks for t in tables)); ax.set_ylim(-0.7, len(tables) * KV_HEADS - 0.3)
ax.set_xlabel("logical block j  (bar length = valid tokens; the last block is partly filled)")
ax.set_yticks([]); ax.invert_yaxis()
ax.set_title("each program walks its own block table; programs of different lengths run in one launch")
plt.show()

# %% [markdown]
# ## 3. Kernel == reference == SDPA on contiguous K/V

# %%
from phases.p3_5_paged_attention.reference import paged_decode_attention_reference
from extras.p3_5_paged_attention.contiguous import sdpa_decode_contiguous
from phases.p3_5_paged_attention.kernels import paged_decode_attention_triton
from phases.p3_4_gather_kernel.reference import gather_reference

N_HEADS = 4                                   # 2 query heads per KV head
q = torch.randn(len(tables), N_HEADS, HEAD_DIM)
width = max(t.n_blocks for t in tables)
block_tables = torch.tensor([t.block_ids + [0] * (width - t.n_blocks) for t in tables], dtype=torch.int32)
seq_lens = torch.tensor([t.n_filled for t in tables], dtype=torch.int32)
scale = HEAD_DIM ** -0.5
ref = paged_decode_attention_reference(q, alloc.kv_store, 0, block_tables, seq_lens, scale)
k, v = gather_reference(alloc.kv_store, 0, block_tables, seq_lens)     # contiguous, zero-padded
sdpa = sdpa_decode_contiguous(q, k, v, seq_lens, scale)
kern = paged_decode_attention_triton(q, alloc.kv_store, 0, block_tables, seq_lens, scale)
print("reference vs SDPA   max |diff|:", (ref - sdpa).abs().max().item())
print("kernel    vs reference max |diff|:", (kern - ref).abs().max().item())

# %% [markdown]
# ## 4. One batched decode pass per step: engines side by side
#
# A few requests on the tiny random model (2 layers), EOS ignored so every engine does the same work.
# The numbers here are only a sanity check on a laptop-sized run; phase 3.6's README quotes the measured
# `workload_bench` on SmolLM2-135M.

# %%
import torch
from common.model import load_model
from measure.workload import mixed_work
from measure.harness import measure
from measure.hf_peers import HF_STATIC
from phases.p3_3_paged_cache.demo import TPUT_ENGINES
from phases.p3_6_batched_engine.demo import BATCHED

lm = load_model("tiny", dtype=torch.float32)
requests = mixed_work(lm.vocab_size, n=8, prompt_len=(8, 24), output_len=(4, 16))
rows = [measure(lm, r, requests, max_running=8) for r in (HF_STATIC, TPUT_ENGINES[1], BATCHED)]
for r in rows:
    print(f"{r['engine']:>10}: {r['tok_s']:8.1f} tok/s   outputs equal to hf_static: {r['outputs'] == rows[0]['outputs']}")

# %%
import json
from pathlib import Path
res = Path("results/workload-bench_cpu_smollm2-135m.json")
if res.exists():
    data = json.loads(res.read_text())["data"]["results"]
    fig, axes = plt.subplots(1, len(data), figsize=(5 * len(data), 3.5), squeeze=False)
    for ax, (wname, engines) in zip(axes[0], data.items()):
        ax.bar(list(engines), [e["tok_s"] for e in engines.values()], color="tab:blue")
        ax.set_title(f"{wname} work (SmolLM2-135M, CPU)"); ax.set_ylabel("total tok/s")
    plt.tight_layout(); plt.show()
else:
    print("run `python -m common workload_bench` to measure the full comparison")

# %% [markdown]
# ### The pool, step by step
#
# `python -m common pool_replay tput` records this engine's pool after every step and writes it as one HTML
# file; below, the reference run of it ([results/](../results/)): phase 3.6's engine claiming blocks as
# sequences grow and giving them back as they finish. The step buttons (or the arrow keys) walk the steps.

# %%
from IPython.display import display_html

display_html('<iframe src="../results/pool-replay-tput_cpu_smollm2-135m.html" width="100%" height="480" style="border: 0"></iframe>', raw=True)
