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
# # 03 · Paging the KV cache: pool, block tables, PagedCache
#
# Phase 2.3 gave each running sequence its own `DynamicCache`: one tensor per layer, reallocated and copied
# one row longer every step. Phase 3 cuts the KV memory of **all** sequences into equal blocks instead:
#
# * `BlockAllocator` (phase 3.1) owns **one** pool tensor `[n_blocks, n_layers, 2, n_kv_heads, block_size, head_dim]`,
#   allocated once, and a free list of block ids;
# * a `BlockTable` (phase 3.2) per sequence maps logical token positions to the physical blocks it was handed;
# * `PagedCache` (phase 3.3) is a `transformers.Cache` that writes each new token's K/V through the table and
#   hands attention the K/V it needs; `PagedScheduler` runs phase 2.3's continuous batching on top of it.
#
# In this notebook we build a small pool, let sequences come and go, **draw** which sequence owns which block
# over time, check that `PagedCache` reproduces `DynamicCache` bit for bit, and compare the memory a static
# reservation wastes with what paging wastes. Everything runs on the tiny random model in fp32, in seconds.

# %%
# %matplotlib inline
import matplotlib.pyplot as plt
import numpy as np
import torch
from transformers import DynamicCache

from common.model import load_model
from common.prompts import STATIC_RESERVATION_TOKENS, interleaved_latency_prompts
from phases.p3_1_block_allocator.allocator import BlockAllocator
from phases.p3_3_paged_cache.paged_cache import PagedCache
from phases.p3_3_paged_cache.scheduler import PagedScheduler, blocks_for

lm = load_model("tiny", device="cpu", dtype=torch.float32)
print(f"{lm.name}: {lm.n_layers} layers, {lm.n_kv_heads} KV heads, head_dim {lm.head_dim}, {lm.dtype}")

# %% [markdown]
# ## The pool
#
# Small blocks (4 tokens) and a small pool (48 blocks) keep the pictures readable; the real default is
# 16 tokens per block and a pool sized from the memory left after the model is loaded.

# %%
BLOCK_SIZE, N_BLOCKS = 4, 48
pool = BlockAllocator.for_model(lm, block_size=BLOCK_SIZE, n_blocks=N_BLOCKS)
print(pool)
print("pool tensor:", tuple(pool.kv_store.shape), " = [n_blocks, n_layers, 2 (K,V), n_kv_heads, block_size, head_dim]")
print(f"one block = {BLOCK_SIZE} tokens x {lm.n_layers} layers x K and V = {pool.bytes_per_block:,} bytes")

# %% [markdown]
# ## Sequences come and go
#
# Eight requests of different lengths (the tiny model is random, so we fix each answer's length and ignore EOS;
# short and long answers alternate like the blog's latency workload), at most three running at once.
# After every step we record who owns each block of the pool.

# %%
prompts = interleaved_latency_prompts()
answer_lengths = [6, 40, 10, 36, 4, 30, 8, 24]     # short, long, short, long, ...
sched = PagedScheduler(lm, max_running=3, allocator=pool)
for p, n in zip(prompts, answer_lengths):
    sched.add(p, n, ignore_eos=True)

FREE = -1
owners = []                                         # one row per step: owner seq_id of each block, or FREE
tables_at = {}                                      # step -> {seq_id: block ids} of the running sequences
while sched.has_work:
    sched.step()
    row = np.full(N_BLOCKS, FREE)
    for seq in sched.running:
        row[seq.kv.table.block_ids] = seq.seq_id
    owners.append(row)
    tables_at[len(owners) - 1] = {s.seq_id: list(s.kv.table.block_ids) for s in sched.running}
owners = np.stack(owners)
print(f"{len(owners)} steps; blocks free at the end: {pool.n_free}/{pool.n_blocks}; "
      f"sequences that had to wait for blocks: {sorted(sched.waited_for_blocks) or 'none'}")

# %% [markdown]
# ### The pool over time
#
# Each row is one step, each column one physical block, coloured by the sequence that owns it (white = free).
# Blocks come off the front of the free list and go back at its end, so as sequences finish and new ones start,
# a sequence's blocks end up wherever the free list had them, not side by side.

# %%
n_seqs = len(prompts)
cmap = plt.get_cmap("tab10", n_seqs)
picture = np.ma.masked_equal(owners, FREE)          # masked = free = white
fig, ax = plt.subplots(figsize=(11, 5))
im = ax.imshow(picture, aspect="auto", cmap=cmap, vmin=-0.5, vmax=n_seqs - 0.5, interpolation="nearest")
ax.set_xlabel("physical block id")
ax.set_ylabel("step")
ax.set_title(f"Who owns each block of a {N_BLOCKS}-block pool, step by step (block size {BLOCK_SIZE})")
fig.colorbar(im, ax=ax, ticks=range(n_seqs), label="seq_id")
plt.show()


# %% [markdown]
# ### A few block tables
#
# At a late step, the running sequences' tables: logical block *i* of a sequence lives in physical block
# `block_ids[i]`, and those ids are scattered. The model never sees this: `PagedCache` turns the table back
# into one contiguous K/V per layer for attention.

