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
# # 09 · Preemption: a pool too small for the work, and nothing lost
#
# Up to phase 4.3 an engine admitted a request only when its **worst case** (prompt + `max_new_tokens`) fit beside
# everyone else's worst case, so decode could never run out of blocks, and most reserved blocks sat empty. Phase 4.4's
# `PreemptingEngine` admits a request as soon as its *prompt* fits (first come, first served). When the pool runs
# dry in the middle of decoding, the **latest** request gives back all its blocks, and later gets its K/V back in one
# of two ways (vLLM paper §4.5):
#
# * **recompute**: its blocks are dropped and it goes back to the front of the queue; when it is admitted again,
#   one prefill pass over prompt + generated tokens rebuilds its K/V;
# * **swap**: its blocks are copied to a CPU pool and back (one indexed copy each way) when there is room again.
#
# We give a burst of requests a pool under half the size they would peak at, draw every request's state step by
# step and the pool's occupancy, check that the outputs are **identical** to an unlimited pool's (greedy, fp32), and
# count what preemption cost: steps, tokens pushed through the model again, bytes copied. Then the same with the
# packaged SmolLM2-135M on real prompts, checked against Hugging Face `generate`.

# %%
# %matplotlib inline
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.colors import ListedColormap

from common.model import load_model
from measure.preempt_bench import timing_recomputation
from measure.workload import burst, demand_tokens
from phases.p2_2_scheduler.sequence import Status
from phases.p4_1_copy_on_write.engine import worst_case_blocks
from measure.preempt_checks import check_finished
from phases.p4_4_preemption.demo import AuditedEngine
from phases.p4_4_preemption.engine import PREEMPTED

torch.set_num_threads(1)    # many small passes: on this shared 2-core machine one intra-op thread is faster
lm = load_model("tiny", device="cpu", dtype=torch.float32)
print(f"{lm.name}: {lm.n_layers} layers, {lm.n_kv_heads} KV heads, head_dim {lm.head_dim}, {lm.dtype}")

# %% [markdown]
# ## The workload, and the pool it would need
#
# Eight requests arrive together: prompts of 8-24 random tokens, 16-32 new tokens each, EOS ignored so every run does
# the same work. Blocks hold 4 tokens. With an unlimited pool (room for every request's worst case at once) nothing
# is ever preempted: that run is the reference.

# %%
BLOCK = 4
trace = burst(lm.vocab_size, 8, prompt_len=(8, 24), output_len=(16, 32), seed=0)
for i, r in enumerate(trace):
    print(f"request {i}: prompt {len(r.prompt_ids):2d} tokens, {r.max_new_tokens} new -> worst case "
          f"{worst_case_blocks(r, r.n, BLOCK)} blocks")
unlimited_blocks = sum(worst_case_blocks(r, r.n, BLOCK) for r in trace)
print(f"all at once: {demand_tokens(trace)} tokens, {unlimited_blocks} blocks of {BLOCK}")

# %% [markdown]
# ## Running it, step by step
#
# `run` drives one engine over the burst and, after every `step()`, records each request's state: waiting (not yet
# admitted), running, preempted and waiting to be recomputed, swapped out to the CPU pool, or done, and how many
# blocks of the pool are in use. The engine is the phase's `AuditedEngine`: `PreemptingEngine` with every scheduling
# decision checked as it is made (FCFS admission and swap-in, the latest group is the victim, groups never split);
# `check_finished` then checks every request finished exactly once and no block leaked in either pool. A small
# subclass counts the tokens that go through the model, so recomputation's cost is measured, not inferred. The prefix
# cache is off, as in `preempt_demo`, so a recomputed request recomputes every token, as in the paper.

# %%
WAITING, RUNNING, RECOMPUTE, SWAPPED, DONE = range(5)

class CountingEngine(timing_recomputation(AuditedEngine)):
    """The audited preempting engine, counting the tokens fed to the model (prefill, decode and recomputation), its
    recomputation timed around its steps (`recompute_s`)."""
    tokens_through_model = 0

    def run_batch(self, batch):     # one pass: prefill chunks (recomputation too) and decode rows
        self.tokens_through_model += sum(c.length for c in batch.chunks) + len(batch.decode)
        return super().run_batch(batch)


