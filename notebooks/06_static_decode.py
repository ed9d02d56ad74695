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
# # 06 · One pass per step, then a step the GPU can replay (phases 3.8 to 3.11)
#
# On an H100 the engine of phase 3.6 spent ~33 ms on a decode step of 256 sequences, while the GPU worked ~11 ms of
# it. The rest was the host: Python turning lists into tensors, and some 1,500 kernels launched one at a time. Two phases
# take that apart:
#
# * **phase 3.8** runs every step as **one forward pass**: the decode tokens and the prefill work share one packed
#   row. A long prompt is prefilled **a chunk at a time** under a per-step token budget (vLLM's
#   `max_num_batched_tokens`), so it no longer stalls everyone else for its whole prefill;
# * **phase 3.10** gives the decode step a fixed shape: its inputs live in **static buffers** allocated once, the batch
#   is padded to a **bucket**, the host sends the device **only what changed**, and tokens are **sampled on the
#   device**. A step of fixed shape and fixed addresses can be captured once as a **CUDA graph** and replayed: one
#   call instead of hundreds of launches.
#
# A CPU has no graphs, so this notebook runs the parts a CPU can: the chunked schedule, the static step (checked token
# for token against Hugging Face `generate`), what the host sends per step, and the host's own time per step. What a
# graph buys is a GPU measurement; the last sections plot the one committed from an H100.

# %%
# %matplotlib inline
import bisect
import json
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch

from common.model import load_model
from common.sampling import SamplingParams
from measure.step_bench import decode_step_ms, random_prompts
from phases.p3_1_block_allocator.allocator import blocks_for
from extras.p3_10_cuda_graphs.overlap import OverlappedDecodeEngine
from phases.p3_8_chunked_prefill.engine import ChunkedPrefillEngine, WholePromptEngine
from phases.p3_10_cuda_graphs.demo import stub_decode_forward
from phases.p3_10_cuda_graphs.engine import StaticDecodeEngine
from phases.p3_10_cuda_graphs.runner import StaticRunner
from phases.p3_9_tuned_decode_kernel.split_rule import MAX_SPLITS, MIN_BLOCKS_PER_SPLIT, choose_splits

torch.set_num_threads(1)    # many small passes: on this shared 2-core machine one intra-op thread is faster
lm = load_model("tiny", device="cpu", dtype=torch.float32)
print(f"{lm.name}: {lm.n_layers} layers, {lm.n_kv_heads} KV heads, head_dim {lm.head_dim}, {lm.dtype}")


@torch.inference_mode()
def hf_greedy(prompt_ids: list[int], n: int) -> list[int]:
    """Hugging Face `generate`, greedy, exactly n new tokens (EOS ignored): the oracle."""
    ids = torch.tensor([prompt_ids])
    out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, eos_token_id=None, pad_token_id=lm.pad_token_id)
    return out[0, len(prompt_ids):].tolist()


# %% [markdown]
# ## Phase 3.8: a long prompt arrives while three requests decode
#
# Three short requests are decoding when a request with a 96-token prompt arrives. The budget is 16 tokens per pass.
# Decode tokens go first (one per decoding sequence, always all of them) and the prompt gets what is left, a chunk per
# step. `WholePromptEngine`, the same step with prompts never cut, prefills it whole, in one pass of 99 tokens: the
# step that every decoding stream waits for. A small subclass records what each pass carried.

