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
# # 10 · Serving: the engine behind an OpenAI-compatible API
#
# Phase 5 puts the whole engine line (phase 4.4's engine with phase 4.5's speculation: batched paged attention,
# chunked prefill, shared samples, prefix caching, preemption, optional speculation) behind the HTTP API every LLM
# client already speaks: `POST /v1/completions` and `POST /v1/chat/completions`, streamed as server-sent events
# when asked, plus `/health` and a Prometheus `/metrics`. The engine runs in a thread of its own, so a forward pass
# never blocks the event loop that serves the connections; each step is one batched forward pass for every request
# in flight.
#
# In this notebook we start the server inside the notebook (uvicorn in a background thread on a free local port),
# talk to it with the official `openai` Python client as any application would, watch a stream arrive token by
# token, send a few requests at once and see them share forward passes, read the metrics, and shut it down.
# The model is the packaged SmolLM2-135M on the CPU, with short answers so it all runs in seconds.

# %%
# %matplotlib inline
import threading
import time
from contextlib import ExitStack

import httpx
import matplotlib.pyplot as plt
import openai
import torch

from common.model import load_model
from measure.background_server import BackgroundServer
from phases.p5_1_served_engine.engine import ServingEngine
from phases.p5_6_http_server.server import create_app

torch.set_num_threads(1)   # one decode pass at a time on a shared 2-core machine: one intra-op thread is faster
lm = load_model("smollm2-135m", device="cpu", dtype=torch.float32)
print(f"{lm.name}: {lm.n_layers} layers, {lm.dtype}, on {lm.device}")

# %% [markdown]
# ## Start the server
#
# `create_app` builds the FastAPI app around an engine; by default it makes the served engine itself
# (phase 5.1's `ServingEngine`). We hand it one of our own instead: the same class, which also
# notes, for every step, when it ran and what its forward pass held (decode rows, and prompts being prefilled), so we
# can see batching happen from the engine's side. `BackgroundServer` binds a free port on 127.0.0.1 and runs uvicorn in a daemon thread;
# the app's lifespan starts the engine thread. An `ExitStack` holds it open across cells until we close it at the end.

# %%
class StepLog(ServingEngine):
    """The served engine, logging every step: (start, end, decode rows, prompts prefilled, prefill tokens).
    Its methods run on the engine thread; the notebook only reads the list."""
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log: list[tuple[float, float, int, int, int]] = []
        self._pass = (0, 0, 0)

    def run_batch(self, batch):                   # one pass: decode rows and prefill chunks together
        self._pass = (len(batch.decode), len(batch.chunks), sum(c.length for c in batch.chunks))
        return super().run_batch(batch)

    def step(self):
        self._pass, start = (0, 0, 0), time.perf_counter()
        outputs = super().step()
        self.log.append((start, time.perf_counter(), *self._pass))
        return outputs


engine = StepLog(lm, max_running=8, block_size=16, n_blocks=64)
app = create_app(lm, engine=engine, max_waiting=16)
stack = ExitStack()
srv = stack.enter_context(BackgroundServer(app))
print("serving at", srv.base_url)
client = openai.OpenAI(base_url=srv.base_url, api_key="unused", timeout=60)
print("models:", [m.id for m in client.models.list().data])
print("health:", httpx.get(srv.url + "/health", trust_env=False).json())

# %% [markdown]
# ## A chat completion
#
# Exactly what an application would send to OpenAI, pointed at our `base_url`. The server applies the model's chat
# template, the engine decodes greedily (`temperature=0`), and the answer comes back in OpenAI's shape, with `usage`.

# %%
t = time.perf_counter()
r = client.chat.completions.create(model="smollm2-135m", temperature=0, max_tokens=24,
                                   messages=[{"role": "user", "content": "What is the capital of France?"}])
print(f"{time.perf_counter() - t:.2f} s")
print("answer:", repr(r.choices[0].message.content))
print("finish_reason:", r.choices[0].finish_reason, "| usage:", r.usage.prompt_tokens, "prompt +",
      r.usage.completion_tokens, "completion tokens")

