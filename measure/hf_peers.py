"""Hugging Face's own engines, measured on the same requests as ours: the peers a reader could pick instead.

Each is an engine runner of the harness (measure/harness.py): `run(lm, requests, max_running) -> EngineRun`,
and an `EngineRunner` a demo hands to `measure` / `run_tput` (HF_STATIC, HF_COMPILED, HF_CB).

- `run_hf_static`: `model.generate` on ONE left-padded batch of every request, run to the longest requested
  length (static batching: a row that asked for 16 tokens rides along for 256). Its rows' outputs are
  trimmed to what each request asked for; the compute is not. Eager, `DynamicCache`.
- `run_hf_compiled`: the same one padded `generate` call with `cache_implementation="static"`, its decode
  step compiled by `generate` itself on a GPU (CUDA graphs); eager on a CPU.
- `run_hf_cb`: transformers' built-in continuous batching (`model.generate_batch` with a
  `ContinuousBatchingConfig`), the peer a reader would reach for first; `hf_cb_runner("16:1024")` names
  one (page_size, max_batch_tokens) setting of it.

`run_hf_static` and `run_hf_compiled` ignore `max_running`: they are one padded batch of every request.

Every one returns per-request `SeqTiming`s (first token, finish, tokens), the KV bytes it reserves, and
`settings`: what a reader needs to rerun the row. The padded `generate` calls are timed by a logits
processor that marks when each step's logits are ready (`_StepClock`).
"""

from __future__ import annotations

import time

import torch
from transformers import CompileConfig, GenerationConfig, LogitsProcessor, LogitsProcessorList

from common.clock import SeqTiming, now
from measure.bench import ceil_div, kv_bytes_per_token
from measure.harness import EngineRun, EngineRunner
from measure.workload import Request

MS_PER_S = 1e3
# torch.compile guards Python ints by value, so each new static-cache length (and the first new batch
# size) recompiles the decode step. A sweep over batch sizes meets a handful. Past dynamo's default
# `recompile_limit` (8) the step would run eagerly for the rest of the process (after one logged
# warning), and the peer would be timed uncompiled. PyTorch's advice when recompiles are expected is
# to raise the limit; they come from the harness running many shapes in one process, and each shape
# still compiles once, during its warm-up.
HF_COMPILED_RECOMPILE_LIMIT = 64
HF_CB_PAGE_SIZE = 16
HF_CB_MAX_BATCH_TOKENS = 512
HF_CB_RESULT_TIMEOUT_S = 600.0


def _on_cuda(device) -> bool:
    return str(device).startswith("cuda") and torch.cuda.is_available()


class _StepClock(LogitsProcessor):
    """Called by `generate` once per step, when that step's logits are ready (before the token is picked).

    CUDA: records an event on the stream, asynchronously, so the host is never
    made to wait (a synchronize per step would stall the host's queue of work and
    slow a graph-replayed decode step most); `step_times` reads the events after
    the call. CPU: the work is done when the call returns, so reading the clock is
    enough. Every row's token i is timed at step i+1's mark (by then it has surely
    been picked), the last one at the end of the call (`_padded_generate`).
    """

    def __init__(self, device):
        self.cuda = _on_cuda(device)
        self.device = device
        self.marks: list = []      # CUDA events, or perf_counter readings on CPU

    def start(self) -> float:
        """Call right before `generate`: the run's start on the perf_counter timeline."""
        t0 = now(self.device)      # synchronised: nothing is queued before this point
        if self.cuda:
            self.start_event = torch.cuda.Event(enable_timing=True)
            self.start_event.record()
        return t0

    def __call__(self, input_ids, scores):
        if self.cuda:
            mark = torch.cuda.Event(enable_timing=True)
            mark.record()
            self.marks.append(mark)
        else:
            self.marks.append(time.perf_counter())
        return scores

    def step_times(self, t0: float) -> list[float]:
        """When each step's logits were ready, on the perf_counter timeline. Call after a synchronize."""
        if self.cuda:
            return [t0 + self.start_event.elapsed_time(mark) / MS_PER_S for mark in self.marks]
        return list(self.marks)


def _generation_settings(config: GenerationConfig) -> dict:
    """The generation-config fields every HF peer here sets (greedy, length, EOS), JSON-ready."""
    return dict(max_new_tokens=config.max_new_tokens, do_sample=config.do_sample,
                eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)


