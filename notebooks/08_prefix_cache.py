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
# # 08 · Prefix caching: hashes → blocks, a hit, an eviction
#
# Phase 4.3 (`phases/p4_3_prefix_caching`) lets a request reuse the KV blocks an earlier request computed,
# when both prompts start with the same tokens (a system prompt, few-shot examples, a chat history).
#
# The key observation: the K/V stored for a token depend on that token **and every token before it**.
# So a *full* block is named by (all tokens before it, its own tokens). Chaining the hashes makes that cheap:
#
#     h_0 = hash(ROOT, block 0 tokens)        h_i = hash(h_{i-1}, block i tokens)
#
# A global table maps `hash -> physical block`. This notebook draws that table and the pool under it,
# then watches one hit and one eviction. It uses the tiny random model (fast; the cache mechanics do not
# care what the model says) and the packaged model's tokenizer.

# %%
import torch
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

from common.model import load_model
from common.prompts import format_prompt
from phases.p4_3_prefix_caching.block_hash import chain_hashes
from phases.p4_3_prefix_caching.engine import PrefixCachingEngine

lm = load_model("tiny", device="cpu", dtype=torch.float32)
BS = 16  # tokens per block

# %% [markdown]
# ## Two prompts behind one system prompt
#
# Both requests carry the same system prompt in the chat template, then a different question.
# Their block hashes agree exactly as long as their tokens do, and stay different from the first
# differing block on, even if later blocks happened to hold equal tokens, because each hash covers its parent.

# %%
SYSTEM = ("You are a patient tutor for a school chemistry class. Explain every answer in two short "
          "sentences, give one everyday example, and never use formulas the class has not seen yet.")

def ids_for(question):
    text = format_prompt(lm.tokenizer, question, system=SYSTEM)
    return lm.tokenizer(text, add_special_tokens=False)["input_ids"]

a = ids_for("Why does ice float on water?")
b = ids_for("What makes a flame blue?")
ha, hb = chain_hashes(a, BS), chain_hashes(b, BS)
print(f"prompt A: {len(a)} tokens, {len(ha)} full blocks;  prompt B: {len(b)} tokens, {len(hb)} full blocks")
for i in range(max(len(ha), len(hb))):
    x = f"{ha[i] & 0xffff:04x}" if i < len(ha) else "  - "
    y = f"{hb[i] & 0xffff:04x}" if i < len(hb) else "  - "
    print(f"block {i}: A {x}  B {y}  {'same' if x == y else 'different'}")

# %% [markdown]
# ## A picture of the cache
#
# `draw` shows the pool (one square per physical block, coloured by its state) and, above it, the hash
# table: one entry per cached block, pointing at the block that holds it.
#
# - **owned**: some block table holds it (the number is its reference count);
# - **cached-free**: nobody holds it (refcount 0) but its K/V and its hash are kept, for a later hit;
# - **free**: nothing worth keeping.

# %%
STATE_COLOURS = {"owned": "tab:green", "cached-free": "tab:orange", "free": "lightgrey"}

def block_state(alloc, b):
    if alloc.refcount(b) > 0:
        return "owned"
    return "cached-free" if b in alloc.evictor else "free"

def draw(alloc, title, tables=None):
    # tables: {name: BlockTable}, drawn under the pool as rows of logical -> physical arrows
    tables = tables or {}
    n = alloc.n_blocks
    fig, ax = plt.subplots(figsize=(max(8, n * 0.75), 2.6 + 0.7 * len(tables)))
    entries = sorted((e for b in range(n) if (e := alloc.cached_entry(b)) is not None), key=lambda e: e.block_id)
    for b in range(n):
        state = block_state(alloc, b)
        ax.add_patch(Rectangle((b, 0), 0.9, 0.9, color=STATE_COLOURS[state]))
        label = f"{b}" + (f"\nrc {alloc.refcount(b)}" if state == "owned" else "")
        ax.text(b + 0.45, 0.45, label, ha="center", va="center", fontsize=8)
    for e in entries:  # hash table row above the pool
        ax.text(e.block_id + 0.45, 1.9, f"{e.block_hash & 0xffff:04x}\n@{e.tokens_before}", ha="center",
                va="center", fontsize=7, bbox=dict(boxstyle="round", fc="white", ec="tab:blue"))
        ax.add_patch(FancyArrowPatch((e.block_id + 0.45, 1.6), (e.block_id + 0.45, 0.95), arrowstyle="->",
                                     color="tab:blue", mutation_scale=8))
    for row, (name, table) in enumerate(tables.items()):
        y = -1.2 - 0.9 * row
        ax.text(-0.3, y + 0.3, name, ha="right", va="center", fontsize=8)
        for logical, b in enumerate(table.block_ids):
            ax.add_patch(FancyArrowPatch((b + 0.45, y + 0.55), (b + 0.45, -0.05), arrowstyle="->",
                                         color="black", alpha=0.5, mutation_scale=8))
            ax.text(b + 0.45, y + 0.3, f"L{logical}", ha="center", va="center", fontsize=7)
    handles = [Patch(color=colour, label=state) for state, colour in STATE_COLOURS.items()]
    handles.append(Patch(fc="white", ec="tab:blue", label="table entry: hash, tokens before it"))
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0, 1.0), ncol=4, fontsize=8, frameon=False)
    ax.set_xlim(-1.5, n + 0.5)
    ax.set_ylim(-1.4 - 0.9 * (len(tables) - 1) if tables else -0.3, 2.4)
    ax.axis("off")
    ax.set_title(title, loc="left", pad=28)
    fig.tight_layout()
    plt.show()


