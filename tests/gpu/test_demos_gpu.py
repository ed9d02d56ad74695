"""Every demo in quick mode on the tier's device (`python -m common <demo> --quick --device cuda`), tiny model, fp32.

Each must finish, print tables with rows, and save its JSON, markdown and
plot. The demos' own numbers are checked by their phase's CPU tests; here the
point is that every demo's code path runs on a GPU at all (device placement,
CUDA timers and memory readings, the kernels inside the engines).
"""

from __future__ import annotations

import pytest
import torch

from measure import demos as registry
from measure.cli import run_demo, save_outputs

pytestmark = pytest.mark.gpu

MODEL = "tiny"
DTYPE = "fp32"
# Options the phases' CPU quick tests pass too, to keep a demo small; everything else is quick mode's own.
QUICK_OPTIONS = {
    # A 2 MiB pool on a CPU; on CUDA the pool takes a share of free GPU memory (80% by default):
    # a small share does the same work without claiming most of the card inside a test session.
    "alloc_demo": {"cpu_budget_mb": 2, "memory_fraction": 0.05},
    "block_size_study": {"block_sizes": [1, 4, 16, 64]},
}
# Demos that start the phase-5 HTTP server, and the packages that needs (not every install has them).
SERVER_PACKAGES = {"bench_serve": ("fastapi", "uvicorn", "httpx")}
# What a demo prints where an output check inside it failed: these marks, or False in a column of
# checks ("identical", "kernel == ref"). False in a performance column is no failure: a tiny model
# need not reach workload_bench's speed targets.
FAILED_MARKS = ("✗", "DIFFER")
PERFORMANCE_COLUMNS = {"met"}


@pytest.fixture
def release_cuda_memory(gpu_device):
    """Demos that size their KV pool from free GPU memory should each see the memory the last one freed."""
    yield
    if torch.device(gpu_device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("name", registry.names())
def test_demo_runs_quick(gpu_device, release_cuda_memory, tmp_path, name):
    for package in SERVER_PACKAGES.get(name, ()):
        pytest.importorskip(package, reason=f"demo '{name}' starts the phase-5 server, which needs '{package}'")
    report = run_demo(name, model=MODEL, device=gpu_device, dtype=DTYPE, quick=True,
                      options=QUICK_OPTIONS.get(name))
    assert report.tables, f"{name} printed no table"
    for table in report.tables:
        assert table.rows, f"{name}: table '{table.title}' has no rows"
        checks = [j for j, column in enumerate(table.columns) if column not in PERFORMANCE_COLUMNS]
        cells = [row[j] for row in table.rows for j in checks if j < len(row)] + list(table.notes)
        failed = [c for c in cells if c is False or any(mark in str(c) for mark in FAILED_MARKS)]
        assert not failed, f"{name}: a check inside the demo failed in table '{table.title}'"
    if report.meta.get("device"):
        assert torch.device(str(report.meta["device"])).type == torch.device(gpu_device).type
    paths = save_outputs(name, report, tmp_path)
    assert all(p.exists() and p.stat().st_size > 0 for p in paths)