# %%
class PassLog(ChunkedPrefillEngine):
    """Phase 3.8's engine, recording each forward pass: (decode tokens, prefill tokens)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.passes = []

    def run_batch(self, batch):
        self.passes.append((len(batch.decode), sum(c.length for c in batch.chunks)))
        return super().run_batch(batch)


class WholePassLog(PassLog, WholePromptEngine):
    """The same record, prompts never cut."""


short = random_prompts(lm.vocab_size, 3, 8, seed=0)
long_prompt = random_prompts(lm.vocab_size, 1, 96, seed=1)[0]
SHORT_NEW, LONG_NEW, BUDGET = 24, 4, 16


def chunk_run(chunked: bool) -> PassLog:
    engine = (PassLog if chunked else WholePassLog)(lm, max_running=4, block_size=8, n_blocks=64,
                                                    max_num_batched_tokens=BUDGET)
    seqs = [engine.add(p, SHORT_NEW, ignore_eos=True) for p in short]
    for _ in range(3):                      # the three are decoding when the long prompt arrives
        engine.step()
    seqs.append(engine.add(long_prompt, LONG_NEW, ignore_eos=True))
    engine.run()
    engine.outputs = [s.output_ids for s in seqs]
    return engine


chunk_runs = {"chunked (budget 16)": chunk_run(True), "whole prompt": chunk_run(False)}
oracle = [hf_greedy(p, SHORT_NEW) for p in short] + [hf_greedy(long_prompt, LONG_NEW)]
for name, e in chunk_runs.items():
    biggest = max(d + p for d, p in e.passes)
    print(f"{name:>20}: {len(e.passes)} passes, {e.n_chunks} prefill chunks, largest pass {biggest} tokens, "
          f"outputs equal to HF generate: {e.outputs == oracle}")

# %% [markdown]
# Each bar is one forward pass (one step): blue the decode tokens, orange the prefill tokens. The whole-prompt run has
# one tall pass, the chunked run a few passes of at most 16 tokens. A pass's time grows with its tokens (on a GPU
# once the pass is big enough to fill it), so the tall bar is the step where every decoding stream stalls, and
# chunking spreads that work over several shorter steps. The tokens are the same either way.

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 3.2), sharey=True)
for ax, (name, e) in zip(axes, chunk_runs.items()):
    d, p = np.array(e.passes).T
    x = np.arange(len(d))
    ax.bar(x, d, color="tab:blue", label="decode tokens")
    ax.bar(x, p, bottom=d, color="tab:orange", label="prefill tokens")
    ax.axhline(BUDGET, color="gray", ls="--", lw=1, label=f"budget ({BUDGET})")
    ax.set_title(name)
    ax.set_xlabel("forward pass (step)")
axes[0].set_ylabel("tokens in the pass")
axes[0].legend(loc="upper right")
fig.tight_layout()

# %% [markdown]
# ## Phase 3.10: the static decode step
#
# `StaticDecodeEngine` keeps phase 3.8's schedule and changes how a decode-only step runs. Its inputs (token ids,
# positions, lengths, block tables, slot mapping) are rows of tensors allocated once (`DecodeBuffers`). The host keeps
# a mirror of what each row holds and sends only the difference: a new table entry when a sequence enters a new
# block, a whole row when a sequence joins. Positions and lengths advance on the device, the engine hands the ids it
# sampled on the device back as the next step's input ids, and the slot mapping is computed on the device from the
# tables.
#
# The batch is padded to a bucket (here 1, 2, 4, 8). A padding row has length 0, so it reads nothing and writes
# nothing, and its logits are dropped. Eight requests with different output lengths make the batch shrink step by
# step, across every bucket. A subclass logs each step: rows, bucket, values sent, and what phase 3.8's decode pass
# builds from Python lists every step (ids, positions, slots and lengths per row, plus a table row padded to the
# longest).

# %%
class StepLog(StaticRunner):
    """The static runner, recording each static decode step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps = []

    def static_pass(self, seqs):
        sent, padded = self.buffers.n_values_sent, self.n_padded_rows
        logits = super().static_pass(seqs)
        n = len(seqs)
        self.steps.append(dict(rows=n, bucket=n + self.n_padded_rows - padded,
                               sent=self.buffers.n_values_sent - sent,
                               rebuilt=n * (4 + self.buffers.longest_blocks)))
        return logits


BUCKETS = [1, 2, 4, 8]
prompts = random_prompts(lm.vocab_size, 8, (5, 20), seed=2)
new_tokens = [4, 7, 10, 14, 18, 22, 27, 32]
class LoggedEngine(StaticDecodeEngine):
    def make_runner(self):
        return StepLog(self.lm, self.allocator, self.max_running, self.cuda_graphs, self.buckets)