# %% [markdown]
# ## Streaming, token by token
#
# With `stream=True` the server answers with server-sent events: one chunk per piece of text as the engine emits
# it, then `data: [DONE]`. The text goes through an incremental detokenizer (a token that ends half-way through a
# UTF-8 character is held back until it is complete). We print each piece the moment it arrives and note the time,
# to draw the stream below.

# %%
arrivals, pieces = [], []
t0 = time.perf_counter()
stream = client.completions.create(model="smollm2-135m", prompt="The three primary colours are", max_tokens=16,
                                   temperature=0, stream=True)
for chunk in stream:
    text = chunk.choices[0].text if chunk.choices else ""
    if text:
        arrivals.append(time.perf_counter() - t0)
        pieces.append(text)
        print(text, end="", flush=True)
print(f"\n\n{len(pieces)} pieces; first after {arrivals[0] * 1e3:.0f} ms, last after {arrivals[-1] * 1e3:.0f} ms")
plain = client.completions.create(model="smollm2-135m", prompt="The three primary colours are", max_tokens=16,
                                  temperature=0).choices[0].text
print("streamed text == non-streamed text:", "".join(pieces) == plain)

# %%
gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
fig, ax = plt.subplots(figsize=(11, 2.8))
ax.eventplot(arrivals, lineoffsets=0, linelengths=0.8, color="tab:blue")
for x, piece in zip(arrivals, pieces):
    ax.text(x, 0.5, repr(piece), rotation=60, fontsize=8, ha="left", va="bottom")
ax.axvline(arrivals[0], color="tab:red", ls="--", lw=1)
ax.text(arrivals[0], -0.75, f" first piece: {arrivals[0] * 1e3:.0f} ms (the prefill pass samples it)", color="tab:red",
        fontsize=8)
ax.set_ylim(-0.9, 2.2); ax.set_yticks([])
ax.set_xlabel("seconds since the request was sent")
ax.set_title(f"one streamed completion: a piece every {1e3 * sum(gaps) / len(gaps):.0f} ms on average after the first")
plt.show()

# %% [markdown]
# ## Several clients at once
#
# Four threads each send a chat request at the same moment, as four users would. The server does not run them one
# after another: each goes into the engine's waiting queue, the engine admits them, prefills them, and from then on
# every step decodes all of them in one forward pass. We time the four together, then the first one again alone
# (greedy, so it gives the same answer), and look at the engine's own log of what each step's pass held.

# %%
QUESTIONS = ["Name a fruit.", "Name a planet.", "Name a colour.", "Name an animal."]
MAX_TOKENS = 12

def ask(question, out, i):
    start = time.perf_counter()
    r = client.chat.completions.create(model="smollm2-135m", temperature=0, max_tokens=MAX_TOKENS,
                                       messages=[{"role": "user", "content": question}])
    out[i] = (start, time.perf_counter(), r.choices[0].message.content, r.usage.completion_tokens)

log_from = len(engine.log)
results = [None] * len(QUESTIONS)
threads = [threading.Thread(target=ask, args=(q, results, i)) for i, q in enumerate(QUESTIONS)]
t_all = time.perf_counter()
for th in threads:
    th.start()
for th in threads:
    th.join()
together = time.perf_counter() - t_all
steps = engine.log[log_from:]                         # (start, end, decode rows, prompts prefilled, prefill tokens)
for q, (start, end, text, n) in zip(QUESTIONS, results):
    print(f"{q:<16} {n:2d} tokens in {end - start:.2f} s: {text!r}")

alone = [None]
t = time.perf_counter()
ask(QUESTIONS[0], alone, 0)
one = time.perf_counter() - t
n_together = sum(r[3] for r in results)
print(f"\n4 requests together: {n_together} tokens in {together:.2f} s; the first alone: {alone[0][3]} tokens in "
      f"{one:.2f} s; same answer alone: {alone[0][2] == results[0][2]}")
print(f"engine steps for the 4: {len(steps)} (one forward pass each); "
      f"most sequences in one pass: {max(d + p for _, _, d, p, _ in steps)}")
