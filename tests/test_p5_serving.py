"""Phase 5: the OpenAI-compatible server, driven by the official `openai` client over real HTTP.

Servers run in-process (uvicorn in a thread) on a free 127.0.0.1 port. Every
client call has a timeout and every wait a deadline, so nothing here can hang.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from measure.background_server import BackgroundServer
from phases.p5_1_served_engine.engine import ServingEngine
from phases.p5_6_http_server.server import create_app
from tests.oracles import hf_greedy

CLIENT_TIMEOUT_S = 30
IDLE_TIMEOUT_S = 10
ASYNC_TEST_TIMEOUT_S = 60
POLL_S = 0.02
PROMPT = "The capital of France is"


def client(srv, **kw) -> openai.OpenAI:
    # max_retries=0: the client must see a 503 rather than quietly retry it.
    return openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S, **kw)


def health(srv) -> dict:
    return httpx.get(srv.url + "/health", timeout=CLIENT_TIMEOUT_S, trust_env=False).json()


def wait_idle(srv) -> dict:
    """Poll /health until nothing runs or waits and every block is free again; fail after a deadline."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        h = health(srv)
        if h["running"] == 0 and h["waiting"] == 0 and h["free_blocks"] == h["total_blocks"]:
            return h
        assert time.monotonic() < deadline, f"server not idle after {IDLE_TIMEOUT_S} s: {h}"
        time.sleep(POLL_S)


def post(srv, path: str, content: bytes) -> httpx.Response:
    return httpx.post(srv.url + path, content=content, headers={"content-type": "application/json"},
                      timeout=CLIENT_TIMEOUT_S, trust_env=False)


