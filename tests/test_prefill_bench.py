"""The prefill_bench harness in measure/: pack specs, the no-paging bound against the SDPA oracle, the
streams' ITL measurement driving a real engine, and no phase imported by measure's side of it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from measure.prefill_attention import contiguous_bound, pack_lengths
from measure.stream_latency import stream_latency

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_pack_lengths_parses_fixed_and_ranged_packs_and_is_seeded():
    assert pack_lengths("16x256") == [256] * 16
    ranged = pack_lengths("32x16-128")
    assert len(ranged) == 32 and all(16 <= n <= 128 for n in ranged) and len(set(ranged)) > 1
    assert pack_lengths("32x16-128") == ranged and pack_lengths("32x16-128", seed=1) != ranged


@pytest.mark.parametrize("spec", ["16by256", "0x4", "2x8-4", "2x0"])
def test_pack_lengths_refuses_bad_specs(spec):
    with pytest.raises(ValueError, match="pack"):
        pack_lengths(spec)


@pytest.mark.parametrize("prefix", [0, 5])
def test_contiguous_bound_on_cpu_equals_the_sdpa_oracle(prefix):
    """SDPA per segment, causal kernel when fresh and a shifted-triangle mask after a prefix, is the attention."""
    from measure.paged_inputs import random_prefill_pack
    from extras.p3_7_varlen_prefill.contiguous import sdpa_prefill_contiguous

    seg_lens = [3, 7, 1]
    p = random_prefill_pack(seg_lens, [prefix] * 3, 4, n_kv_heads=2, group=3, head_dim=16, seed=prefix)
    fn, name = contiguous_bound(p.q, p.k, p.v, seg_lens, [prefix] * 3, scale=0.25)
    out = torch.cat([o[0].transpose(0, 1) for o in fn()])             # [N, H, D]
    ref = sdpa_prefill_contiguous(p.q, p.k, p.v, p.cu_seqlens_q, p.context_lens, scale=0.25)
    assert name == "SDPA per segment"
    torch.testing.assert_close(out, ref)


def test_stream_latency_counts_the_gaps_after_the_arrival(tiny32):
    from phases.p3_8_chunked_prefill.engine import ChunkedPrefillEngine

    engine = ChunkedPrefillEngine(tiny32, max_running=3, block_size=4, n_blocks=32, max_num_batched_tokens=8)
    r = stream_latency(tiny32, engine, n_streams=2, stream_prompt=4, long_prompt=24, steps_before=2,
                       stream_tokens=12)
    # two steps before the arrival give each stream 2 tokens; each of its other 10 ends a gap after it
    assert r["n_gaps"] == 2 * 10
    assert 0 < r["p50"] <= r["p99"] <= r["max"] and r["long_ttft_ms"] > 0 and r["steps"] >= 12


def test_the_prefill_harness_imports_no_phase():
    code = ("import sys, measure.prefill_bench, measure.prefill_attention, measure.stream_latency\n"
            "bad = sorted(m for m in sys.modules if m.startswith('phases'))\nprint(bad)\nsys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