static = LoggedEngine(lm, max_running=8, block_size=4, n_blocks=128, buckets=BUCKETS)
seqs = [static.add(p, n, ignore_eos=True) for p, n in zip(prompts, new_tokens)]
static.run()
static_out = [s.output_ids for s in seqs]
plain = ChunkedPrefillEngine(lm, max_running=8, block_size=4, n_blocks=128)
plain_seqs = [plain.add(p, n, ignore_eos=True) for p, n in zip(prompts, new_tokens)]
plain.run()

log = static.runner.steps
print(f"{len(log)} static decode steps, {static.runner.n_padded_rows} padding rows run, buckets used "
      f"{sorted({s['bucket'] for s in log})}")
print("outputs equal to phase 3.8's engine:", static_out == [s.output_ids for s in plain_seqs])
print("outputs equal to HF generate:       ", static_out == [hf_greedy(p, n) for p, n in zip(prompts, new_tokens)])
print(f"values sent to the device: {sum(s['sent'] for s in log)} in all; rebuilt from lists every step: "
      f"{sum(s['rebuilt'] for s in log)}")

# %% [markdown]
# Left: the rows each step runs and the bucket it is padded to. Right: values written host to device per step. A row
# is sent whole when its sequence arrives. When a sequence finishes, the rows after it move up one, copied on the
# device with their mirrors (nothing sent), so the rows stay packed in the batch's order and the batch fits the
# smallest bucket. Between arrivals a step sends only the table entries of sequences that just entered a new block
# (every `block_size` tokens), often nothing at all.

# %%
x = np.arange(len(log))
fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.2))
a.step(x, [s["bucket"] for s in log], where="mid", color="tab:gray", label="bucket (graph shape)")
a.bar(x, [s["rows"] for s in log], color="tab:green", label="sequences")
a.set_xlabel("static decode step")
a.set_ylabel("rows")
a.set_yticks(BUCKETS)
a.legend()
b.plot(x, [s["rebuilt"] for s in log], "o-", color="tab:red", ms=3, label="phase 3.8: rebuilt from lists")
b.bar(x, [s["sent"] for s in log], color="tab:blue", label="phase 3.10: what changed")
b.set_xlabel("static decode step")
b.set_ylabel("values sent host -> device")
b.legend()
fig.tight_layout()

# %% [markdown]
# A `max_running` over the largest bucket is refused when the engine is built, not when a full batch finds no graph:

# %%
try:
    StaticDecodeEngine(lm, max_running=8, buckets=[1, 2, 4])
except ValueError as err:
    print("ValueError:", err)

# %% [markdown]
# ## Sampling on the device, one transfer per step
#
# The static step samples the whole batch in a fixed number of tensor ops (`DeviceSampler`, common/sampling.py):
# Gumbel-max over noise hashed from (seed, output index, token), with temperature, top-k and top-p as masks. Then it
# copies the sampled ids to the host once. A seeded request's draws depend only on its own seed and logits, not on
# the batch around it: the same request alone, and beside seven others with seeds of their own, gives the same tokens.

# %%
def sampled(requests):
    engine = StaticDecodeEngine(lm, max_running=8, block_size=4, n_blocks=128)
    seqs = [engine.add(p, 12, SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=seed), ignore_eos=True)
            for p, seed in requests]
    engine.run()
    return [s.output_ids for s in seqs]


alone = sampled([(prompts[0], 7)])[0]
crowd = sampled([(prompts[0], 7)] + [(p, 100 + i) for i, p in enumerate(prompts[1:])])
print("alone:      ", alone)
print("in a batch: ", crowd[0])
print("equal:", alone == crowd[0], "| greedy would give:", hf_greedy(prompts[0], 12))

# %% [markdown]
# ## The host's share of a step
#
# A graph removes the launches, but not the host's own Python: claiming each sequence's next slot, comparing rows,
# appending tokens, checking for the end. `graph_bench --sections host` measures that floor by stubbing out the
# forward pass (zero logits at once: no model, no kernel). What is left is the host's time per step, which on a GPU
# either adds to the step (`StaticDecodeEngine`) or has to fit under the GPU's time (`OverlappedDecodeEngine`, below).
# The same here, for phase 3.8's decode pass from lists and the static step (wall clock of this machine, one run:
# it varies by tens of percent between runs).

