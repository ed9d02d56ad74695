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
# # Phase 2: batching, a scheduler, continuous batching
#
# Phase 1 served one prompt with a KV cache. Here many requests share the machine:
#
# 1. **naive batching** (`phases/p2_1_naive_batching`): left-pad the prompts into one rectangle and decode them in lock-step;
# 2. **a scheduler** (`phases/p2_2_scheduler`): every request is a `Sequence` with a status, queued and admitted `max_running` at a time;
# 3. **continuous batching** (`phases/p2_3_continuous_batching`): the slot of a finished sequence goes to the next one at once.
#
# Settings here are tiny so the notebook runs in seconds on a laptop CPU; the demos (`python -m common sweep`, `waste_demo`, `latency_demo`, `wall`) run the full-size versions.

# %%
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from IPython.display import Image, display

from common.model import load_model
from common.prompts import WASTE_DEMO_PROMPTS, interleaved_latency_prompts, SHORT_PROMPTS
from phases.p2_1_naive_batching.padding import left_pad
from phases.p2_1_naive_batching.generate import generate_batch
from phases.p2_2_scheduler.scheduler import Scheduler
from phases.p2_3_continuous_batching.scheduler import ContinuousScheduler

torch.manual_seed(0)
# bf16: the fast default on CPU. (The tests check token-for-token equality in fp32.)
lm = load_model("smollm2-135m", device="cpu")
print(lm.name, lm.dtype, "EOS ids:", lm.eos_token_ids, "PAD id:", lm.pad_token_id)

# %% [markdown]
# ## 1. The padding picture
#
# Each prompt goes through the chat template (that is what makes the model end its answer with `<|im_end|>`).
# The prompts have different lengths, so we pad them **on the left** to the longest: every row's next token then
# lands in the same column. The attention mask hides the PAD columns, and the position ids count only real tokens.

# %%
rows = [lm.prompt_ids(p) for p in WASTE_DEMO_PROMPTS]
input_ids, mask, positions = left_pad(rows, lm.pad_token_id)
print("prompt lengths:", [len(r) for r in rows], "-> padded to", input_ids.shape[1])

fig, ax = plt.subplots(figsize=(10, 2.2))
ax.imshow(mask.numpy(), cmap="Blues", vmin=-0.3, vmax=1.2, aspect="auto")
ax.set_yticks(range(len(rows)), [p[:32] for p in WASTE_DEMO_PROMPTS])
ax.set_xlabel("column (token position in the padded batch)")
ax.set_title("white: PAD (mask 0), blue: real prompt tokens (mask 1)")
plt.show()
print("row 0 position ids, last 8 columns:", positions[0, -8:].tolist())
print("row 1 position ids, first 8 columns (PAD gets 0):", positions[1, :8].tolist())

# %% [markdown]
# ## 2. The waste
#
# Naive batching decodes every row until the **slowest** row is done. A row that hit its EOS keeps being fed PAD
# and computed, and its output is thrown away. `generate_batch` counts, per row, the decode steps it needed and the
# steps it was carried for nothing.

# %%
CAP = 24  # the waste_demo uses 200; 24 keeps this cell quick
res = generate_batch(lm, WASTE_DEMO_PROMPTS, max_new_tokens=CAP)
print(f"batch ran for {res.n_decode_steps} decode steps total\n")
print(f"{'prompt':34} {'needed':>7} {'wasted':>7} {'waste%':>7}")
for p, need, waste, pct in zip(WASTE_DEMO_PROMPTS, res.steps_needed, res.steps_wasted, res.waste_pct):
    print(f"{p[:34]:34} {need:7d} {waste:7d} {pct:6.1f}%")
print()
for p, text in zip(WASTE_DEMO_PROMPTS, res.texts):
    print(f"{p[:30]!r:34} -> {text[:70]!r}")

# %%
fig, ax = plt.subplots(figsize=(9, 2.4))
labels = [p[:30] for p in WASTE_DEMO_PROMPTS]
ax.barh(labels, res.steps_needed, color="tab:blue", label="needed")
ax.barh(labels, res.steps_wasted, left=res.steps_needed, color="lightgrey", hatch="//", edgecolor="grey",
        label="carried after its EOS")
ax.invert_yaxis(); ax.set_xlabel("decode steps"); ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# ## 3. A scheduler, one step at a time
#
# From here on every request is a `Sequence` that moves WAITING -> PREFILLING -> DECODING -> DONE, and a scheduler
# admits at most `max_running` of them. Watch the continuous scheduler with two slots: the moment a short answer is
# DONE, the next waiting sequence takes its slot **in the same step** (it prefills on the next one).

# %%
sched = ContinuousScheduler(lm, max_running=2)
for p in ["What is the capital of France?", WASTE_DEMO_PROMPTS[1], "Is Python interpreted or compiled? Answer in one sentence."]:
    sched.add(p, max_new_tokens=10)

def show(s):
    cells = []
    for seq in s.sequences:
        slot = s.slots.index(seq) if seq in s.slots else "-"
        cells.append(f"#{seq.seq_id} {seq.status.name:<10} slot {slot} tokens {len(seq.output_ids):2d}")
    return " | ".join(cells)

print("start  ", show(sched))
while sched.has_work:
    finished = [out.seq for out in sched.step() if out.finished]   # step() gives one StepOutput per token
    note = f"  <- {[q.seq_id for q in finished]} DONE" if finished else ""
    print(f"step {sched.n_steps:2d}", show(sched) + note)
print("\nhistories:", {q.seq_id: [st.name for st in q.history] for q in sched.sequences})

# %% [markdown]
# ## 4. Static vs continuous: the two timelines
#
# Four requests (short and long questions alternating) arrive together; at most two run at once.
# The static scheduler runs them as two padded batches; a batch hands its results back only when its slowest row is
# done, and a finished row keeps its slot (hatched). The continuous scheduler refills a slot the step it frees.
# `python -m common latency_demo` runs the full version (eight requests, four slots, cap 128).

# %%
from phases.p2_3_continuous_batching.demo import compare_schedulers, draw_timelines

prompts = interleaved_latency_prompts()[:4]
d = compare_schedulers(lm, prompts, max_running=2, cap=32)
print(f"{'seq':>3}  {'prompt':32} {'static ms':>10} {'cont ms':>9} {'steps':>6} {'speedup':>8}")
for i, p in enumerate(d["prompts"]):
    print(f"{i:3d}  {p[:32]:32} {d['static_ms'][i]:10.0f} {d['cont_ms'][i]:9.0f} {d['steps'][i]:6d} {d['speedup'][i]:7.1f}x")
png = Path(tempfile.mkdtemp()) / "timelines.png"
draw_timelines(d, png)
display(Image(filename=str(png)))

# %% [markdown]
# Short answers come back much sooner under continuous batching. The long ones gain little or lose, and on the
# total they can get slower: each running sequence now has its **own** KV cache at its own length, so a step is
# one forward pass *per sequence* instead of one batched pass. Phase 3 (paged KV blocks and a kernel that reads
# many block tables at once) wins the batched forward pass back, and `python -m common wall` shows the other
# problem of per-sequence caches: how much memory to reserve for each.
