"""Phase 5 over phase 4.7's workers: `--tensor-parallel-size`, /health and /metrics naming the workers, and a
killed worker failing the request in flight and turning the server unhealthy, with nothing left behind."""

import multiprocessing
import os
import signal
import time

import httpx
import openai
import pytest

from phases.p4_7_tensor_parallel import launch
from phases.p5_1_served_engine.engine import ServingEngine
from measure.background_server import BackgroundServer
from phases.p5_6_http_server.launch import main
from phases.p5_6_http_server.server import create_app
from tests.test_p4_7_tensor_parallel import run_recorded, trace_with_everything


def test_the_served_engine_on_two_workers_keeps_one_workers_tokens_and_schedule(tiny32):
    trace = trace_with_everything(tiny32.vocab_size)
    kwargs = dict(cuda_graphs=False, block_size=4, n_blocks=26, max_num_batched_tokens=16, speculative="ngram")
    one = run_recorded(ServingEngine(tiny32, **kwargs), trace)
    group, lm = launch("tiny", 2, device="cpu", dtype="fp32")
    try:
        engine = ServingEngine(lm, group=group, **kwargs)
        assert run_recorded(engine, trace) == one
        assert engine.stats.n_preemptions >= 1 and engine.cache_stats.blocks_hit >= 1 and engine.n_copied >= 1
    finally:
        group.close()
def test_the_server_streams_over_two_workers_and_turns_unhealthy_when_one_dies(tiny32):
    def complete(srv, **kw):
        c = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=30)
        return c.completions.create(model="tiny", prompt="The capital of France is", temperature=0, **kw)

    with BackgroundServer(create_app(tiny32, n_blocks=128)) as srv:
        expected = complete(srv, max_tokens=12).choices[0].text
    group, lm = launch("tiny", 2, device="cpu", dtype="fp32")
    try:
        with BackgroundServer(create_app(lm, n_blocks=128, tensor_parallel=group)) as srv:
            assert complete(srv, max_tokens=12).choices[0].text == expected
            assert "".join(c.choices[0].text for c in complete(srv, max_tokens=12, stream=True)) == expected
            health = httpx.get(srv.url + "/health", timeout=30, trust_env=False)
            assert health.status_code == 200 and health.json()["tensor_parallel"]["alive"] == [True, True]
            metrics = httpx.get(srv.url + "/metrics", timeout=30, trust_env=False).text
            assert "engine_tensor_parallel_workers_alive 2.0" in metrics

            stream = complete(srv, max_tokens=2000, stream=True, extra_body={"ignore_eos": True})
            next(iter(stream))                                      # a request in flight
            os.kill(group.processes[0].pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(Exception, match="rank 1|worker"):
                for _ in stream:
                    pass
            assert time.monotonic() - start < 30
            health = httpx.get(srv.url + "/health", timeout=30, trust_env=False)
            assert health.status_code == 503 and health.json()["status"] == "unhealthy"
            assert "rank 1" in health.json()["tensor_parallel"]["error"]
            with pytest.raises(openai.APIStatusError, match="rank 1"):
                complete(srv, max_tokens=4)
    finally:
        group.close()
    assert multiprocessing.active_children() == []


def test_serve_refuses_a_bad_size_before_loading_anything(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "tiny", "--tensor-parallel-size", "0"])
    assert exit_.value.code == 2 and "--tensor-parallel-size must be >= 1" in capsys.readouterr().err
    assert multiprocessing.active_children() == []