# %%
HOST_BATCHES = [1, 8, 32, 128]
HOST_STEPS = 20
blocks = blocks_for(16 + HOST_STEPS + 16, 16)       # per sequence: prompt, warm-up and timed steps, slack
host_engines = {
    "3.8 (decode pass from lists)": lambda lm_, n: ChunkedPrefillEngine(lm_, max_running=n, n_blocks=n * blocks),
    "3.10 static step": lambda lm_, n: StaticDecodeEngine(lm_, max_running=n, n_blocks=n * blocks),
}
host_us = {name: [] for name in host_engines}
for batch in HOST_BATCHES:
    for name, make in host_engines.items():
        def build(lm_, n, make=make):
            engine = make(lm_, n)
            stub_decode_forward(engine)
            return engine
        r = decode_step_ms(build, lm, batch, 16, HOST_STEPS)
        host_us[name].append(1e3 * r["mean_ms"] / batch)
for name, us in host_us.items():
    print(f"{name:>30}: " + ", ".join(f"b{b} {u:.1f}" for b, u in zip(HOST_BATCHES, us)) + "  us per sequence")

# %%
fig, ax = plt.subplots(figsize=(6, 3.2))
for name, us in host_us.items():
    ax.plot(HOST_BATCHES, us, "o-", label=name)
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("sequences in the step")
ax.set_ylabel("host us per sequence per step")
ax.set_title("the host's share (forward pass stubbed out)")
ax.legend()
fig.tight_layout()

# %% [markdown]
# At batch 1 a step costs the host a fixed amount: the attention switch, building the pass, a few small tensor ops.
# As the batch grows that fixed part is shared out, and what is left is the per-sequence Python, a few microseconds
# each. That part a graph cannot remove, and at 256 sequences on a slow host it is milliseconds per step.
#
# ## What a graph buys: the committed H100 measurement
#
# `graph_bench`'s step section on an H100, `dummy:qwen3-0.6b` in bf16 (the files under `results/`, with the commit
# they were measured on). The eager engines pay for the host and the launches at every batch size. The graph replays
# the whole pass in one call and stays flat to batch 128: the blog's flat ms/tok. The grey marks are the replayed
# graph's GPU time alone (timed for the batches shown); the gap above them is the host's share that is left.

# %%
RESULTS = Path("results")
runs = [json.loads((RESULTS / f"graph-bench_nvidia-h100-80gb-hbm3_dummy-qwen3-0.6b{s}.json").read_text())
        for s in ("", "_batch-256-64")]
rows = [r for run in runs for r in run["data"]["step"]]
meta = runs[0]["meta"]
print(f"{meta['device_name']}, {meta['model']}, {meta['dtype']}, torch {meta['torch']}, commit {meta['commit']}, "
      f"{meta['date']}")
fig, ax = plt.subplots(figsize=(7, 3.6))
# the engines as the reports name them, recorded when CUDA graphs were phase 3.7 and chunked prefill 3.6
styles = {"p3_6 (decode pass from lists)": "o-", "p3_7 static, eager": "s--", "p3_7 static, CUDA graph": "D-"}
for engine, style in styles.items():
    pts = sorted({r["batch"]: r["ms"] for run in runs[:1] for r in run["data"]["step"] if r["engine"] == engine}.items())
    ax.plot(*zip(*pts), style, label=engine)
gpu = sorted({r["batch"]: r["gpu_ms"] for r in rows if r.get("gpu_ms")}.items())
ax.plot(*zip(*gpu), "_", color="gray", ms=14, mew=2, label="graph replay, GPU time")
ax.set_xscale("log", base=2)
ax.set_xlabel("sequences in the step")
ax.set_ylabel("ms per decode step")
ax.set_ylim(bottom=0)
ax.legend(fontsize=8)
fig.tight_layout()
for r in rows:
    if r.get("gpu_ms"):
        print(f"batch {r['batch']:3d}: graph step {r['ms']:5.2f} ms, its GPU time {r['gpu_ms']:.2f} ms, "
              f"wall / GPU {r['ms'] / r['gpu_ms']:.2f}")

