"""Hugging Face's own engines, measured on the same requests as ours.

- `hf_static_generate`: `model.generate` on ONE left-padded batch of every
  request, run to the longest requested length (static batching: a row that
  asked for 16 tokens rides along for 256). Its rows' outputs are trimmed to
  what each request asked for; the compute is not.
- `hf_generate_batch`: transformers' built-in continuous batching
  (`model.generate_batch` with a `ContinuousBatchingConfig`), the peer a
  reader would reach for first.

Both return per-request `SeqTiming`s (first token, finish, tokens) plus the KV
bytes they reserve, so `common.bench.summarize` treats them like our engines.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from common.bench import SeqTiming, kv_bytes_per_token, now
from common.workload import Request


@dataclass
class BaselineRun:
    outputs: list[list[int]]       # new token ids per request, in request order
    timings: list[SeqTiming]
    kv_bytes: int                  # KV memory the engine held/reserved for the run
    note: str = ""


class _StepClock(LogitsProcessor):
    """Called once per decoding step by `generate`: records when each step's logits were ready."""

    def __init__(self, device):
        self.device = device
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(now(self.device))
        return scores


@torch.inference_mode()
def hf_static_generate(lm, requests: list[Request]) -> BaselineRun:
    """One padded `generate` call over all requests, EOS honoured only where the request wants it."""
    ids = [r.ids(lm) for r in requests]
    width = max(len(p) for p in ids)
    pad = lm.pad_token_id
    # Left padding: every row's last prompt token sits in the same column.
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in ids], device=lm.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids], device=lm.device)
    longest = max(r.max_new_tokens for r in requests)
    ignore_eos = all(r.ignore_eos for r in requests)
    clock = _StepClock(lm.device)
    config = GenerationConfig(max_new_tokens=longest, do_sample=False, pad_token_id=pad,
                              eos_token_id=None if ignore_eos else sorted(lm.eos_token_ids))
    start = now(lm.device)
    out = lm.model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config,
                            logits_processor=LogitsProcessorList([clock]))
    end = now(lm.device)
    # The processor runs before sampling; token i of every row is out once step i's logits are done.
    step_times = clock.times + [end]
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
    return BaselineRun(outputs, timings, kv, note=f"one padded batch of {len(requests)}, {longest} steps")


# No inference_mode here: generate_batch manages its own worker thread and
# tensors, and an inference-mode tensor created on our side breaks its resets.
def hf_generate_batch(lm, requests: list[Request], page_size: int = 16, num_blocks: int | None = None,
                      max_batch_tokens: int = 512, max_requests_per_batch: int | None = None,
                      result_timeout_s: float = 600.0) -> BaselineRun:
    """transformers' continuous batching (the manager behind `model.generate_batch`) on the same
    requests, each with its own max_new_tokens, as `generate_batch` would run them."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    ids = [r.ids(lm) for r in requests]
    if num_blocks is None:  # room for everything at once: the pool never makes anyone wait
        num_blocks = sum(-(-(len(p) + r.max_new_tokens) // page_size) for p, r in zip(ids, requests))
    ignore_eos = all(r.ignore_eos for r in requests)
    config = GenerationConfig(max_new_tokens=max(r.max_new_tokens for r in requests), do_sample=False,
                              pad_token_id=lm.pad_token_id,
                              eos_token_id=None if ignore_eos else sorted(lm.eos_token_ids)[0])
    cb = ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                  max_requests_per_batch=max_requests_per_batch)
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
    return BaselineRun(outputs, timings, kv, note)
