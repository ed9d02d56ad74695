"""measure/kernel_bench.py's GPU timings on a real GPU: graph replay leaves the launch latency out, and a call that
cannot be captured falls back to per-call timing, saying so, with the GPU still usable after the failed capture."""

from __future__ import annotations

import pytest
import torch

from measure.kernel_bench import PER_CALL, gpu_time, median_ms
from tests.gpu.conftest import tier_runs_on_cuda

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not tier_runs_on_cuda(), reason="times CUDA graphs")]


def test_graph_replay_times_a_tiny_kernel_below_its_per_call_time(gpu_device):
    x = torch.zeros(4096, device=gpu_device)
    tiny = lambda: x.add_(1.0)      # noqa: E731  a few microseconds of GPU work: the launch dominates a call
    per_call = median_ms(tiny, gpu_device, warmup=5, iters=50)
    replayed = gpu_time(tiny, gpu_device, warmup=5, iters=50)
    assert replayed.replayed and 0 < replayed.ms < per_call, (replayed, per_call)


def test_a_call_that_syncs_falls_back_to_per_call_and_says_why(gpu_device):
    x = torch.ones(16, device=gpu_device)
    t = gpu_time(lambda: x.sum().item(), gpu_device, warmup=1, iters=3)    # .item(): a host read, not capturable
    assert not t.replayed and t.how.startswith(PER_CALL) and "not capturable" in t.how and t.ms > 0
    after = gpu_time(lambda: x.mul_(1.0), gpu_device, warmup=1, iters=3)   # the failed capture left no damage
    assert after.replayed and after.ms > 0
