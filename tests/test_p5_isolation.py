"""Phase 5, hardened: validation before the engine, a failing step that fails only its culprit, rollback
of a fork that fails half-way, /health and /metrics, preemption under an undersized pool, the storm.

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

from common.sampling import SEED_MAX, GREEDY, InvalidSamplingParams, SamplingParams, sample
from phases.p3_1_block_allocator.allocator import BlockAllocator
from phases.p3_2_block_table.block_table import BlockTable
from phases.p4_1_copy_on_write.block_ops import CopyQueue, append_slots_cow, check_refcounts, fork
from phases.p4_1_copy_on_write.engine import SharingEngine
from phases.p5_serving.isolation import DECODE_PASS, PREFILL_PASS, StepFailed
from phases.p5_serving.launch import BackgroundServer
from phases.p5_serving.samples import SAMPLES, ServingEngine
from phases.p5_serving.server import create_app
from tests.oracles import hf_greedy
from tests.test_p4_5_speculative import refused_before_a_pool_is_taken
from tests.test_p5_serving import CLIENT_TIMEOUT_S, PROMPT, client, health, post, wait_idle

POISON_MAX_TOKENS = 13     # a request with this max_tokens makes every forward pass it is in raise
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


def test_the_engine_refuses_a_seed_its_samples_would_overflow_before_queueing_anything(tiny32):
    engine = ServingEngine(tiny32, max_running=4, block_size=16, n_blocks=32)
    with pytest.raises(InvalidSamplingParams) as e:
        engine.add_group([5, 6, 7], 4, SamplingParams(temperature=1.0, seed=SEED_MAX - 1), n=3)
    assert e.value.param == "seed"
    assert not engine.waiting and not engine.groups and engine._next_id == 0
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add([5, 6, 7], 4, sampling={"temperature": 1.0})


@pytest.mark.parametrize("k", [0, True])
def test_the_served_engine_refuses_a_bad_k_before_taking_a_pool(tiny32, k, monkeypatch):
    refused_before_a_pool_is_taken(
        lambda: ServingEngine(tiny32, speculative="ngram", num_speculative_tokens=k, n_blocks=8), monkeypatch)


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
class PoisonedEngine(ServingEngine):
    """Every forward pass that holds a request with max_tokens == POISON_MAX_TOKENS in the role `poisoned_kind`
    (prefilling a chunk, or decoding) raises, after its slots were claimed: a request-specific failure no
    validation can see."""
    poisoned_kind = PREFILL_PASS

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        run = self.runner.run

        def poisoned(batch):
            if any(g.max_new_tokens == POISON_MAX_TOKENS and self.poisoned_kind in roles
                   for g, roles in self.in_pass.items()):
                raise RuntimeError("poisoned pass")
            return run(batch)
        self.runner.run = poisoned


def run_to_end(engine) -> tuple[list[StepFailed], int]:
    failures = []
    while engine.has_work:
        try:
            engine.step()
        except StepFailed as f:
            failures.append(f)
    return failures


@pytest.mark.parametrize("kind,budget", [(PREFILL_PASS, None), (DECODE_PASS, None), (PREFILL_PASS, 7), (DECODE_PASS, 7)])
def test_the_culprit_of_a_failing_pass_is_found_and_fails_alone(tiny32, kind, budget):
    """Six requests, one poisoned, samples and seeds among them: the engine narrows its passes until the
    poisoned one fails alone; every other output equals an undisturbed run, token for token. With a budget of 7
    tokens the prompts (20-25 tokens) are prefilled in chunks beside decode tokens."""
    def add_all(engine, poison_index):
        groups = []
        for i in range(6):
            sampling = SamplingParams(temperature=1.0, seed=5 + i) if i % 2 else GREEDY
            groups.append(engine.add_group(list(range(10 + i, 30 + i)), POISON_MAX_TOKENS if i == poison_index else 12,
                                           sampling, ignore_eos=True, n=2 if i == 4 else 1))
        return groups

    chunks = {} if budget is None else dict(max_num_batched_tokens=budget)
    reference = ServingEngine(tiny32, max_running=8, block_size=4, n_blocks=256, **chunks)
    expected = add_all(reference, poison_index=None)
    assert not run_to_end(reference)
    engine = PoisonedEngine(tiny32, max_running=8, block_size=4, n_blocks=256, **chunks)
    engine.poisoned_kind = kind
    groups = add_all(engine, poison_index=3)
    failures = run_to_end(engine)
    assert [g.request_id for f in failures for g in f.failed] == [3]
    assert len(failures) <= math.ceil(math.log2(6)) + 1   # each failure halves the width or fails the culprit
    assert all(str(f.error) == "poisoned pass" for f in failures)
    for i, (g, ref) in enumerate(zip(groups, expected)):
        if i == 3:
            assert [s.finish_reason for s in g.seqs] == ["error"]
        else:
            assert [s.output_ids for s in g.seqs] == [s.output_ids for s in ref.seqs], i
            assert all(s.finish_reason == "length" for s in g.seqs)
    assert engine.allocator.n_free == engine.allocator.n_blocks and not engine.isolating
    assert engine.slots_promised == 0 and not engine.running and not engine.waiting
    check_refcounts(engine.allocator, [])


@pytest.mark.parametrize("kind", [PREFILL_PASS, DECODE_PASS])
def test_a_poisoned_request_fails_alone_beside_a_valid_stream(tiny32, kind, caplog):
    engine = PoisonedEngine(tiny32, max_running=8, block_size=16, n_blocks=64)
    engine.poisoned_kind = kind
    ids = tiny32.prompt_ids(PROMPT, chat=False)
    expected = tiny32.decode(hf_greedy(tiny32, ids, 40, ignore_eos=True))
    caplog.set_level(logging.ERROR, logger="phases.p5_serving.async_engine")
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


def test_a_fork_that_fails_half_way_rolls_back(tiny32):
    """Phase 4.1's fork is all or nothing: making the third sample raises (what a seed + i overflow did);
    the two made before it are taken back, and no block or slot leaks."""
    class FailingFork(SharingEngine):
        def new_member(self, group, parent, index):
            if index == 2:
                raise ValueError("Overflow when unpacking long long")
            return super().new_member(group, parent, index)

    engine = FailingFork(tiny32, max_running=4, block_size=4, n_blocks=32)
    group = engine.add_group(list(range(10, 21)), 4, SamplingParams(temperature=1.0, seed=1), n=3)
    with pytest.raises(ValueError, match="Overflow"):
        engine.step()
    parent = group.seqs[0]
    assert group.seqs == [parent] and engine.running == [parent] and engine.sequences == [parent]
    check_refcounts(engine.allocator, [parent.kv])     # only the parent's own table holds blocks
    engine.abort_group(group)
    assert engine.allocator.n_free == engine.allocator.n_blocks and not engine.running


def test_the_served_engine_fails_only_the_group_whose_fork_failed(tiny32):
    class FailingFork(ServingEngine):
        def new_member(self, group, parent, index):
            if group.sampling.seed == 99 and index == 2:
                raise ValueError("Overflow when unpacking long long")
            return super().new_member(group, parent, index)

    reference = ServingEngine(tiny32, max_running=8, block_size=4, n_blocks=64)
    engine = FailingFork(tiny32, max_running=8, block_size=4, n_blocks=64)
    for e in (reference, engine):
        e.good = e.add_group(list(range(40, 50)), 6, SamplingParams(temperature=1.0, seed=3), ignore_eos=True, n=2)
        e.bad = e.add_group(list(range(60, 70)), 6, SamplingParams(temperature=1.0, seed=99), ignore_eos=True, n=3)
    run_to_end(reference)
    failures = run_to_end(engine)
    assert [g for f in failures for g in f.failed] == [engine.bad]
    assert [s.output_ids for s in engine.good.seqs] == [s.output_ids for s in reference.good.seqs]
    assert engine.allocator.n_free == engine.allocator.n_blocks and engine.slots_promised == 0


def test_block_ops_are_all_or_nothing():
    alloc = BlockAllocator(8, n_layers=1, n_kv_heads=1, head_dim=2, block_size=4)
    table = BlockTable(4)
    table.append_slots(alloc, 6)                 # 2 blocks, the second half full
    alloc.free(table.block_ids[1])               # the table now lists a block nobody owns: a fork must fail ...
    with pytest.raises(Exception):
        fork(table, alloc)
    assert alloc.refcount(table.block_ids[0]) == 1   # ... and give back the reference it took on block 0
    table.block_ids[1] = alloc.alloc()
    child = fork(table, alloc)                   # the partial last block is now shared
    copies = CopyQueue()
    before = (list(child.block_ids), child.n_filled, alloc.n_free)

    real_alloc = alloc.alloc                     # the copy's block is granted, the next one is not
    calls = iter(range(1000))

    def alloc_once():
        if next(calls) >= 1:
            raise RuntimeError("device error")
        return real_alloc()
    alloc.alloc = alloc_once
    with pytest.raises(RuntimeError):
        append_slots_cow(child, alloc, 6, copies)  # copy-on-write of block 1, then a new block: fails
    alloc.alloc = real_alloc
    assert (list(child.block_ids), child.n_filled, alloc.n_free) == before and len(copies) == 0
    check_refcounts(alloc, [table, child])


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