def _padded_generate(lm, requests: list[Request], **generation_options) -> tuple[EngineRun, int, int]:
    """One left-padded `generate` call over all requests, EOS honoured only where the request wants it.

    Returns the run (settings filled with the generation config) plus the padded width and the longest output.
    """
    ids = [r.ids(lm) for r in requests]
    width = max(len(p) for p in ids)
    pad = lm.pad_token_id
    # Left padding: every row's last prompt token sits in the same column.
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in ids], device=lm.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids], device=lm.device)
    longest = max(r.max_new_tokens for r in requests)
    ignore_eos = all(r.ignore_eos for r in requests)
    config = GenerationConfig(max_new_tokens=longest, do_sample=False, pad_token_id=pad,
                              eos_token_id=None if ignore_eos else sorted(lm.eos_token_ids), **generation_options)
    clock = _StepClock(lm.device)
    start = clock.start()
    out = lm.model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config,
                            logits_processor=LogitsProcessorList([clock]))
    end = now(lm.device)
    step_times = clock.step_times(start) + [end]
    outputs, timings = [], []
    for row, r in enumerate(requests):
        new = out[row, width:].tolist()[: r.max_new_tokens]
        if not r.ignore_eos:
            cut = next((i + 1 for i, t in enumerate(new) if t in lm.eos_token_ids), len(new))
            new = new[:cut]
        t = SeqTiming(arrival=start)
        for i in range(len(new)):
            t.token(step_times[min(i + 1, len(step_times) - 1)])
        outputs.append(new)
        timings.append(t)
    kv = len(requests) * (width + longest) * kv_bytes_per_token(lm)
    settings = dict(rows=len(requests), padded_prompt_len=width, **_generation_settings(config),
                    cache_implementation=config.cache_implementation or "dynamic (DynamicCache)",
                    compile_config=config.compile_config.to_dict() if config.compile_config is not None else None,
                    disable_compile=bool(config.disable_compile),
                    attn_implementation=lm.model.config._attn_implementation)
    return EngineRun(outputs, timings, kv, settings=settings), width, longest


@torch.inference_mode()
def run_hf_static(lm, requests: list[Request], max_running: int | None = None) -> EngineRun:
    """One padded, eager `generate` call over all requests (DynamicCache)."""
    run, _, longest = _padded_generate(lm, requests)
    run.note = f"one padded batch of {len(requests)}, {longest} steps"
    return run


# No inference_mode here: `generate` runs under no_grad by itself, which is how a user calls it, and
# torch.compile has a record of failing or slowing down under inference_mode (pytorch/pytorch#103132, #114119).
def run_hf_compiled(lm, requests: list[Request], max_running: int | None = None, compile: bool = True) -> EngineRun:
    """One padded `generate(cache_implementation="static")` call; its decode step compiled on CUDA.

    The KV cache is preallocated at fixed shapes `[rows, n_kv_heads, cache_len, head_dim]` and written in
    place, so the decode step always sees the same shapes, and on a GPU `generate` compiles it by itself
    (`torch.compile`, transformers' default `CompileConfig`: inductor, `mode="reduce-overhead"`, i.e. CUDA
    graphs that replay a step as one launch). The prefill runs eagerly. The first call compiles (tens of
    seconds on a GPU), so this peer must be warmed up on the workload's own shapes before timing.

    compile=False keeps the static cache and turns compilation off (`disable_compile=True`): the
    eager path the tests compare token for token on CPU. On CPU transformers never compiles
    (it compiles only on accelerators), so there compile=True runs the same eager path.
    """
    compiles = compile and _on_cuda(lm.device)
    recompile_limit = max(HF_COMPILED_RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)
    # An explicit CompileConfig (transformers' defaults, spelled out) so the report can say what ran.
    with torch._dynamo.config.patch(recompile_limit=recompile_limit):
        run, width, longest = _padded_generate(lm, requests, cache_implementation="static",
                                               compile_config=CompileConfig() if compiles else None,
                                               disable_compile=not compiles)
    # transformers sizes the cache for prompt + new tokens - 1 (the last token is never fed back),
    # or keeps a longer one from an earlier call of this model so as not to recompile.
    run.settings["static_cache_len"] = f">= {width + longest - 1}"
    run.settings["compiled"] = compiles
    if compiles:
        run.settings["dynamo_recompile_limit"] = recompile_limit
    how = ("decode step compiled (torch.compile, CUDA graphs)" if compiles else
           "eager (transformers compiles only on a GPU)" if compile else "eager (compile=False)")
    run.note = f"one padded batch of {len(requests)}, {longest} steps, static cache, {how}"
    return run


