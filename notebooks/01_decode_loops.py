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
# # 01 · Decode loops: without and with a KV cache
#
# Phase 0 (`phases/p0_generate`) generates text the simplest way: every step runs the model over the
# **whole** sequence so far and keeps only the last position's logits. Phase 1 (`phases/p1_kv_cache`)
# keeps each layer's keys and values in a cache, so after one *prefill* pass over the prompt each step
# feeds the model a single token.
#
# In this notebook we:
# 1. load the packaged SmolLM2-135M-Instruct (fp32, CPU),
# 2. look at what the chat template does to a prompt,
# 3. generate with both loops and check they produce the **same tokens** (and the same tokens as Hugging Face `generate`),
# 4. peek inside the KV cache,
# 5. time both loops and plot ms per step against the sequence length.
#
# Generations are kept short so the notebook runs in well under a minute on a laptop CPU.

# %%
import torch
from common.model import load_model
from phases.p0_generate import generate as generate_no_cache
from phases.p1_kv_cache import generate as generate_kv_cache

# fp32 so the two loops (and HF generate) agree token for token; bf16 is faster but rounds differently.
lm = load_model("smollm2-135m", device="cpu", dtype=torch.float32)
print(f"{lm.name}: {lm.n_layers} layers, {lm.n_heads} query heads, {lm.n_kv_heads} KV heads, "
      f"head_dim {lm.head_dim}, {lm.n_params / 1e6:.0f}M parameters, EOS ids {lm.eos_token_ids}")

# %% [markdown]
# ## The prompt the model actually sees
#
# Every engine in this repo tokenizes with `lm.prompt_ids(prompt)`, which wraps the user message in the
# model's chat template. That wrapping is what makes an instruct model end its answer with `<|im_end|>`
# (its EOS) instead of rambling on to the token cap.

# %%
question = "What is the capital of France?"
ids = lm.prompt_ids(question)
print(len(ids), "tokens:")
print(lm.tokenizer.decode(ids))

# %% [markdown]
# ## Same tokens from both loops
#
# Greedy decoding is deterministic, and the cache only avoids recomputing numbers that the no-cache loop
# recomputes, so both loops must pick the same tokens. We also compare with Hugging Face `generate`.

# %%
MAX_NEW = 24
slow = generate_no_cache(lm, question, max_new_tokens=MAX_NEW)
fast = generate_kv_cache(lm, question, max_new_tokens=MAX_NEW)
with torch.inference_mode():
    t = torch.tensor([ids])
    hf = lm.model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=MAX_NEW, do_sample=False)[0, len(ids):].tolist()

print("p0 (no cache):", repr(slow.text), "| finish:", slow.finish_reason, "|", slow.n_generated, "tokens")
print("p1 (KV cache):", repr(fast.text), "| finish:", fast.finish_reason, "|", fast.n_generated, "tokens")
print("same tokens as each other:", slow.output_ids == fast.output_ids, "| same as HF generate:", fast.output_ids == hf)
assert slow.output_ids == fast.output_ids == hf

# %% [markdown]
# ## Inside the cache
#
# A `DynamicCache` holds, for every layer, a key tensor and a value tensor of shape
# `[batch, n_kv_heads, seq_len, head_dim]`. After the prefill, `seq_len` equals the prompt length;
# each decode step appends one row. SmolLM2 uses grouped-query attention: 9 query heads share 3 KV heads,
# which makes its cache 3x smaller than with one KV head per query head.

# %%
from transformers import DynamicCache
from measure.bench import kv_bytes_per_token

cache = DynamicCache(config=lm.config)
with torch.inference_mode():
    out = lm.model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    print("after prefill: layers =", len(cache.layers), "| layer 0 keys", tuple(cache.layers[0].keys.shape))
    next_token = out.logits[:, -1].argmax(-1, keepdim=True)                     # [1, 1]
    lm.model(next_token, past_key_values=cache, use_cache=True, position_ids=torch.tensor([[len(ids)]]))
    print("after one decode step: layer 0 keys", tuple(cache.layers[0].keys.shape))
print(f"KV bytes per token (fp32): {kv_bytes_per_token(lm):,}  = 2 (K,V) x {lm.n_layers} layers x "
      f"{lm.n_kv_heads} KV heads x {lm.head_dim} dims x 4 bytes")

# %% [markdown]
# ## Timing both loops
#
# Now a fixed-length run (EOS ignored, so both loops make exactly the same number of tokens) on the
# decode prompt from the blog. `GenerationResult.step_ms` holds how long each token took:
# `step_ms[0]` is the time to first token (the prefill), the rest are decode steps.

# %%
from common.prompts import DECODE_PROMPT

N_TIMED = 32
generate_no_cache(lm, DECODE_PROMPT, max_new_tokens=4, ignore_eos=True)   # warm-up
generate_kv_cache(lm, DECODE_PROMPT, max_new_tokens=4, ignore_eos=True)
runs = {
    "p0: no cache": generate_no_cache(lm, DECODE_PROMPT, max_new_tokens=N_TIMED, ignore_eos=True),
    "p1: KV cache": generate_kv_cache(lm, DECODE_PROMPT, max_new_tokens=N_TIMED, ignore_eos=True),
}
for name, r in runs.items():
    print(f"{name}: {r.tok_s:6.1f} tok/s | {r.timing.ms_per_token:6.1f} ms/tok | TTFT {r.timing.ttft_ms:6.1f} ms "
          f"| first decode step {r.step_ms[1]:6.1f} ms, last {r.step_ms[-1]:6.1f} ms")

# %%
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(7, 3.5))
for name, r in runs.items():
    ax.plot(r.positions[1:], r.step_ms[1:], label=name)   # skip step 0: that one is the prefill
ax.set_xlabel("sequence length at the step (prompt + generated tokens)")
ax.set_ylabel("ms per decode step")
ax.set_ylim(bottom=0)
ax.grid(alpha=0.3)
ax.legend()
plt.show()

# %% [markdown]
# The no-cache line climbs: step *i* re-embeds, re-projects and re-attends over all `len(prompt) + i`
# tokens, so its cost grows with the position and a whole generation costs O(n²). The KV-cache line grows far
# more slowly: each step projects one token and only the attention read grows (by one cached row per step).
#
# To see the gap widen, run the full sweep (longer generations, tables and a saved plot):
#
# ```bash
# python -m common decode_sweep                 # CPU defaults: 16, 32, 64, 128 new tokens
# python -m common decode_sweep --new-tokens 256 512
# modal run modal_run.py::decode_sweep          # on a GPU, the blog's lengths: 32 ... 1024
# ```
#
# Next: phase 2 batches many prompts into one forward pass (`notebooks/02_...`).