# %% [markdown]
# At batch 256 the host's share shows again: 12.6 and 10.3 ms per step in two runs that day (the line is the first;
# the printed figures at 64 and 256 are the second, which timed those batches again with their GPU time) for 4.6 ms of GPU work.
# That is the per-sequence Python of the previous section, run in series with the GPU. The eager steps are
# 30-55 ms whatever the batch, and vary that much between runs: on that host they are launch-bound Python.
#
# ## Overlapped steps: the host works while the GPU does
#
# `OverlappedDecodeEngine` (an extra, `extras/p3_10_cuda_graphs/overlap.py`) hides that share instead of shrinking it.
# In a run of decode-only steps, it claims slots and syncs the rows for step N+1 and launches it. Only then does it
# read step N's tokens. Step N+1's input ids are step N's sampled ids, copied on the device, so the host never needs a
# token to launch the next step.
#
# ```
# in series:   host N | GPU N | host N+1 | GPU N+1 | ...        a step = host + GPU
# overlapped:  host N+1 | GPU N+1 ...                           a step = max(host, GPU)
#                       | host N+2 (while GPU N+1 runs) | GPU N+2 ...
# ```
#
# The one thing the host cannot know ahead is an EOS. A sequence that ends on one at step N already has a row in step
# N+1. That row is wasted: its token is dropped, and its K/V write lands in a slot the sequence had reserved anyway.
# The packaged SmolLM2 ends its answers on EOS, so here each end costs one wasted row, and the answers are the ones
# the static engine gives. On a CPU nothing runs asynchronously, so this checks the bookkeeping only; the time it
# buys on an H100 has not been measured yet.

# %%
smol = load_model("smollm2-135m", device="cpu", dtype=torch.float32)
questions = ["What is 2 + 2?", "Name one fruit.", "What is the capital of France?"]
answers = {}
for cls in (StaticDecodeEngine, OverlappedDecodeEngine):
    engine = cls(smol, max_running=3, block_size=16, n_blocks=64)
    seqs = [engine.add(smol.prompt_ids(q), 30) for q in questions]
    engine.run()
    answers[cls.__name__] = [s.output_ids for s in seqs]
    print(f"{cls.__name__}: {engine.n_steps} steps, ends {[s.finish_reason for s in seqs]}, blocks free "
          f"{engine.allocator.n_free}/{engine.allocator.n_blocks}" + (
              f", {engine.n_overlapped_steps} overlapped, {engine.n_wasted_rows} rows wasted"
              if cls is OverlappedDecodeEngine else ""))
print("same answers:", answers["StaticDecodeEngine"] == answers["OverlappedDecodeEngine"])
for q, ids in zip(questions, answers["OverlappedDecodeEngine"]):
    print(f"  {q!r} -> {smol.tokenizer.decode(ids, skip_special_tokens=True)!r}")

# %% [markdown]
# ## How many programs per sequence: phase 3.9's split-KV rule
#
# The decode kernel's grid is batch x KV heads x splits. Each program streams its share of the K/V from HBM, and HBM
# stays busy only when every SM has a program. With few sequences, each sequence's context is split over several
# programs, whose partial outputs one more launch merges. `choose_splits` splits only while batch x KV heads leaves
# SMs idle, never into pieces under `MIN_BLOCKS_PER_SPLIT` blocks, at most `MAX_SPLITS`, rounded down to a power of
# two (a graph replays one grid, so each split count is one more graph per bucket). For Qwen3-0.6B's 8 KV heads on
# an H100's 132 SMs, with 16-token blocks:

# %%
H100_SMS, KV_HEADS, BLOCK = 132, 8, 16
contexts = [512, 2048, 8192, 32768]
print(f"MIN_BLOCKS_PER_SPLIT={MIN_BLOCKS_PER_SPLIT}, MAX_SPLITS={MAX_SPLITS}")
print("batch | " + " | ".join(f"ctx {c:>6}" for c in contexts))
for batch in [1, 2, 4, 8, 16, 32]:
    splits = [choose_splits(batch, KV_HEADS, H100_SMS, blocks_for(c, BLOCK)) for c in contexts]
    print(f"{batch:5d} | " + " | ".join(f"{s:>10}" for s in splits))
