"""Phase 5, hardened, over HTTP: validation before the engine, a poisoned request that fails alone beside a
valid stream, preemption under an undersized pool, the storm (the engine alone: tests/test_p5_1_served_engine.py).

Each regression test checks the status, the body, and that every KV block is free once the server is idle.
Servers run in-process on free 127.0.0.1 ports (tests/test_p5_serving.py's helpers).
"""

from __future__ import annotations

import asyncio
import logging
import math

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from common.sampling import SEED_MAX, InvalidSamplingParams, SamplingParams, sample
from measure.background_server import BackgroundServer
from phases.p5_1_served_engine.engine import DECODE_PASS, PREFILL_PASS
from phases.p5_6_http_server.server import create_app
from tests.oracles import hf_greedy
from tests.test_p5_1_served_engine import POISON_MAX_TOKENS, PoisonedEngine
from tests.test_p5_serving import CLIENT_TIMEOUT_S, PROMPT, client, health, post, wait_idle

STORM_STREAMS, STORM_QUITTERS = 100, 20
STORM_TIMEOUT_S = 120


def error_of(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"], body
    return body["error"]


def assert_all_blocks_free(srv) -> dict:
    h = wait_idle(srv)
    assert h["free_blocks"] == h["total_blocks"] and h["running"] == h["waiting"] == h["preempted"] == 0, h
    return h


def metrics(srv) -> dict[str, float]:
    text = httpx.get(srv.url + "/metrics", timeout=CLIENT_TIMEOUT_S, trust_env=False).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.fixture(scope="module")
def srv(tiny32):
    app = create_app(tiny32, max_running=8, block_size=16, n_blocks=128, max_waiting=32)
    with BackgroundServer(app) as s:
        s.app = app
        yield s


# --- 1. validation: once, in the engine's add(), mapped to 400 with `param` -------------------------
def test_sampling_params_refuse_what_would_crash_a_step():
    for kwargs, param in [(dict(temperature=math.nan), "temperature"), (dict(temperature=math.inf), "temperature"),
                          (dict(temperature=10**400), "temperature"), (dict(top_p=math.nan), "top_p"),
                          (dict(top_k=True), "top_k"), (dict(seed=SEED_MAX + 1), "seed"), (dict(seed=2**64), "seed"),
                          (dict(seed="7"), "seed")]:
        with pytest.raises(InvalidSamplingParams) as e:
            SamplingParams(**kwargs)
        assert e.value.param == param, kwargs
    ok = SamplingParams(temperature=1.0, seed=SEED_MAX - 2)
    ok.validate(n_samples=3)                   # seeds SEED_MAX - 2 .. SEED_MAX: all fit
    with pytest.raises(InvalidSamplingParams, match="seed \\+ i") as e:
        ok.validate(n_samples=4)
    assert e.value.param == "seed"


def test_a_tiny_temperature_samples_greedily():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1e-40, seed=1)
    assert params.greedy and torch.equal(sample(logits, params), logits.argmax(-1))


def test_seed_overflow_with_n_samples_is_a_400_naming_seed(srv):
    h0 = health(srv)
    cases = [
        b'{"model": "tiny", "prompt": "hi", "n": 3, "seed": 18446744073709551614, "max_tokens": 4}',  # a seed past int64's range
        b'{"model": "tiny", "prompt": "hi", "seed": 18446744073709551616, "max_tokens": 4}',          # 2**64, n=1
        b'{"model": "tiny", "prompt": "hi", "n": 3, "seed": 9223372036854775806, "max_tokens": 4}',   # seed + 2 > int64
    ]
    for body in cases:
        r = post(srv, "/v1/completions", body)
        assert r.status_code == 400, (body, r.text)
        err = error_of(r)
        assert err["param"] == "seed" and err["type"] == "invalid_request_error", err
        assert "seed" in err["message"] and "Overflow" not in err["message"], err
    h = assert_all_blocks_free(srv)
    assert h["total_blocks"] == h0["total_blocks"] == 128 and h["step_failures"] == h0["step_failures"]


