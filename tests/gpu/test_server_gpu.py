"""The phase-5 server on the tier's device: a streamed completion over real HTTP, with the official `openai` client.

The server runs in this process (uvicorn in a thread) on a free 127.0.0.1
port, its engine's KV pool and kernels on the GPU. The streamed text must
arrive in several chunks, equal the non-streamed answer and HF's greedy
tokens, and every block must be free once the request is over.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

for _package in ("fastapi", "uvicorn", "httpx", "openai"):
    pytest.importorskip(_package, reason=f"the phase-5 server test needs '{_package}' (see requirements.txt)")

from phases.p5_serving.launch import BackgroundServer  # noqa: E402
from phases.p5_serving.server import create_app  # noqa: E402
from tests.oracles import hf_greedy  # noqa: E402
from tests.test_p5_serving import PROMPT, client, wait_idle  # noqa: E402

MAX_TOKENS = 12
MAX_RUNNING = 4
BLOCK_SIZE = 16
POOL_BLOCKS = 64


@pytest.fixture(scope="module")
def tiny_server(tier_tiny):
    app = create_app(tier_tiny, max_running=MAX_RUNNING, block_size=BLOCK_SIZE, n_blocks=POOL_BLOCKS)
    with BackgroundServer(app) as srv:
        srv.app = app
        yield srv


def test_streamed_completion_on_the_device(tiny_server, tier_tiny, gpu_device, no_tf32):
    pool = tiny_server.app.state.engine.engine.allocator.kv_store
    assert pool.device.type == torch.device(gpu_device).type, "the served engine's KV pool is not on the tier's device"
    # The oracle runs on the model the server serves: compute it while the server is idle.
    ids = tier_tiny.prompt_ids(PROMPT, chat=False)
    wait_idle(tiny_server)
    expected = tier_tiny.decode(hf_greedy(tier_tiny, ids, MAX_TOKENS, ignore_eos=True))
    c = client(tiny_server)
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    chunks = list(c.completions.create(**kw, stream=True))
    pieces = [ch.choices[0].text for ch in chunks if ch.choices]
    assert len([p for p in pieces if p]) > 1, "the answer did not stream: it came in one piece"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"

    plain = c.completions.create(**kw)
    assert "".join(pieces) == plain.choices[0].text == expected
    assert plain.usage.completion_tokens == MAX_TOKENS
    h = wait_idle(tiny_server)   # nothing running or waiting, and every block free again
    assert h["free_blocks"] == h["total_blocks"] == POOL_BLOCKS
