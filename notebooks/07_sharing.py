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
# # 07 · Sharing KV blocks: copy-on-write and beam search
#
# Phase 3 gave every sequence its own block table over one pool of KV blocks. Nothing stopped two tables
# from listing the *same* physical block; the allocator already kept a reference count per block. Phase 4
# uses that:
#
# * **parallel sampling** (`phases/p4_1_copy_on_write`): a request asks for *n* samples of one prompt. The
#   prompt is prefilled once and its blocks are shared by all *n* samples (refcount *n*). A block is copied
#   only when a sample is about to **write** into a block someone else also holds: *copy-on-write*.
# * **beam search** (`phases/p4_2_beam_search`): *k* beams fork from their parents every step, so they share
#   not only the prompt but also their common generated history, and a block is freed as soon as no beam
#   holds it.
#
# This notebook steps both by hand and draws the block tables and the beam tree.

# %%
# %matplotlib inline
import torch
import matplotlib.pyplot as plt
from common.model import load_model
from common.sampling import SamplingParams
from phases.p4_1_copy_on_write.engine import SharingEngine
from phases.p4_1_copy_on_write.block_ops import check_refcounts

# fp32 so the beam search below matches Hugging Face generate exactly.
lm = load_model("smollm2-135m", device="cpu", dtype=torch.float32)
BLOCK_SIZE = 8   # small blocks, so a short prompt spans several of them

# %% [markdown]
# ## One prompt, three samples, one copy of the prompt
#
# `engine.add_group(prompt, max_new_tokens, n=3)` returns a *group*. Its first `step()` runs **one** prefill pass over the prompt
# (one sequence), then forks: samples 1 and 2 get tables listing the very same block ids (each block's
# refcount is now 3), and all three draw their first token from the same logits, each with its own
# seed (seed + sample index).

# %%
engine = SharingEngine(lm, block_size=BLOCK_SIZE, n_blocks=64)
sampling = SamplingParams(temperature=0.8, seed=0)
group = engine.add_group("What is the capital of France?", 12, sampling, n=3)
engine.step()

rc = engine.allocator.refcount
print("prompt tokens:", len(group.prompt_ids), "| forward passes:", engine.n_forward_passes)
for i, s in enumerate(group.seqs):
    print(f"sample {i}: blocks {s.kv.block_ids}  refcounts {[rc(b) for b in s.kv.block_ids]}  "
          f"first token {lm.decode(s.output_ids)!r}")
held, unshared = engine.block_usage()
print(f"blocks held: {held} (without sharing: {unshared})")


# %%
def draw_tables(engine, seqs, title, ax=None):
    """One row per sequence, one cell per logical block: colour = physical block, label = id (x refcount)."""
    ax = ax or plt.subplots(figsize=(8, 0.6 + 0.5 * len(seqs)))[1]
    cmap = plt.get_cmap("tab20")
    for row, s in enumerate(seqs):
        for logical, b in enumerate(s.kv.block_ids):
            count = engine.allocator.refcount(b)
            ax.add_patch(plt.Rectangle((logical, -row - 0.4), 0.95, 0.8, color=cmap(b % 20),
                                       alpha=1.0 if count > 1 else 0.45))
            ax.text(logical + 0.47, -row, f"{b}" + (f" (x{count})" if count > 1 else ""), ha="center",
                    va="center", fontsize=8)
    width = max(s.kv.n_blocks for s in seqs)
    ax.set_xlim(0, width)
    ax.set_ylim(-len(seqs) + 0.4, 0.6)
    ax.set_yticks([-r for r in range(len(seqs))], [f"seq {r}" for r in range(len(seqs))])
    ax.set_xticks([x + 0.47 for x in range(width)], [f"logical {x}" for x in range(width)], fontsize=7)
    ax.set_title(title + "   (solid: shared, faded: private)")
    return ax

draw_tables(engine, group.seqs, "After the prefill and the fork");

# %% [markdown]
# ## The copy-on-write moment
#
# The prompt ends part-way through its last block. At the next step every sample writes the K/V of its first
# token into that block, so the first two writers each take a fresh block, copy the shared one into it (every
# layer's K and V, in one indexed copy for the whole step) and point their table at the copy; the old block's
# refcount drops to 1 and the last sample writes into it in place. The full prompt blocks are never written
# again, so they stay shared.

# %%
before = [list(s.kv.block_ids) for s in group.seqs]
engine.step()
after = [list(s.kv.block_ids) for s in group.seqs]
for i, (b, a) in enumerate(zip(before, after)):
    changed = [(x, y) for x, y in zip(b, a) if x != y]
    print(f"sample {i}: " + (f"copied block {changed[0][0]} -> {changed[0][1]}" if changed else "wrote in place"))
print("blocks copied so far:", engine.n_copied)
check_refcounts(engine.allocator, [s.kv for s in engine.running])
draw_tables(engine, group.seqs, "After the first decode step");

# %% [markdown]
# The copy is a real copy: the prompt positions of a copied block hold exactly the K/V of the original,
# in every layer (`kv_store [n_blocks, n_layers, 2, n_kv_heads, block_size, head_dim]`).

