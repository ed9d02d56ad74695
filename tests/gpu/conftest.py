"""Fixtures of the gpu tier only: models on the tier's device, TF32 off, and what decides the kernel grid.

The session fixture `gpu_device` (tests/conftest.py) says where the tier runs:
'cuda' on a GPU machine, or whatever ENGINE_TEST_DEVICE names (e.g. 'cpu', to
check the tier's own logic on a machine without a GPU).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from common.model import load_model
from tests.conftest import gpu_tier_device

# The two models every engine is checked on: the 2-layer test model, and the
# real Qwen3-0.6B architecture (28 layers, GQA 16:8, head_dim 128) with random weights.
TIER_MODELS = ["tiny", "dummy:qwen3-0.6b"]


def tier_runs_on_cuda() -> bool:
    """Whether this session's tier runs on a GPU (decided at collection time, so grids can depend on it)."""
    device = gpu_tier_device()
    return device is not None and torch.device(device).type == "cuda"


@pytest.fixture(scope="session")
def tier_models(gpu_device):
    """name -> LoadedModel in fp32 on the tier's device, each loaded once, on first use."""
    loaded: dict[str, object] = {}

    def get(name: str):
        if name not in loaded:
            loaded[name] = load_model(name, device=gpu_device, dtype=torch.float32)
        return loaded[name]
    return get


@pytest.fixture(scope="session", params=TIER_MODELS)
def tier_lm(request, tier_models):
    """Each of TIER_MODELS in turn, fp32 on the tier's device."""
    return tier_models(request.param)


@pytest.fixture(scope="session")
def tier_tiny(tier_models):
    return tier_models("tiny")


@pytest.fixture
def no_tf32():
    """fp32 matmuls and convolutions in full fp32 (no TF32) for the test, restored after.

    With TF32 an fp32 matmul on an Ampere-or-later GPU rounds its inputs to a
    10-bit mantissa: HF and an engine, taking different kernels, would then
    differ far more than fp32 rounding, and greedy tokens could flip.
    """
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    with warnings.catch_warnings():
        # torch >= 2.9 suggests its newer fp32_precision settings; these two flags still set them.
        warnings.simplefilter("ignore", UserWarning)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    yield
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