def test_a_tiny_temperature_is_greedy_over_http(srv, tiny32):
    ids = tiny32.prompt_ids(PROMPT, chat=False)
    expected = tiny32.decode(hf_greedy(tiny32, ids, 8, ignore_eos=True))
    c = client(srv)
    for stream in (False, True):
        kw = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1e-40, n=2, extra_body={"ignore_eos": True})
        if stream:
            texts = ["", ""]
            for ch in c.completions.create(**kw, stream=True):
                for choice in ch.choices:
                    texts[choice.index] += choice.text
        else:
            texts = [ch.text for ch in c.completions.create(**kw).choices]
        assert texts == [expected, expected]
    assert_all_blocks_free(srv)


@pytest.mark.parametrize("body, param", [
    (b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', "temperature"),
    (b'{"model": "tiny", "prompt": "hi", "top_p": Infinity}', "top_p"),
    (b'{"model": "tiny", "prompt": "hi", "top_k": -2}', "top_k"),
    (b'{"model": "tiny", "prompt": "hi", "n": 9}', None),          # n > max_running: the engine's own check
    (b'{"model": "tiny", "prompt": "hi", "stop": ["' + b"x" * 300 + b'"]}', "stop"),
], ids=["nan-temperature", "inf-top_p", "top_k-below-minus-1", "n-above-max_running", "stop-too-long"])
def test_out_of_range_values_are_400s(srv, body, param):
    r = post(srv, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == param
    assert_all_blocks_free(srv)


def test_top_k_minus_one_means_no_cut(srv, tiny32):
    c = client(srv)
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0.8, seed=11)
    texts = [c.completions.create(**kw, extra_body={"ignore_eos": True, **top_k}).choices[0].text
             for top_k in ({}, {"top_k": -1}, {"top_k": 0}, {"top_k": 1})]
    assert texts[0] == texts[1] == texts[2] != texts[3]   # -1 and 0: no cut; 1: greedy
    assert_all_blocks_free(srv)


# --- 2. isolation: a failing pass fails its culprit alone ---------------------------------------------
@pytest.mark.parametrize("kind", [PREFILL_PASS, DECODE_PASS])
def test_a_poisoned_request_fails_alone_beside_a_valid_stream(tiny32, kind, caplog):
    engine = PoisonedEngine(tiny32, max_running=8, block_size=16, n_blocks=64)
    engine.poisoned_kind = kind
    ids = tiny32.prompt_ids(PROMPT, chat=False)
    expected = tiny32.decode(hf_greedy(tiny32, ids, 40, ignore_eos=True))
    caplog.set_level(logging.ERROR, logger="phases.p5_2_async_engine.async_engine")
    with BackgroundServer(create_app(tiny32, engine=engine)) as s:
        c = client(s)
        valid = iter(c.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True}))
        text = next(valid).choices[0].text + next(valid).choices[0].text   # it is decoding now
        poisoned = dict(model="tiny", prompt="Another request", max_tokens=POISON_MAX_TOKENS, temperature=0)
        r = post(s, "/v1/completions", f'{{"model": "tiny", "prompt": "Another request", '
                                        f'"max_tokens": {POISON_MAX_TOKENS}, "temperature": 0}}'.encode())
        assert r.status_code == 500, r.text
        err = error_of(r)
        assert err["type"] == "server_error" and "poisoned pass" in err["message"]
        with pytest.raises(openai.APIError, match="poisoned pass"):   # streamed: an error event, then [DONE]
            list(c.completions.create(**poisoned, stream=True))
        chunks = list(valid)
        text += "".join(ch.choices[0].text for ch in chunks)
        assert text == expected and chunks[-1].choices[0].finish_reason == "length"
        h = assert_all_blocks_free(s)
        assert h["requests_failed"] == 2 and h["step_failures"] >= 2 and not h["isolating"]
        assert metrics(s)["engine_requests_failed_total"] == 2
    logged = [r for r in caplog.records if "engine step" in r.getMessage()]
    assert logged and all(r.exc_info and isinstance(r.exc_info[1], RuntimeError) for r in logged)
    assert all("cmpl-" in r.getMessage() for r in logged)   # the failed request's id is in the log line