def state_of(engine, seq) -> int:
    if seq.status is Status.DONE:
        return DONE
    if seq.status is PREEMPTED:
        return SWAPPED if seq in engine.swapped_seqs else RECOMPUTE
    return WAITING if seq.status is Status.WAITING else RUNNING


def run(mode: str, n_blocks: int) -> dict:
    engine = CountingEngine(lm, preemption_mode=mode, block_size=BLOCK, n_blocks=n_blocks, max_running=64,
                            prefix_caching=False)
    seqs = [engine.add(r.prompt_ids, r.max_new_tokens, ignore_eos=True) for r in trace]
    states, used = [], []                   # per step: [n_requests] state codes; blocks in use
    start = time.perf_counter()
    while engine.has_work:
        engine.step()
        states.append([state_of(engine, s) for s in seqs])
        used.append(engine.allocator.n_used)
    wall = time.perf_counter() - start
    groups = [engine.group_of(s) for s in seqs]
    return dict(mode=mode, n_blocks=n_blocks, engine=engine, outputs=[s.output_ids for s in seqs],
                states=np.array(states).T, used=np.array(used), wall=wall,
                problems=check_finished(engine, groups), summary=engine.summary())


ref = run("recompute", unlimited_blocks)
print(f"unlimited pool ({unlimited_blocks} blocks): {ref['engine'].n_steps} steps, peak "
      f"{ref['engine'].peak_blocks_used} blocks in use, preemptions {ref['summary']['n_preemptions']}, "
      f"problems {ref['problems']}")

# %% [markdown]
# The unlimited run never used more than its peak. Now a pool of **45% of that peak**: every request still fits
# alone (phase 4.1's check in `add()` guarantees it), but the burst does not fit together.

# %%
tight_blocks = int(0.45 * ref["engine"].peak_blocks_used)
runs = {"unlimited pool": ref}
for mode in ("recompute", "swap"):
    r = runs[mode] = run(mode, tight_blocks)
    print(f"{mode:>9}, {tight_blocks} blocks: {r['engine'].n_steps} steps, {r['summary']['n_preemptions']} "
          f"preemptions (requests {list(r['engine'].preempted_ids)}), problems {r['problems']}, "
          f"outputs equal to the unlimited pool: {r['outputs'] == ref['outputs']}")

# %% [markdown]
# ## Every request, step by step
#
# One row per request, one column per engine step. With the unlimited pool all eight run from the first step. With
# the small pool the first ones are admitted while their prompts fit, and each time the pool runs dry the
# **latest-arrived** running request is thrown out whole (orange: waiting to be recomputed; blue: swapped to the CPU
# pool). It comes back before any request that arrived after it, so the earliest request always makes progress.

# %%
cmap = ListedColormap(["white", "tab:green", "tab:orange", "tab:blue", "gainsboro"])
names = ["waiting", "running", "preempted (recompute)", "swapped out", "done"]
n_steps = max(r["states"].shape[1] for r in runs.values())
fig, axes = plt.subplots(3, 1, figsize=(12, 7), sharex=True)
for ax, (label, r) in zip(axes, runs.items()):
    steps_run = r["states"].shape[1]
    padded = np.full((len(trace), n_steps), DONE)              # after its last step a run is all done
    padded[:, :steps_run] = r["states"]
    ax.imshow(padded, aspect="auto", cmap=cmap, vmin=-0.5, vmax=4.5, interpolation="nearest",
              extent=(0.5, n_steps + 0.5, len(trace) - 0.5, -0.5))
    if steps_run < n_steps:
        ax.axvline(steps_run + 0.5, color="black", lw=1)
        ax.text(steps_run + 1, len(trace) / 2, "all done", va="center", fontsize=9)
    ax.set_ylabel("request")
    ax.set_title(f"{label}: {r['n_blocks']} blocks, {r['summary']['n_preemptions']} preemptions, "
                 f"{r['engine'].n_steps} steps")
    ax.set_yticks(range(len(trace)))
axes[-1].set_xlim(0.5, n_steps + 0.5)
axes[-1].set_xlabel("engine step")
handles = [plt.Rectangle((0, 0), 1, 1, fc=cmap(i), ec="black", lw=0.5) for i in range(5)]
fig.legend(handles, names, loc="upper center", ncol=5, bbox_to_anchor=(0.5, 1.02))
fig.tight_layout(rect=(0, 0, 1, 0.97))
plt.show()

