"""grow_demo's measurement (measure/grow_bench.py): what a growing sequence copies, checked against arithmetic.

DynamicCache grows K and V of every layer by torch.cat each step: n_layers x 2 reallocations per
step, each copying the tensor's old contents. The paged pool never moves; phase 3.3's PagedCache
copies each layer's tokens out of it for attention instead.
"""

import torch

from common.model import load_model
from measure.grow_bench import MB, measure_growth
from phases.p3_3_paged_cache.demo import dynamic_cache, paged_cache

PROMPT = list(range(100, 110))
NEW = 6


def per_token_layer_bytes(lm) -> int:
    """K or V of one token in one layer."""
    return lm.n_kv_heads * lm.head_dim * torch.finfo(lm.dtype).bits // 8


def test_dynamic_cache_reallocates_and_copies_every_step():
    lm = load_model("tiny", dtype=torch.float32)
    rows = measure_growth(lm, PROMPT, NEW, dynamic_cache, checkpoints=[])
    last = rows[-1]
    unit = per_token_layer_bytes(lm)
    steps_after_prefill = NEW - 1
    assert last["tokens"] == len(PROMPT) + NEW - 1        # the last pass feeds token NEW - 1
    assert last["allocations"] == steps_after_prefill * lm.n_layers * 2
    # step s (1-based after the prefill) copies the len(PROMPT) + s - 1 tokens held before it, K and V, every layer
    copied = sum((len(PROMPT) + s - 1) * unit * 2 * lm.n_layers for s in range(1, NEW))
    assert abs(last["grow_copied_mb"] - copied / MB) < 1e-9
    assert last["attend_copied_mb"] == 0                  # update() returns the cache's own tensors
    assert abs(last["held_mb"] - last["tokens"] * unit * 2 * lm.n_layers / MB) < 1e-9


def test_the_paged_pool_never_moves_but_phase_3_3_gathers_to_attend():
    lm = load_model("tiny", dtype=torch.float32)
    rows = measure_growth(lm, PROMPT, NEW, paged_cache, checkpoints=[])
    last = rows[-1]
    assert last["allocations"] == 0 and last["grow_copied_mb"] == 0
    unit = per_token_layer_bytes(lm)
    # each pass returns every layer's K and V of all tokens so far: prefill (10), then 11, 12, ...
    gathered = sum(n * unit * 2 * lm.n_layers for n in range(len(PROMPT), len(PROMPT) + NEW))
    assert abs(last["attend_copied_mb"] - gathered / MB) < 1e-9


def test_grow_demo_quick():
    from measure.cli import run_demo
    report = run_demo("grow_demo", model="tiny", device="cpu", dtype="fp32", quick=True)
    dynamic, paged = report.data["growth"].values()
    assert dynamic[-1]["allocations"] > 0 and paged[-1]["allocations"] == 0