# No inference_mode here: generate_batch manages its own worker thread and
# tensors, and an inference-mode tensor created on our side breaks its resets.
def run_hf_cb(lm, requests: list[Request], max_running: int | None = None, page_size: int = HF_CB_PAGE_SIZE,
              max_batch_tokens: int = HF_CB_MAX_BATCH_TOKENS, num_blocks: int | None = None,
              result_timeout_s: float = HF_CB_RESULT_TIMEOUT_S) -> EngineRun:
    """transformers' continuous batching (the manager behind `model.generate_batch`) on the same
    requests, each with its own max_new_tokens, as `generate_batch` would run them, at most
    `max_running` per batch (`max_requests_per_batch`)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    ids = [r.ids(lm) for r in requests]
    if num_blocks is None:  # room for everything at once: the pool never makes anyone wait
        num_blocks = sum(ceil_div(len(p) + r.max_new_tokens, page_size) for p, r in zip(ids, requests))
    ignore_eos = all(r.ignore_eos for r in requests)
    config = GenerationConfig(max_new_tokens=max(r.max_new_tokens for r in requests), do_sample=False,
                              pad_token_id=lm.pad_token_id,
                              eos_token_id=None if ignore_eos else sorted(lm.eos_token_ids)[0])
    cb = ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                  max_requests_per_batch=max_running)
    results = {}
    start = now(lm.device)
    with lm.model.continuous_batching_context_manager(generation_config=config, continuous_batching_config=cb,
                                                      block=True, timeout=5) as manager:
        for i, (p, r) in enumerate(zip(ids, requests)):
            manager.add_request(p, request_id=f"req_{i}", max_new_tokens=r.max_new_tokens, record_timestamps=True)
        deadline = now(lm.device) + result_timeout_s
        while len(results) < len(requests):
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                results[out.request_id] = out
            elif out is None and (not manager.is_running() or now(lm.device) > deadline):
                raise RuntimeError(f"generate_batch stopped with {len(results)}/{len(requests)} requests done")
    end = now(lm.device)
    outputs, timings = [], []
    for i, r in enumerate(requests):
        o = results[f"req_{i}"]
        if o.error:
            raise RuntimeError(f"generate_batch failed request {i}: {o.error}")
        new = list(o.generated_tokens)[: r.max_new_tokens]
        t = SeqTiming(arrival=start)
        stamps = list(o.timestamps or [])   # time.perf_counter() readings, like ours
        for k in range(len(new)):
            t.token(stamps[k] if k < len(stamps) else end)
        outputs.append(new)
        timings.append(t)
    kv = num_blocks * page_size * kv_bytes_per_token(lm)
    note = f"page_size {page_size}, {num_blocks} blocks, max_batch_tokens {max_batch_tokens}"
    # Read back after the run: the manager resolves the automatic fields (CUDA graphs) in place.
    use_cuda_graph = cb.use_cuda_graph
    settings = dict(**_generation_settings(config), page_size=page_size, num_blocks=num_blocks,
                    max_batch_tokens=max_batch_tokens, max_requests_per_batch=max_running,
                    use_cuda_graph=list(use_cuda_graph) if isinstance(use_cuda_graph, tuple) else use_cuda_graph,
                    default_compile_level=cb.default_compile_level, use_async_batching=cb.use_async_batching,
                    attn_implementation=lm.model.config._attn_implementation)
    return EngineRun(outputs, timings, kv, note, settings)


def hf_cb_runner(config: str) -> EngineRunner:
    """`run_hf_cb` at one "page_size:max_batch_tokens" setting, named `hf_cb[<config>]`."""
    page, mbt = (int(x) for x in config.split(":"))
    return EngineRunner(f"hf_cb[{config}]", f"generate_batch page_size {page}, max_batch_tokens {mbt}",
                        lambda lm, reqs, mr: run_hf_cb(lm, reqs, mr, page_size=page, max_batch_tokens=mbt))


HF_STATIC = EngineRunner("hf_static", "transformers generate: one left-padded batch of every request", run_hf_static)
HF_COMPILED = EngineRunner("hf_compiled", "transformers generate(cache_implementation='static'): one left-padded "
                           "batch of every request, decode step compiled on CUDA (torch.compile, CUDA graphs)",
                           run_hf_compiled)
HF_CB = EngineRunner("hf_cb", f"transformers generate_batch (continuous batching, page_size {HF_CB_PAGE_SIZE})",
                     run_hf_cb)