class RecordingEngine(ServingEngine):
    """Remembers every abort of a sequence that was running, and how far it had got."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.aborted_running: list[tuple[int, int]] = []

    def abort(self, seq):
        if seq in self.running:
            self.aborted_running.append((seq.seq_id, len(seq.output_ids)))
        super().abort(seq)


@pytest.fixture(scope="module")
def tiny_srv(tiny32):
    app = create_app(tiny32, engine=RecordingEngine(tiny32, max_running=8, block_size=16, n_blocks=256), max_waiting=32)
    with BackgroundServer(app) as srv:
        srv.app = app
        yield srv


@pytest.fixture
def tiny_idle(tiny_srv):
    """The tiny server with nothing in flight (tests compute HF references on the same model object)."""
    wait_idle(tiny_srv)
    yield tiny_srv
    wait_idle(tiny_srv)


# --- detokenization and stop strings (no server) ------------------------------------------------
# --- the HTTP API on the tiny model --------------------------------------------------------
def test_models_and_health(tiny_idle):
    models = client(tiny_idle).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    h = health(tiny_idle)
    assert h["status"] == "ok" and h["total_blocks"] == 256 and h["free_blocks"] == 256


def test_completion_equals_hf_greedy_and_streamed_text_equals_plain(tiny_idle, tiny32):
    c = client(tiny_idle)
    ids = tiny32.prompt_ids(PROMPT, chat=False)
    expected = tiny32.decode(hf_greedy(tiny32, ids, 12, ignore_eos=True))
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    plain = c.completions.create(**kw)
    assert plain.choices[0].text == expected and plain.choices[0].finish_reason == "length"
    assert (plain.usage.prompt_tokens, plain.usage.completion_tokens, plain.usage.total_tokens) == (len(ids), 12, len(ids) + 12)
    chunks = list(c.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == plain.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_completion_plain_and_streamed(tiny_idle, tiny32):
    c = client(tiny_idle)
    messages = [{"role": "user", "content": "Name one fruit."}]
    kw = dict(model="tiny", messages=messages, max_tokens=10, temperature=0)
    plain = c.chat.completions.create(**kw)
    text = tiny32.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert plain.usage.prompt_tokens == len(tiny32.tokenizer(text, add_special_tokens=False)["input_ids"])
    assert plain.choices[0].message.role == "assistant"
    chunks = list(c.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == plain.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason


def test_n_samples_seeded_and_streamed(tiny_idle):
    c = client(tiny_idle)
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, n=3,
              extra_body={"ignore_eos": True})
    a = c.completions.create(**kw)
    b = c.completions.create(**kw)
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]  # a seed makes it reproducible
    assert len({ch.text for ch in a.choices}) > 1                            # ... and the samples differ
    assert a.usage.completion_tokens == 3 * 8
    streamed = {0: "", 1: "", 2: ""}
    for ch in c.completions.create(**kw, stream=True):
        for choice in ch.choices:
            streamed[choice.index] += choice.text
    assert list(streamed.values()) == [ch.text for ch in a.choices]


def test_n_samples_share_the_prompt_blocks(tiny_idle):
    engine = tiny_idle.app.state.engine.engine
    copied = engine.n_copied
    r = client(tiny_idle).completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=1.0, n=4,
                                             extra_body={"ignore_eos": True})
    assert len(r.choices) == 4
    # One prefill, then the prompt's last (partly filled) block is copied on its first write by
    # 3 of the 4 samples; the 4th writes in place. Independent sequences would copy nothing.
    assert engine.n_copied - copied == 3
    assert not engine.groups  # the finished request is forgotten: a long-running server keeps no records
    with pytest.raises(openai.BadRequestError, match="max_running"):
        client(tiny_idle).completions.create(model="tiny", prompt=PROMPT, max_tokens=4, n=9)


def test_stop_string_ends_the_sequence_early(tiny_idle):
    c = client(tiny_idle)
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = c.completions.create(**kw).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = full[:full.index(stop)]
    plain = c.completions.create(**kw, stop=[stop])
    assert plain.choices[0].text == cut and plain.choices[0].finish_reason == "stop"
    assert plain.usage.completion_tokens < 16
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(**kw, stop=stop, stream=True))
    assert streamed == cut


def test_invalid_requests_get_openai_error_bodies(tiny_idle):
    c = client(tiny_idle)
    cases = [
        (b"{not json", None),
        (b'{"model": "tiny"}', "prompt"),
        (b'{"model": "tiny", "prompt": "hi", "temperature": 3}', "temperature"),
        (b'{"model": "tiny", "prompt": "hi", "max_tokens": 0}', "max_tokens"),
        (b'{"model": "tiny", "prompt": "hi", "n": 0}', "n"),
        (b'{"model": "tiny", "prompt": "hi", "top_p": 0}', "top_p"),
        (b'{"model": "tiny", "prompt": ""}', "prompt"),
        (b'{"model": "tiny", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}', "stop"),
        (b'{"model": "tiny", "messages": []}', "messages"),
    ]
    for body, param in cases:
        path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        r = post(tiny_idle, path, body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
        assert err["param"] == param and err["message"], (body, err)
    with pytest.raises(openai.BadRequestError) as e:  # longer than the tiny model's 2048-token context
        c.completions.create(model="tiny", prompt="hello " * 2100, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny", prompt="hi", max_tokens=2048)
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_many_streams_with_disconnects_all_blocks_come_back(tiny_idle, tiny32):
    engine = tiny_idle.app.state.engine.engine
    n_streams, quitters, max_tokens, long_tokens = 12, {1, 4, 7, 10}, 24, 1500
    prompts = [f"Request number {i} says" for i in range(n_streams)]
    expected = {i: tiny32.decode(hf_greedy(tiny32, tiny32.prompt_ids(p, chat=False), max_tokens, ignore_eos=True))
                for i, p in enumerate(prompts) if i not in quitters}
    aborted_before = len(engine.aborted_running)

    async def one(ac, i):
        # quitters ask for far more tokens than they will read: only an abort frees their blocks soon
        stream = await ac.completions.create(model="tiny", prompt=prompts[i], temperature=0, stream=True,
                                             max_tokens=long_tokens if i in quitters else max_tokens,
                                             extra_body={"ignore_eos": True})
        text, n_chunks = "", 0
        async for ch in stream:
            text += ch.choices[0].text
            n_chunks += 1
            if i in quitters and n_chunks == 3:
                await stream.close()  # the client goes away mid-stream
                return i, None
        return i, text

    async def main():
        async with openai.AsyncOpenAI(base_url=tiny_idle.base_url, api_key="unused", max_retries=0,
                                      timeout=CLIENT_TIMEOUT_S) as ac:
            return await asyncio.wait_for(asyncio.gather(*(one(ac, i) for i in range(n_streams))),
                                          ASYNC_TEST_TIMEOUT_S)

    results = dict(asyncio.run(main()))
    for i, text in expected.items():
        assert results[i] == text, i
    h = wait_idle(tiny_idle)  # the quitters' 1500-token runs were aborted, not finished
    assert h["free_blocks"] == h["total_blocks"] == 256
    aborted = engine.aborted_running[aborted_before:]
    assert len(aborted) == len(quitters) and all(n_out < long_tokens for _, n_out in aborted)


def test_engine_thread_sleeps_when_idle(tiny_idle):
    engine = tiny_idle.app.state.engine.engine
    before = engine.n_steps
    time.sleep(0.3)
    assert engine.n_steps == before  # no request: no step, no spinning


# --- a full waiting line gets 503; a request bigger than the pool gets 400 -----------------
def test_full_queue_gets_503_and_pool_limits_get_400(tiny32):
    # one running slot, one waiting place, a pool of 100 blocks x 16 = 1600 tokens
    app = create_app(tiny32, max_running=1, max_waiting=1, block_size=16, n_blocks=100)
    with BackgroundServer(app) as srv:
        c = client(srv)
        kw = dict(model="tiny", prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
        with pytest.raises(openai.BadRequestError, match="pool"):
            c.completions.create(**kw, max_tokens=1700)  # fits the context (2048), not the pool
        running = c.completions.create(**kw, max_tokens=1500, stream=True)
        next(iter(running))                               # it has a token: it holds the only slot
        waiting = c.completions.create(**kw, max_tokens=4, stream=True)  # accepted, waits for the slot
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(**kw, max_tokens=4)
        assert e.value.status_code == 503 and e.value.body["code"] == "queue_full"
        assert e.value.response.headers.get("retry-after")
        running.close()                                   # frees the slot: the waiting one runs
        assert "".join(ch.choices[0].text for ch in waiting)  # ... and finishes
        c.completions.create(**kw, max_tokens=4)          # the line is open again
        wait_idle(srv)


class FailingEngine(ServingEngine):
    """Raises inside the next forward pass when told to (after admission took blocks), as a CUDA error would."""
    fail_next = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        run = self.runner.run

        def failing(batch):
            if self.fail_next:
                self.fail_next = False
                raise RuntimeError("injected failure")
            return run(batch)
        self.runner.run = failing


def test_a_failing_step_fails_its_requests_not_the_server(tiny32):
    engine = FailingEngine(tiny32, max_running=4, block_size=16, n_blocks=64)
    with BackgroundServer(create_app(tiny32, engine=engine)) as srv:
        c = client(srv)
        kw = dict(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
        engine.fail_next = True
        with pytest.raises(openai.InternalServerError, match="injected failure"):
            c.completions.create(**kw)
        engine.fail_next = True
        with pytest.raises(openai.APIError, match="injected failure"):  # an error event inside the stream
            list(c.completions.create(**kw, stream=True))
        assert c.completions.create(**kw).choices[0].finish_reason == "length"  # the server carries on
        wait_idle(srv)


# --- the packaged model: real text, EOS ends the answer -----------------------------------
def test_packaged_model_chat_equals_hf_greedy(smol32):
    app = create_app(smol32, max_running=4, n_blocks=64)
    with BackgroundServer(app) as srv:
        c = client(srv)
        q = "What is the capital of France?"
        messages = [{"role": "user", "content": q}]
        tok = smol32.tokenizer
        ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                  add_special_tokens=False)["input_ids"]
        expected = smol32.decode(hf_greedy(smol32, ids, 20))
        plain = c.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=20, temperature=0)
        assert plain.choices[0].message.content == expected and "Paris" in expected
        assert plain.choices[0].finish_reason == "stop"  # the model ended its answer with EOS
        streamed = "".join(ch.choices[0].delta.content or "" for ch in
                           c.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=20,
                                                     temperature=0, stream=True))
        assert streamed == expected
        wait_idle(srv)


def test_packaged_model_served_with_speculation_equals_hf_greedy(smol32):
    """`--speculative ngram`: the served answer is the plain greedy answer, made in fewer steps."""
    from phases.p5_6_http_server.launch import build_parser
    args = build_parser().parse_args(["--speculative", "ngram", "--num-speculative-tokens", "3"])
    app = create_app(smol32, max_running=4, n_blocks=64, speculative=args.speculative,
                     num_speculative_tokens=args.num_speculative_tokens)
    engine = app.state.engine.engine
    assert engine.proposer.name == "ngram" and engine.num_speculative_tokens == 3
    q = "Repeat this line three times: one two three four five."
    messages = [{"role": "user", "content": q}]
    ids = smol32.prompt_ids(q)
    with BackgroundServer(app) as srv:
        got = client(srv).chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=32,
                                                  temperature=0)
        wait_idle(srv)
    assert got.choices[0].message.content == smol32.decode(hf_greedy(smol32, ids, 32))
    assert engine.spec_stats.accepted > 0 and engine.n_steps < got.usage.completion_tokens
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--speculative", "eagle"])


# --- the demo, and the commands ---------------------------------------------------------
def test_bench_serve_quick_runs():
    from measure.cli import run_demo
    report = run_demo("bench_serve", model="tiny", device="cpu", dtype="fp32", quick=True)
    (row,) = report.tables[0].rows
    assert row[1] == "3/3" and report.data["output_tok_per_s"][0] > 0


def test_the_server_serves_the_last_engine_with_its_flags(tiny32):
    from phases.p4_4_preemption.engine import PreemptingEngine
    from phases.p5_6_http_server.launch import build_parser
    engine = create_app(tiny32, n_blocks=8).state.engine.engine
    assert isinstance(engine, PreemptingEngine) and engine.prefix_caching and engine.preemption_mode == "recompute"
    args = build_parser().parse_args(["--no-prefix-caching", "--preemption-mode", "swap"])
    assert (args.no_prefix_caching, args.preemption_mode) == (True, "swap")
    assert build_parser().parse_args([]).no_prefix_caching is False
    engine = create_app(tiny32, n_blocks=8, prefix_caching=False, preemption_mode="swap").state.engine.engine
    assert not engine.prefix_caching and engine.swap_space.cpu is not None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--preemption-mode", "drop"])


def test_serve_command_is_wired():
    from measure.cli import main
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    import modal_run
    assert modal_run.serve_api._is_web_endpoint()  # `modal serve modal_run.py` serves it


@pytest.mark.notebook("10_serving.ipynb")
def test_notebook_runs():
    import re
    from tests.nbrun import run_notebook
    nb = run_notebook("10_serving.ipynb")
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "Paris" in text and "streamed text == non-streamed text: True" in text
    assert "same answer alone: True" in text
    assert int(re.search(r"most sequences in one pass: (\d+)", text).group(1)) >= 2   # the requests were batched
    assert "uvicorn thread alive: False | engine thread alive: False" in text and "after shutdown: ConnectError" in text