for i, (start, end, d, p, tokens) in enumerate(steps[:4]):
    print(f"  step {i}: {d} decode row(s) + the prefill of {p} prompt(s) ({tokens} tokens), one pass, "
          f"{1e3 * (end - start):.0f} ms")

# %% [markdown]
# Had the server run the requests one after another, the four would have taken about four times as long as one.
# The engine's step log shows why they did not. Whichever requests have reached the engine thread when a step starts
# are prefilled in that step's pass; one that arrives while a step runs joins the next, whose single pass (phase
# 3.8's mixed pass) prefills it **and** decodes the requests already running. From then on each step is one forward
# pass over every running sequence, so the answers grow together, a token each per step, and a request that reaches
# EOS leaves the batch without holding up the others. The prefills are short because every request starts with the
# same chat template and system prompt: its full blocks were already in the prefix cache (phase 4.3) from the first
# chat completion, so only the rest of each prompt is computed.

# %%
fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 5), sharex=True, gridspec_kw={"height_ratios": [1, 1.3]})
starts = [s - t_all for s, *_ in steps]
widths = [e - s for s, e, *_ in steps]
decode_rows = [d for _, _, d, _, _ in steps]
prefills = [p for _, _, _, p, _ in steps]
top.bar(starts, decode_rows, widths, align="edge", color="tab:green", ec="white", label="decode rows")
top.bar(starts, prefills, widths, bottom=decode_rows, align="edge", color="tab:orange", ec="white",
        label="prompts prefilled")
top.set_ylabel("sequences in\nthe step's pass"); top.set_ylim(0, len(QUESTIONS) + 0.5)
top.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
top.set_title("four concurrent chat requests: each bar is one engine step, one forward pass")
for i, (q, (start, end, _, _)) in enumerate(zip(QUESTIONS, results)):
    bottom.barh(i, end - start, left=start - t_all, color="tab:blue", alpha=0.7)
    bottom.text(end - t_all, i, f" {q}", va="center", fontsize=8)
bottom.set_yticks(range(len(QUESTIONS)), [f"client {i}" for i in range(len(QUESTIONS))])
bottom.set_xlabel("seconds since the four were sent")
bottom.set_title("each client's request, sent to answered")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## What the server says about itself
#
# `/health` is the engine thread's latest snapshot as JSON; `/metrics` is the same in Prometheus' text format, for a
# scraper. The counters cover everything this notebook sent; with the work done, nothing runs or waits and every KV
# block is free again (prefix-cached blocks count as free: they are reclaimable).

# %%
print(httpx.get(srv.url + "/health", trust_env=False).json())
metrics = httpx.get(srv.url + "/metrics", trust_env=False).text
for line in metrics.splitlines():
    if line.startswith("engine_") and any(k in line for k in ("running", "waiting", "kv_blocks", "tokens_total",
                                                                "preemptions", "prefix_cache_hit")):
        print(line)

# %% [markdown]
# ## Shut it down
#
# Closing the stack leaves the `BackgroundServer` context: uvicorn stops, the app's lifespan stops the engine thread
# (it finishes its step and fails anything still in flight), and the port is released. A client that calls now is
# refused.

# %%
stack.close()
print("uvicorn thread alive:", srv._thread.is_alive(), "| engine thread alive:",
      app.state.engine._thread.is_alive())
try:
    httpx.get(srv.url + "/health", trust_env=False, timeout=2)
except httpx.ConnectError as e:
    print("after shutdown:", type(e).__name__)

# %% [markdown]
# ## Where this leaves us
#
# From a plain decode loop to a server: the same greedy tokens all the way (the tests check each engine against
# Hugging Face `generate`), with the K/V in a paged pool, one batched forward pass per step for everyone in flight,
# shared blocks for samples and common prefixes, preemption when the pool runs short, and now any OpenAI client on the
# other end. `python -m common bench_serve` measures the server under load (latency against request rate, the prefix
# cache on and off, and an undersized pool); `python -m common serve` runs it for real.
