"""The phase-5 server on the tier's device: a streamed completion over real HTTP, with the official `openai` client.

The server runs in this process (uvicorn in a thread) on a free 127.0.0.1
port, its engine's KV pool and kernels on the GPU. The streamed text must
arrive in several chunks, equal the non-streamed answer and HF's greedy
tokens, and every block must be free once the request is over. Then the
same with a pool too small for the load (preemption by recomputation on the
device: every answer still equals HF's), and a poisoned request that fails
alone beside a valid stream.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

for _package in ("fastapi", "uvicorn", "httpx", "openai"):
    pytest.importorskip(_package, reason=f"the phase-5 server test needs '{_package}' (see requirements.txt)")

from measure.background_server import BackgroundServer  # noqa: E402
from phases.p5_6_http_server.server import create_app  # noqa: E402
from tests.oracles import hf_greedy  # noqa: E402
from tests.test_p5_1_served_engine import POISON_MAX_TOKENS, PoisonedEngine  # noqa: E402
from tests.test_p5_isolation import metrics  # noqa: E402
from tests.test_p5_serving import PROMPT, client, post, wait_idle  # noqa: E402

MAX_TOKENS = 12
MAX_RUNNING = 4
BLOCK_SIZE = 16
POOL_BLOCKS = 64
SMALL_POOL_BLOCKS = 8       # 8 requests x 2 blocks at their end do not fit: preemption
N_CONCURRENT = 8


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


def test_an_undersized_pool_on_the_device_preempts_and_still_equals_hf(tier_tiny, gpu_device, no_tf32):
    import asyncio

    import openai

    prompts = [f"Request {i} is about to run out of room" for i in range(N_CONCURRENT)]
    expected = [tier_tiny.decode(hf_greedy(tier_tiny, tier_tiny.prompt_ids(p, chat=False), 20, ignore_eos=True))
                for p in prompts]
    app = create_app(tier_tiny, max_running=N_CONCURRENT, block_size=BLOCK_SIZE, n_blocks=SMALL_POOL_BLOCKS)
    with BackgroundServer(app) as srv:
        async def main():
            async with openai.AsyncOpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=60) as ac:
                return await asyncio.gather(*(ac.completions.create(model="tiny", prompt=p, max_tokens=20, temperature=0,
                                                                    extra_body={"ignore_eos": True}) for p in prompts))
        answers = asyncio.run(main())
        assert [a.choices[0].text for a in answers] == expected
        assert metrics(srv)["engine_preemptions_total"] > 0
        h = wait_idle(srv)
        assert h["free_blocks"] == h["total_blocks"] == SMALL_POOL_BLOCKS


def test_a_poisoned_request_fails_alone_on_the_device(tier_tiny, gpu_device, no_tf32):
    engine = PoisonedEngine(tier_tiny, max_running=MAX_RUNNING, block_size=BLOCK_SIZE, n_blocks=POOL_BLOCKS)
    engine.poisoned_kind = "decode"
    ids = tier_tiny.prompt_ids(PROMPT, chat=False)
    expected = tier_tiny.decode(hf_greedy(tier_tiny, ids, 30, ignore_eos=True))
    with BackgroundServer(create_app(tier_tiny, engine=engine)) as srv:
        valid = iter(client(srv).completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True}))
        text = next(valid).choices[0].text
        r = post(srv, "/v1/completions", f'{{"model": "tiny", "prompt": "Another", "max_tokens": {POISON_MAX_TOKENS}, '
                                         f'"temperature": 0}}'.encode())
        assert r.status_code == 500 and "poisoned pass" in r.json()["error"]["message"]
        text += "".join(ch.choices[0].text for ch in valid)
        assert text == expected
        h = wait_idle(srv)
        assert h["free_blocks"] == h["total_blocks"] and h["requests_failed"] == 1