# %%
store = engine.allocator.kv_store
n_prompt_in_last = len(group.prompt_ids) % BLOCK_SIZE
original = after[-1][len(before[0]) - 1]                  # the block the last sample kept
for i in range(2):
    copy = after[i][len(before[0]) - 1]
    same = torch.equal(store[copy, :, :, :, :n_prompt_in_last], store[original, :, :, :, :n_prompt_in_last])
    print(f"sample {i}'s copy {copy} equals block {original} on the {n_prompt_in_last} prompt positions:", same)

# %%
engine.run()
for i, out in enumerate(group.outputs):
    print(f"sample {i}: {lm.decode(out)!r}")
print("free blocks after the run:", engine.allocator.n_free, "of", engine.allocator.n_blocks)

# %% [markdown]
# ## Beam search: a tree of beams over shared blocks
#
# `BeamSearchEngine.add_beam_search(prompt, max_new_tokens, beam_width=k)` keeps *k* beams. Each step the engine's ordinary
# batched decode pass scores all of them, `BeamSearch.step` (Hugging Face's rules) picks the *k* best
# continuations, and each new beam's table is `fork(parent's table)`. The old tables are then released: a
# block that only pruned beams held goes back to the free list immediately.
#
# We record which parent each beam came from, to draw the tree.

# %%
from phases.p4_2_beam_search.engine import BeamSearchEngine

K, MAX_NEW = 3, 8
beam_engine = BeamSearchEngine(lm, block_size=4, n_blocks=128)
beams = beam_engine.add_beam_search("Name one fruit.", MAX_NEW, beam_width=K)

steps = []                                  # per step: parent of each new beam, its token
search_step = beams.search.step
def recording_step(logits):
    parents = search_step(logits)
    if not beams.search.done:               # the last step only finishes hypotheses
        steps.append((parents, [tokens[-1] for tokens in beams.search.running_tokens]))
    return parents
beams.search.step = recording_step

usage = []
while not beams.done:
    beam_engine.step()
    if not beams.done:
        check_refcounts(beam_engine.allocator, [s.kv for s in beam_engine.running])
        usage.append(beam_engine.block_usage())

for h in beams.hypotheses:
    print(f"{h.score:8.4f}  {h.finish_reason:6}  {lm.decode(h.token_ids)!r}")

# %%
fig, ax = plt.subplots(figsize=(12, 3.5))
for t, (parents, tokens) in enumerate(steps):
    kept = set(steps[t + 1][0]) if t + 1 < len(steps) else set(range(K))
    for i, (p, tok) in enumerate(zip(parents, tokens)):
        if t > 0:
            ax.plot([t - 1, t], [-p, -i], color="grey", lw=1)
        ax.text(t, -i, lm.decode([tok]).replace("\n", "\\n") or "·", ha="center", va="center", fontsize=8,
                bbox=dict(boxstyle="round", fc="white" if i in kept else "#eeeeee",
                          ec="black" if i in kept else "#bbbbbb"))
ax.set_xlim(-0.7, len(steps) - 0.3)
ax.set_ylim(-K + 0.5, 0.5)
ax.set_xlabel("step")
ax.set_yticks([-i for i in range(K)], [f"beam {i}" for i in range(K)])
ax.set_title("Beam tree: each beam continues a parent (grey: pruned at the next step)");

# %% [markdown]
# Beams that share a parent share every block up to the fork; only the block being written is copied.
# Below: blocks held with sharing against the blocks the same beams would hold with one private copy each.

# %%
plt.figure(figsize=(6, 3))
plt.plot([u for _, u in usage], label="without sharing (sum of table lengths)")
plt.plot([h for h, _ in usage], label="with sharing (distinct blocks)")
plt.xlabel("step"); plt.ylabel("KV blocks"); plt.legend();

# %% [markdown]
# ### Same answer as Hugging Face
#
# `generate(num_beams=k, do_sample=False)` returns the best finished hypothesis; so does our engine
# (transformers' stopping rule and length penalty, see `phases/p4_2_beam_search/beam.py`).

# %%
with torch.inference_mode():
    ids = torch.tensor([beams.prompt_ids])
    hf = lm.model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=K, do_sample=False,
                           max_new_tokens=MAX_NEW, eos_token_id=sorted(lm.eos_token_ids),
                           pad_token_id=lm.pad_token_id)[0, ids.shape[1]:].tolist()
print("engine:", repr(lm.decode(beams.best)))
print("HF    :", repr(lm.decode(hf)))
assert beams.best == hf
print("free blocks after the search:", beam_engine.allocator.n_free, "of", beam_engine.allocator.n_blocks)

# %% [markdown]
# ### The pool, step by step
#
# `python -m common pool_replay cow_demo` records this engine's pool after every step and writes it as one
# HTML file; below, the reference run of it ([results/](../results/)): the prompt's blocks shared by the
# samples (ref count 3), then the copy-on-write of the last one. The step buttons (or the arrow keys) walk the
# steps.

# %%
from IPython.display import display_html

display_html('<iframe src="../results/pool-replay-cow-demo_cpu_smollm2-135m.html" width="100%" height="480" style="border: 0"></iframe>', raw=True)