# %% [markdown]
# ## Request A fills the cache
#
# A runs alone in a small pool. Every block it fills (prompt blocks during prefill, output blocks during
# decode) is registered under its chained hash. When A finishes, its blocks are *not* wiped: they become
# cached-free.

# %%
engine = PrefixCachingEngine(lm, max_running=2, block_size=BS, n_blocks=9)
seq_a = engine.add(a, 20, ignore_eos=True)
engine.step()  # prefill
draw(engine.allocator, "after A's prefill: its full prompt blocks are in the table", {"A": seq_a.kv})
engine.run()
draw(engine.allocator, "A finished: its blocks stay cached (refcount 0, evictable)")
print(engine.allocator)

# %% [markdown]
# ## A hit: request B maps A's blocks in
#
# B's prompt starts with the same system prompt. At admission the engine walks B's block hashes through the
# table, checks each candidate's stored tokens (and that its parent is the block just matched; a hash
# collision is a miss), and maps the hits into B's block table with one more reference each. Prefill then
# feeds only B's remaining tokens; attention reads the cached prefix straight from the pool.

# %%
fed = []
forward = engine.runner.forward
def spy(input_ids, position_ids, batch, logits_to_keep=1):
    if not batch.is_decode:
        fed.append(input_ids.shape[1])
    return forward(input_ids, position_ids, batch, logits_to_keep)
engine.runner.forward = spy

seq_b = engine.add(b, 20, ignore_eos=True)
engine.step()
s = engine.cache_stats
print(f"B: {len(b)} prompt tokens, {s.blocks_hit} blocks hit -> prefill fed {fed[-1]} tokens "
      f"({s.tokens_skipped} skipped)")
draw(engine.allocator, "B admitted: blocks it shares with A are revived (refcount 1)", {"B": seq_b.kv})

# %% [markdown]
# ## An eviction
#
# The pool has only 9 blocks. A third request, C, with a different system prompt, needs more blocks than
# are truly free, so the allocator takes cached-free blocks back, in the evictor's order: **least recently used
# first; among blocks last used at the same time, the one at the end of the longest prefix first**. A's
# private tail (its question and its answer) goes before the shared system-prompt blocks B is using, which
# are not evictable at all while B holds them.

# %%
alloc = engine.allocator
print("evictable now, first to go first:", alloc.evictor.eviction_order())
print("tokens before each:", [alloc.cached_entry(blk).tokens_before for blk in alloc.evictor.eviction_order()])
c = lm.tokenizer(format_prompt(lm.tokenizer, "Tell me about the moon.", system="You are a poet. " * 6),
                 add_special_tokens=False)["input_ids"]
before = set(alloc.evictor.eviction_order())
seq_c = engine.add(c, 4, ignore_eos=True)
engine.step()
taken = [blk for blk in seq_c.kv.block_ids if blk in before]
print(f"C took {seq_c.kv.n_blocks} blocks; {len(taken)} of them evicted from the cache: {taken}")
print("evictions so far:", alloc.n_evictions)
draw(alloc, "C admitted: it took every truly free block, then evicted A's deepest cached block",
     {"B": seq_b.kv, "C": seq_c.kv})

# %%
engine.run()
alloc.check_invariants()
print(alloc)
print("owned blocks at the end:", alloc.owned_ids(), "| allocatable:", alloc.n_free, "of", alloc.n_blocks)
print(engine.cache_stats)

# %% [markdown]
# ## What to take away
#
# - A hit costs a table lookup and a token comparison per block, and saves that block's whole prefill.
# - The admission budget counts only blocks a request really takes: blocks it shares with running requests
#   are free of charge; reviving a cached-free block takes it out of the evictable pool.
# - Cached-free blocks are memory the engine would otherwise leave empty: the cache uses it for free and
#   gives it back, deepest-and-oldest first, the moment anyone needs a block.
#
# Run `python -m common prefix_demo` to measure what this buys on a one-shot and a few-shot system prompt.

# %% [markdown]
# ### The pool, step by step
#
# `python -m common pool_replay prefix_demo` records this engine's pool after every step and writes it as one
# HTML file; below, the reference run of it ([results/](../results/)): the first request computes the system
# prompt; the later ones map its cached blocks in, and finished prompts stay cached-free. The step buttons (or
# the arrow keys) walk the steps.

# %%
from IPython.display import display_html

display_html('<iframe src="../results/pool-replay-prefix-demo_cpu_smollm2-135m.html" width="100%" height="480" style="border: 0"></iframe>', raw=True)