print(f"from batch {next(b for b in range(1, 257) if b * KV_HEADS >= H100_SMS)} on, batch x KV heads fills the "
      "SMs: one split at any context")

# %% [markdown]
# ## Phase 3.11: what a graph cannot remove, the kernels themselves
#
# In the H100 figure above, the graph's GPU time hardly moves from batch 1 to 256, though batch 256 does 256 times
# the arithmetic. A step that takes the same time whatever its size is counted in kernels: each one starts, reads,
# writes and drains before the next, even when it touches one row per sequence. `count_launches`
# (`measure/kernel_count.py`) counts what a step launches on any device: every aten op that computes (views launch
# nothing) and every Triton launch. Phase 3.11's `FusedDecodeEngine` runs the same step with each RMSNorm, the rotary
# embedding of q and k, and SwiGLU's `silu(gate) * up` as one Triton kernel each. Here on the tiny Qwen3 (2 layers),
# with the Triton kernels in the interpreter so the count follows a GPU's code path:

# %%
import os

from phases.p3_4_gather_kernel.dispatch import FORCE_KERNELS_ENV
from phases.p3_11_fused_ops.demo import count_decode_step
from phases.p3_11_fused_ops.engine import FusedDecodeEngine

os.environ[FORCE_KERNELS_ENV] = "1"          # the Triton paths on this CPU (the interpreter)
qwen = load_model("tiny-qwen3", device="cpu", dtype=torch.float32)
for cls in (StaticDecodeEngine, FusedDecodeEngine):
    launches = count_decode_step(qwen, cls, batch=2, prompt_len=6, block_size=4)
    print(f"{cls.__name__:>18}: {launches.total} kernels per decode step ({launches.triton} Triton), top: "
          + ", ".join(f"{op.removeprefix('triton:')} {n}" for op, n in launches.by_op.most_common(5)))
fused_out = {}
for cls in (StaticDecodeEngine, FusedDecodeEngine):
    engine = cls(qwen, max_running=2, block_size=4, n_blocks=32)
    seqs = [engine.add(p, 3, ignore_eos=True) for p in prompts[:2]]
    engine.run()
    fused_out[cls.__name__] = [s.output_ids for s in seqs]
del os.environ[FORCE_KERNELS_ENV]
print("same tokens:", fused_out["StaticDecodeEngine"] == fused_out["FusedDecodeEngine"])
full = json.loads((RESULTS / "fused-bench_cpu_dummy-qwen3-0.6b.json").read_text())["data"]["kernels"]
print("Qwen3-0.6B (28 layers), committed count:",
      ", ".join(f"{r['engine']} {r['kernels']}" for r in full if r["batch"] == 1))

# %% [markdown]
# What a fused step buys in time on the H100 is still to be measured (`fused_bench --device cuda`); the count is
# what can be known without one.
#
# ## Where to read on
#
# * `phases/p3_7_varlen_prefill/README.md`: the varlen prefill kernel (one launch per layer for every prompt in the
#   pass).
# * `phases/p3_8_chunked_prefill/README.md`: the token budget's rules, decode tokens first, then prompt chunks.
# * `phases/p3_9_tuned_decode_kernel/README.md`: the tuned decode kernel and its split rule; its measurements page
#   `docs/measurements/p3_9_tuned_decode_kernel.md` holds the kernel tables.
# * `phases/p3_10_cuda_graphs/README.md`: the static step; its measurements page
#   `docs/measurements/p3_10_cuda_graphs.md` holds the step and workload tables.
# * `phases/p3_11_fused_ops/README.md`: the three fused kernels, how they are routed without touching the HF peers
#   that share the model, and the kernel counts.
# * `python -m common graph_bench`, `graph_workload` and `fused_bench` rerun every table here, on a GPU with
#   `--device cuda`.