# %%
# The step where the running sequences own the most scattered tables: most "gaps" between consecutive ids.
def gaps(ids): return sum(b != a + 1 for a, b in zip(ids, ids[1:]))
step = max(tables_at, key=lambda s: sum(gaps(ids) for ids in tables_at[s].values()))
print(f"step {step}:")
for seq_id, ids in tables_at[step].items():
    print(f"  seq {seq_id}: logical 0..{len(ids) - 1} -> physical {ids}")

seq_id, ids = next(iter(tables_at[step].items()))
print(f"\nseq {seq_id}, token by token (first 12 positions):")
for pos in range(12):
    logical, offset = divmod(pos, BLOCK_SIZE)
    print(f"  token {pos:2d} -> logical block {logical} -> physical block {ids[logical]:2d}, offset {offset}")

# %% [markdown]
# ## PagedCache is a drop-in for DynamicCache
#
# `PagedCache.update(k, v, layer_idx)` writes the new K/V into the pool slots its table assigns (one indexed
# copy for all new tokens of a layer) and returns the layer's whole K/V gathered from the pool. Only copies are
# involved, so the logits must be **bit-identical** to `DynamicCache`'s: we check with `torch.equal`, not a tolerance.

# %%
ids = lm.prompt_ids(prompts[1])
pool2 = BlockAllocator.for_model(lm, block_size=BLOCK_SIZE, n_blocks=32)
dyn, paged = DynamicCache(), PagedCache(pool2)
steps = {"dyn": [], "paged": []}                  # the logits of every forward pass, per cache
with torch.inference_mode():
    for name, cache in (("dyn", dyn), ("paged", paged)):
        n = len(ids)                              # prefill the prompt, then 5 greedy decode steps
        logits = lm.model(torch.tensor([ids]), position_ids=torch.arange(n)[None], past_key_values=cache).logits
        steps[name].append(logits)
        for _ in range(5):
            nxt = logits[0, -1].argmax().view(1, 1)
            logits = lm.model(nxt, position_ids=torch.tensor([[n]]), past_key_values=cache).logits
            steps[name].append(logits)
            n += 1
print("logits identical at every step:", all(torch.equal(a, b) for a, b in zip(steps["dyn"], steps["paged"])))
print(paged)
k, v = paged.gathered(0)
print("layer 0 K/V gathered from the pool:", tuple(k.shape), "equal to DynamicCache's:",
      torch.equal(k, dyn.layers[0].keys) and torch.equal(v, dyn.layers[0].values))
paged.release()
print("after release:", pool2)

# %% [markdown]
# ## Waste: a static reservation vs paging
#
# A static cache (HF `StaticCache`) must reserve the worst case for every sequence up front: here
# `STATIC_RESERVATION_TOKENS` slots each, the blog's doomsday number. Paging hands out blocks as tokens
# arrive, so a sequence wastes at most the unused tail of its last block. (`DynamicCache` wastes nothing,
# but pays with a reallocation and a full copy every step.) The lengths are the ones the run above stored.

# %%
rows = []
for seq in sched.finished:
    stored = len(seq.prompt_ids) + len(seq.output_ids) - 1     # the last token's K/V is never computed
    paged_slots = blocks_for(stored, BLOCK_SIZE) * BLOCK_SIZE
    rows.append((seq.seq_id, stored, STATIC_RESERVATION_TOKENS, paged_slots))
rows.sort()
print(f"{'seq':>3} {'tokens':>7} {'static slots':>13} {'waste':>7} {'paged slots':>12} {'waste':>6}")
for sid, stored, static, paged_slots in rows:
    print(f"{sid:>3} {stored:>7} {static:>13} {1 - stored / static:>7.1%} {paged_slots:>12} {1 - stored / paged_slots:>6.1%}")
tot = [sum(r[i] for r in rows) for i in (1, 2, 3)]
print(f"all {tot[0]:>7} {tot[1]:>13} {1 - tot[0] / tot[1]:>7.1%} {tot[2]:>12} {1 - tot[0] / tot[2]:>6.1%}")

# %%
labels = [f"seq {r[0]}" for r in rows]
x = np.arange(len(rows))
fig, ax = plt.subplots(figsize=(12, 4))
ax.bar(x - 0.27, [r[2] for r in rows], 0.27, label=f"static reservation ({STATIC_RESERVATION_TOKENS} slots)")
ax.bar(x, [r[3] for r in rows], 0.27, label=f"paged: whole blocks of {BLOCK_SIZE}")
ax.bar(x + 0.27, [r[1] for r in rows], 0.27, label="tokens actually stored")
ax.set_yscale("log")
ax.set_xticks(x, labels)
ax.set_ylabel("KV slots (log scale)")
ax.set_title("KV slots held per sequence")
ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
fig.tight_layout()
plt.show()

# %% [markdown]
# ## What this phase does not fix yet
#
# Each running sequence still gets its **own** forward pass per step, and every layer of every pass copies the
# sequence's K/V out of the pool block by block in Python (`gather_python`). The `tput` demo shows the cost:
# PagedCache holds about the same KV memory as DynamicCache but runs a little slower. Phase 3.4 replaces the
# gather with one kernel launch for the whole batch, phase 3.5 lets attention read the pool in place, and phase 3.6
# builds one batched decode pass per step on that.