# %% [markdown]
# ## The pool, step by step
#
# The number of blocks in use after each step, and, underneath, how many requests run at once. The small pool runs
# close to full all the time: optimistic admission fills it, preemption empties part of it, and admission fills it
# again. What it pays for that is a smaller batch, so more steps. Recompute and swap make the same scheduling
# decisions on this burst (the same victims at the same steps), so their lines lie on top of each other: they differ
# in how a request's K/V come back, not in when.

# %%
fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 6), sharex=True)
colors = {"unlimited pool": "grey", "recompute": "tab:orange", "swap": "tab:blue"}
for label, r in runs.items():
    steps = np.arange(1, len(r["used"]) + 1)
    style = dict(color=colors[label], drawstyle="steps-post", lw=4 if label == "recompute" else 1.5,
                 alpha=0.5 if label == "recompute" else 1)   # recompute drawn wide: swap may lie right on it
    top.plot(steps, r["used"], label=f"{label} (blocks in use)", **style)
    bottom.plot(steps, (r["states"] == RUNNING).sum(axis=0), label=label, **style)
top.axhline(tight_blocks, color="black", ls="--", lw=1, label=f"small pool: {tight_blocks} blocks")
top.set_ylabel("blocks in use"); top.legend(loc="upper right"); top.set_title("pool occupancy after each step")
bottom.set_ylabel("requests running"); bottom.set_xlabel("engine step"); bottom.legend(loc="upper right")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Identical outputs, and what they cost
#
# Greedy decoding in fp32 gives the same tokens whatever the batch composition, so a preempted request must produce
# exactly the tokens the unlimited pool produced, whichever way it came back. The price:
#
# * **recompute** pushes the preempted requests' tokens through the model a second time (the re-prefill of prompt +
#   generated tokens), counted by the engine (`tokens_recomputed`) and by our own counter of tokens fed to the model;
# * **swap** pushes nothing twice but copies blocks to the CPU pool and back;
# * both run more steps than the unlimited pool, because fewer requests fit at once.

# %%
print(f"{'run':>15} {'=unlimited':>10} {'steps':>6} {'passes':>7} {'tokens fed':>11} {'recomputed':>11} "
      f"{'blocks out/in':>14} {'bytes swapped':>14} {'recovery ms':>12} {'wall s':>7}")
for label, r in runs.items():
    s, e = r["summary"], r["engine"]
    print(f"{label:>15} {str(r['outputs'] == ref['outputs']):>10} {e.n_steps:>6} {e.n_forward_passes:>7} "
          f"{e.tokens_through_model:>11} {s['tokens_recomputed']:>11} "
          f"{s['blocks_swapped_out']:>7}/{s['blocks_swapped_in']:<6} "
          f"{s['bytes_swapped_out'] + s['bytes_swapped_in']:>14,} {1e3 * (s['swap_s'] + e.recompute_s):>12.2f} {r['wall']:>7.2f}")
extra = runs["recompute"]["engine"].tokens_through_model - ref["engine"].tokens_through_model
print(f"\nrecompute fed {extra} tokens more than the unlimited pool; the engine counted "
      f"{runs['recompute']['summary']['tokens_recomputed']} recomputed")
print(f"swap moved {runs['swap']['summary']['tokens_swapped_out']} tokens of K/V out and back "
      f"({ref['engine'].allocator.bytes_per_block:,} bytes per block on this tiny model)")

# %% [markdown]
# On this tiny model both recoveries take milliseconds (the table's "recovery ms"). On the packaged SmolLM2-135M,
# `preempt_demo` measured the gap (`results/preempt-demo_cpu_smollm2-135m.md`, fp32, this CPU): bringing back 512
# tokens of K/V took 1.33-1.43 s by recomputation and 7.9-9.4 ms by swapping, 148-174x less, at every block size
# from 8 to 128. On a GPU, where a prefill pass is fast and the copy crosses PCIe, the balance shifts (the paper's
# Fig. 19).
#
# ## The packaged model, on real prompts
#
# Three chat prompts to SmolLM2-135M (fp32), 10 new tokens each, blocks of 8, and a pool with room for the three
# prompts and one block more: decoding soon runs out. Here the engine runs as it is served, prefix cache on, so a
# recomputed request first looks its prompt + outputs up in the cache, and recomputes only the tokens whose blocks
# were reclaimed. Hugging Face `generate` (greedy, no paging at all) is the reference.

