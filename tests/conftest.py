"""Shared fixtures: models are loaded once per test session (fp32 for token-exact checks).

The `gpu` tier: tests marked `@pytest.mark.gpu` (everything under tests/gpu/)
need a CUDA GPU. Without one they are collected and skipped with the reason.
`make gpu-check` runs only them (`pytest -m gpu`) on a GPU machine.
ENGINE_TEST_DEVICE=cpu runs the same tier on the CPU instead (slow; for
checking the tier itself on a machine without a GPU).
"""

import os

# Under pytest-xdist (`make test` runs one worker per core) the workers share the cores, so each one, and
# every process it starts, gets its share of OpenMP threads: a process whose threads outnumber the cores
# left to it spins at every barrier and runs many times slower. Set before torch is imported.
XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if XDIST_WORKERS:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // XDIST_WORKERS))

import pytest  # noqa: E402
import torch  # noqa: E402

if XDIST_WORKERS:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from common.model import load_model

TEST_DEVICE_ENV = "ENGINE_TEST_DEVICE"
NO_GPU_REASON = ("gpu tier: needs a CUDA GPU (torch.cuda.is_available() is False here); "
                 "run `make gpu-check` on a GPU machine or `modal run modal_run.py::gpu_check`")


def gpu_tier_device() -> str | None:
    """The device the gpu tier runs on here: 'cuda', or ENGINE_TEST_DEVICE; None: skip the tier."""
    forced = os.environ.get(TEST_DEVICE_ENV)
    if forced:
        return forced
    return "cuda" if torch.cuda.is_available() else None


def pytest_collection_finish(session):
    """Tell tests/nbrun.py which notebooks the selected tests will run, so it can run them side by side.
    Only when some will: nbrun needs the notebook packages, which a bare GPU box running the gpu tier lacks."""
    names = [m.args[0] for item in session.items for m in item.iter_markers("notebook")]
    if names:
        from tests import nbrun
        nbrun.plan(names)


@pytest.hookimpl(tryfirst=True)   # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    # The notebook tests go to one worker (with --dist loadgroup), which runs their notebooks side by side
    # when the first is asked for (tests/nbrun.py); spread over workers, each would run them all.
    for item in items:
        if item.get_closest_marker("notebook"):
            item.add_marker(pytest.mark.xdist_group("notebooks"))
    if gpu_tier_device() is not None:
        return
    skip = pytest.mark.skip(reason=NO_GPU_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_device() -> str:
    """Where gpu-tier tests put their tensors and models ('cuda' unless ENGINE_TEST_DEVICE says otherwise)."""
    device = gpu_tier_device()
    if device is None:
        pytest.skip(NO_GPU_REASON)
    return device


@pytest.fixture(scope="session")
def smol32():
    """The packaged SmolLM2-135M-Instruct in fp32 on CPU: the token-for-token oracle model."""
    return load_model("smollm2-135m", device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny32():
    """2-layer, hidden-64 random Llama (GQA 4:2) in fp32 on CPU."""
    return load_model("tiny", device="cpu", dtype=torch.float32)


@pytest.fixture(params=["tiny", "smollm2-135m"])
def any32(request, smol32, tiny32):
    return {"tiny": tiny32, "smollm2-135m": smol32}[request.param]


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of many tiny forward passes: on a shared 2-core machine, far faster."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
