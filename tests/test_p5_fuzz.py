"""API fuzzing: requests generated from the server's own OpenAPI schema (schemathesis), sent over real HTTP.

Every operation of the schema is fuzzed twice: with bodies the schema allows (positive) and with bodies
it forbids (negative: wrong types, missing fields, values out of range). Properties:
- no 5xx, ever;
- every error body is OpenAI-shaped: {"error": {"message", "type", "param", "code"}};
- a 200 stream ends with `data: [DONE]` and carries no error event; a 200 body has a finish_reason per choice;
- after the run, with the server idle, every KV block is free;
- then concurrent valid requests all finish.
The tiny model and a bounded number of examples keep it within a minute on a CPU; the number of
requests it sent is printed. Generated token counts inside the context are cut to FUZZ_MAX_TOKENS (values
past the context, which must be refused, are left as they are; a body with none gets FUZZ_MAX_TOKENS).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings

schemathesis = pytest.importorskip("schemathesis", reason="the API fuzz test needs 'schemathesis' (see requirements.txt)")

from measure.background_server import BackgroundServer  # noqa: E402
from phases.p5_6_http_server.server import create_app  # noqa: E402
from tests.test_p5_serving import CLIENT_TIMEOUT_S, client, wait_idle  # noqa: E402

EXAMPLES = {"POST": 50, "GET": 5}   # per operation and generation mode (a GET takes no input: positive only)
FUZZ_MAX_TOKENS = 8
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")
MODEL = "tiny"
POOL_BLOCKS = 256
SSE_DONE = "data: [DONE]"


def aim(body, context: int):
    """Point a generated body at the served model and keep its generation short (see the module docstring)."""
    if not isinstance(body, dict):
        return body
    if isinstance(body.get("model"), str):
        body["model"] = MODEL          # most requests then reach the engine instead of a 404
    if "model" in body and not any(key in body for key in TOKEN_FIELDS):
        body["max_tokens"] = FUZZ_MAX_TOKENS   # chat's default is 256 tokens
    for key in TOKEN_FIELDS:
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and FUZZ_MAX_TOKENS < value <= context:
            body[key] = FUZZ_MAX_TOKENS
    return body


def check_response(r: httpx.Response, sent) -> None:
    assert r.status_code < 500, (r.status_code, sent, r.text[:500])
    if r.status_code >= 400:
        body = r.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
        return
    if "text/event-stream" in r.headers.get("content-type", ""):
        events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and "data: " + events[-1] == SSE_DONE, (sent, r.text[-300:])
        assert not any('"error"' in e and "choices" not in e for e in events[:-1]), (sent, r.text[-500:])
    elif r.request.url.path.endswith("completions"):
        assert all(c["finish_reason"] in ("stop", "length") for c in r.json()["choices"]), (sent, r.text)


@pytest.fixture(scope="module")
def fuzz_srv(tiny32):
    app = create_app(tiny32, max_running=16, block_size=16, n_blocks=POOL_BLOCKS, max_waiting=64)
    with BackgroundServer(app) as srv:
        srv.app = app
        yield srv


def test_fuzzed_requests_never_get_a_5xx_and_leave_every_block_free(fuzz_srv, tiny32, capsys):
    schema = schemathesis.openapi.from_dict(fuzz_srv.app.openapi())
    operations = [op.ok() for op in schema.get_all_operations()]
    assert {(o.method.upper(), o.path) for o in operations} >= {("POST", "/v1/completions"),
                                                                 ("POST", "/v1/chat/completions")}
    sent = {"positive": 0, "negative": 0}
    statuses: dict[int, int] = {}
    server_s = [0.0]
    start = time.perf_counter()
    with httpx.Client(base_url=fuzz_srv.url, timeout=CLIENT_TIMEOUT_S, trust_env=False) as http:
        for op in operations:
            modes = list(schemathesis.GenerationMode) if op.method.upper() == "POST" else [schemathesis.GenerationMode.POSITIVE]
            for mode in modes:
                @settings(max_examples=EXAMPLES[op.method.upper()], deadline=None, database=None,
                          suppress_health_check=list(HealthCheck), derandomize=True)
                @given(case=op.as_strategy(generation_mode=mode))
                def send(case):
                    kwargs = case.as_transport_kwargs(base_url=fuzz_srv.url)
                    if "json" in kwargs:
                        kwargs["json"] = aim(kwargs["json"], tiny32.max_context)
                    t0 = time.perf_counter()
                    r = http.request(kwargs["method"], kwargs["url"], headers=kwargs.get("headers"),
                                     params=kwargs.get("params"), json=kwargs.get("json"),
                                     content=kwargs.get("data") if "json" not in kwargs else None)
                    server_s[0] += time.perf_counter() - t0
                    sent[mode.value] += 1
                    statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                    check_response(r, kwargs.get("json", kwargs.get("data")))
                send()
    h = wait_idle(fuzz_srv)
    assert h["free_blocks"] == h["total_blocks"] == POOL_BLOCKS and h["step_failures"] == 0
    with capsys.disabled():
        print(f"\n[api fuzz] {sum(sent.values())} requests from the OpenAPI schema ({sent['positive']} valid by "
              f"the schema, {sent['negative']} not) over {len(operations)} operations; statuses "
              f"{dict(sorted(statuses.items()))}; {time.perf_counter() - start:.1f} s, {server_s[0]:.1f} s of it "
              f"waiting for the server")
    assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0   # both the engine and the refusals were reached

    # Then concurrent valid requests, of every kind, all finish.
    requests = [dict(prompt=f"Fuzz survivor {i}", max_tokens=6, temperature=t, n=n, stop=stop, seed=i, stream=s)
                for i, (t, n, stop, s) in enumerate([(0, 1, None, False), (1.0, 3, None, True), (0.7, 2, ["e"], False),
                                                    (1e-30, 1, None, True), (1.5, 4, None, False), (0, 2, None, True)] * 2)]

    async def one(ac, kw):
        if kw["stream"]:
            reasons = {}
            async for ch in await ac.completions.create(model=MODEL, **kw):
                for c in ch.choices:
                    reasons[c.index] = c.finish_reason or reasons.get(c.index)
            return [reasons[i] for i in range(kw["n"])]
        return [c.finish_reason for c in (await ac.completions.create(model=MODEL, **kw)).choices]

    async def main():
        async with openai.AsyncOpenAI(base_url=fuzz_srv.base_url, api_key="unused", max_retries=0,
                                      timeout=CLIENT_TIMEOUT_S) as ac:
            return await asyncio.gather(*(one(ac, kw) for kw in requests))

    finished = asyncio.run(main())
    assert [len(f) for f in finished] == [kw["n"] for kw in requests]
    assert all(r in ("stop", "length") for f in finished for r in f), finished
    h = wait_idle(fuzz_srv)
    assert h["free_blocks"] == h["total_blocks"] and h["requests_failed"] == 0
    assert client(fuzz_srv).models.list().data[0].id == MODEL
    json.dumps(h)   # /health is plain JSON (no NaN)