# %%
from phases.p3_1_block_allocator.allocator import blocks_for
from phases.p4_4_preemption.engine import PreemptingEngine

smol = load_model("smollm2-135m", device="cpu", dtype=torch.float32)
PROMPTS = ["What is the capital of France?", "Explain in one sentence how a bicycle works.",
           "Name three colours of the rainbow."]
NEW, SMOL_BLOCK = 10, 8
prompt_ids = [smol.prompt_ids(p) for p in PROMPTS]           # chat template + system prompt
small_pool = sum(blocks_for(len(p), SMOL_BLOCK) for p in prompt_ids) + 1
print(f"prompts of {[len(p) for p in prompt_ids]} tokens; pool of {small_pool} blocks x {SMOL_BLOCK} tokens")

with torch.inference_mode():
    hf = []
    for p in prompt_ids:
        x = torch.tensor([p])
        out = smol.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False,
                                  eos_token_id=sorted(smol.eos_token_ids), pad_token_id=smol.pad_token_id)
        hf.append(out[0, len(p):].tolist())

class Watched(PreemptingEngine):
    """Notes what each victim held when it was preempted, and what its re-prefill fed the model."""
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.victims, self.refed = [], []     # (seq_id, tokens in the pool); (seq_id, tokens fed again)

    def _preempt(self, group, members):
        self.victims += [(s.seq_id, s.kv.n_filled) for s in members]
        super()._preempt(group, members)

    def run_batch(self, batch):
        self.refed += [(c.seq.seq_id, c.length) for c in batch.chunks if c.seq.output_ids]   # a prefill with outputs
        return super().run_batch(batch)


for mode in ("recompute", "swap"):
    engine = Watched(smol, preemption_mode=mode, block_size=SMOL_BLOCK, n_blocks=small_pool)
    seqs = [engine.add(p, NEW) for p in prompt_ids]
    engine.run()
    s = engine.summary()
    print(f"{mode:>9}: {s['n_preemptions']} preemption(s), {s['tokens_recomputed']} tokens recomputed, "
          f"{s['bytes_swapped_out'] + s['bytes_swapped_in']:,} bytes swapped, {engine.n_steps} steps; "
          f"equal to HF generate: {[q.output_ids for q in seqs] == hf}")
    print(f"           victims (seq, tokens held): {engine.victims}; re-prefills (seq, tokens fed): {engine.refed}")
for prompt, ids in zip(PROMPTS, hf):
    print(f"  {prompt!r} -> {smol.decode(ids)!r}")

# %% [markdown]
# Why does recompute report 0 tokens recomputed? Look at what the victim held: a whole number of full blocks.
# Its blocks went back to the pool but stayed in the prefix cache (cached-free), and nothing claimed them before the
# victim came back, so its re-prefill mapped them all and fed the model only its last generated token, whose K/V had
# never been computed (its decode pass was the one that was preempted). That is vLLM v1's cheap recomputation; in a
# busier pool the cached blocks get reclaimed, and with `prefix_caching=False` (the tiny runs above) every token of a
# recomputed request goes through the model again. The swap run copied the victim's blocks out and back instead:
# SmolLM2's K/V is 30 layers x 3 heads x 64 dims x K and V in fp32, 46 KB per token.

# %% [markdown]
# ## What this phase leaves to the next
#
# The engine line is complete: batched paged attention, chunked prefill, shared blocks for samples, a
# prefix cache, and now optimistic admission with preemption, so a pool far smaller than the worst case still
# finishes every request with the same output. Phase 4.5 adds speculative decoding to it, and phase 5 puts it
# behind an OpenAI-compatible HTTP server, where requests arrive whenever clients send them and a preempted
# request simply pauses its stream.

# %% [markdown]
# ### The pool, step by step
#
# `python -m common pool_replay preempt_demo` records this engine's pool after every step and writes it as one
# HTML file; below, the reference run of it ([results/](../results/)): the latest requests preempted when the
# 24-block pool runs dry, their blocks given back, and recomputed when room returns. The step buttons (or the
# arrow keys) walk the steps.

# %%
from IPython.display import display_html

display_html('<iframe src="../results/pool-replay-preempt-demo_cpu_smollm2-135m.html" width="100%" height="480" style="border: 0"></iframe>', raw=True)
