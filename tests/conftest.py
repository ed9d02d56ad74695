"""Shared fixtures: models are loaded once per test session (fp32 for token-exact checks)."""

import pytest
import torch

from common.model import load_model


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
