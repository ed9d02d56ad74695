"""How close does the engine get to what this machine can compute? And where does a step's time go?

Roofline (compute side): decoding one token costs about 2 FLOPs per weight
(one multiply, one add) for every parameter the token passes through — all of
them for a dense model whose LM head shares the embedding matrix. So

    tokens/s ceiling = measured matmul FLOP/s / (2 * n_params)

The matmul rate is measured, not looked up: a square matmul in the run's dtype,
timed after a warm-up. Decode at small batch is bounded by memory bandwidth
long before this ceiling; the share tells how far the engine is from the
compute roof, the profile tells what eats the rest.

`profile_decode_step(engine)` takes any engine with `lm` and a `step()` that
runs one scheduler step; call it while its sequences are decoding.
"""

from __future__ import annotations

import torch

from common.clock import now

MATMUL_N = 2048          # square size: big enough to reach the CPU's steady GEMM rate
MATMUL_REPEATS = 10
PROFILE_TOP_OPS = 10


def measure_matmul_flops(dtype: torch.dtype, device: str, n: int = MATMUL_N, repeats: int = MATMUL_REPEATS) -> float:
    """FLOP/s of an [n, n] @ [n, n] matmul in `dtype` on `device` (2 n^3 FLOPs each)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.matmul(a, b)  # warm-up: thread pool, kernel selection
    start = now(device)
    for _ in range(repeats):
        torch.matmul(a, b)
    elapsed = now(device) - start
    return 2 * n ** 3 * repeats / elapsed


def roofline_tokens_per_s(matmul_flops: float, n_params: int) -> float:
    return matmul_flops / (2 * n_params)


def profile_decode_step(engine, top: int = PROFILE_TOP_OPS) -> list[dict]:
    """Profile ONE engine step (call it while sequences are decoding); the top ops by self time.

    Returns [{"op", "self_ms", "share"}] with share of the step's total self time.
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if str(engine.lm.device).startswith("cuda") else [])
    with profile(activities=activities) as prof:
        engine.step()
    events = prof.key_averages()
    cuda = str(engine.lm.device).startswith("cuda")

    def self_us(e) -> float:
        return e.self_device_time_total if cuda else e.self_cpu_time_total

    total = sum(self_us(e) for e in events) or 1.0
    rows = sorted(events, key=self_us, reverse=True)[:top]
    return [{"op": e.key, "self_ms": self_us(e) / 1e3, "share": self_us(e) / total} for e in rows]