# --- 3. the whole engine, observed: /health and /metrics; an undersized pool --------------------------
def test_health_and_metrics_report_the_engine(srv):
    c = client(srv)
    kw = dict(model="tiny", prompt=" ".join([PROMPT] * 8), max_tokens=4,   # 40 tokens: 2 full blocks of 16
              temperature=0, extra_body={"ignore_eos": True})
    c.completions.create(**kw)
    c.completions.create(**kw)            # the same prompt again: its full blocks come from the prefix cache
    h = assert_all_blocks_free(srv)
    for key in ("running", "waiting", "preempted", "free_blocks", "total_blocks", "prefix_hit_rate", "tokens_per_s",
                "preemptions", "generated_tokens", "step_failures", "queued_requests", "max_waiting"):
        assert key in h, key
    assert h["prefix_hit_rate"] > 0 and h["tokens_per_s"] > 0 and h["generated_tokens"] >= 8
    r = httpx.get(srv.url + "/metrics", timeout=CLIENT_TIMEOUT_S, trust_env=False)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = metrics(srv)
    assert m["engine_running_sequences"] == 0 and m["engine_waiting_sequences"] == 0
    assert m["engine_preempted_sequences"] == 0 and m["engine_kv_blocks_free"] == m["engine_kv_blocks_total"] == 128
    assert 0 < m["engine_prefix_cache_hit_rate"] <= 1 and m["engine_generation_tokens_per_second"] > 0
    assert m["engine_generation_tokens_total"] >= 8 and "engine_preemptions_total" in m


def test_an_undersized_pool_preempts_and_every_request_equals_hf_greedy(tiny32):
    """8 concurrent greedy requests whose KV at their end needs 16 blocks, in a pool of 8: optimistic admission
    preempts (by recomputation), every request completes, no 5xx, and each text equals HF generate's."""
    prompts = [f"Request {i} is about to run out of room" for i in range(8)]
    max_tokens = 20
    expected = [tiny32.decode(hf_greedy(tiny32, tiny32.prompt_ids(p, chat=False), max_tokens, ignore_eos=True))
                for p in prompts]
    app = create_app(tiny32, max_running=8, block_size=16, n_blocks=8, max_waiting=16)
    with BackgroundServer(app) as s:
        async def main():
            async with openai.AsyncOpenAI(base_url=s.base_url, api_key="unused", max_retries=0,
                                          timeout=CLIENT_TIMEOUT_S) as ac:
                return await asyncio.gather(*(ac.completions.create(model="tiny", prompt=p, max_tokens=max_tokens,
                                                                    temperature=0, extra_body={"ignore_eos": True})
                                              for p in prompts))
        answers = asyncio.run(main())
        assert [a.choices[0].text for a in answers] == expected
        assert all(a.choices[0].finish_reason == "length" for a in answers)
        assert metrics(s)["engine_preemptions_total"] > 0
        assert_all_blocks_free(s)


# --- 4. storm and overload, unchanged -------------------------------------------------------------
def test_a_storm_of_100_streams_with_20_percent_disconnects_leaves_every_block_free(tiny32):
    app = create_app(tiny32, max_running=16, block_size=16, n_blocks=256, max_waiting=STORM_STREAMS)
    quitters = set(range(0, STORM_STREAMS, STORM_STREAMS // STORM_QUITTERS))

    async def one(ac, i):
        stream = await ac.completions.create(model="tiny", prompt=f"Storm request {i}", temperature=0.7, seed=i,
                                             max_tokens=400 if i in quitters else 12, stream=True,
                                             extra_body={"ignore_eos": True})
        n = 0
        async for ch in stream:
            n += 1
            if i in quitters and n == 3:
                await stream.close()
                return None
        return ch.choices[0].finish_reason

    with BackgroundServer(app) as s:
        async def main():
            async with openai.AsyncOpenAI(base_url=s.base_url, api_key="unused", max_retries=0,
                                          timeout=STORM_TIMEOUT_S) as ac:
                return await asyncio.wait_for(asyncio.gather(*(one(ac, i) for i in range(STORM_STREAMS))),
                                              STORM_TIMEOUT_S)
        reasons = asyncio.run(main())
        assert [r for i, r in enumerate(reasons) if i not in quitters] == ["length"] * (STORM_STREAMS - len(quitters))
        h = assert_all_blocks_free(s)
        assert h["total_blocks"] == 256 and h["step_failures"] == 0
