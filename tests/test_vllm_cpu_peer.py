"""vllm_cpu_peer without vLLM: our requests become vLLM's, its environment binds the cores, and the worker's
line protocol round-trips through a stand-in worker (the real one needs `make peer-vllm`)."""

import json
import os
import stat

import pytest
import torch

from common.sampling import SamplingParams
from measure.vllm_cpu import MARK, PeerUnavailable, VllmCpu, to_vllm, vllm_env, vllm_model_path
from measure.workload import Request, equal_work


def test_requests_become_vllms_token_prompts_with_the_same_sampling(tiny32):
    reqs = equal_work(tiny32.vocab_size, 3) + [
        Request(prompt="Hi", max_new_tokens=5, sampling=SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=4))]
    sent = to_vllm(reqs, tiny32)
    assert [s["prompt_token_ids"] for s in sent[:3]] == [r.prompt_ids for r in reqs[:3]]
    assert all(s["max_tokens"] == 64 and s["ignore_eos"] and s["temperature"] == 0.0 for s in sent[:3])
    assert sent[3]["prompt_token_ids"] == tiny32.prompt_ids("Hi")      # a text prompt goes through the template
    assert (sent[3]["temperature"], sent[3]["top_k"], sent[3]["top_p"], sent[3]["seed"]) == (0.7, 20, 0.9, 4)
    json.dumps(sent)                                                    # it crosses a pipe as JSON
    with pytest.raises(ValueError, match="n=1"):
        to_vllm([Request(prompt_ids=[1, 2], n=2)], tiny32)


def test_vllm_computes_on_the_given_cores_and_keeps_none_back():
    env = vllm_env([0, 1], base={"PATH": "/bin"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert int(env["VLLM_CPU_KVCACHE_SPACE"]) > 0 and env["PATH"] == "/bin"


def test_models_vllm_cannot_load_and_a_missing_venv_are_refused_clearly(tmp_path):
    for name in ("tiny", "dummy:qwen3-0.6b"):
        with pytest.raises(PeerUnavailable, match="real model files"):
            vllm_model_path(name)
    with pytest.raises(PeerUnavailable, match="make peer-vllm"):
        VllmCpu("m", torch.bfloat16, [0], 4, python=tmp_path / "missing" / "python")


FAKE = f"""#!{os.sys.executable}
import json, sys
settings = json.loads(sys.argv[2])
print("INFO vLLM-like log line", flush=True)
print({MARK!r} + json.dumps({{"ready": True, "vllm": "fake", "load_s": 0.0, "got": settings}}), flush=True)
for line in sys.stdin:
    ask = json.loads(line)
    if ask.get("stop"):
        break
    outs = [[7] * r["max_tokens"] for r in ask["requests"]]
    print({MARK!r} + json.dumps({{"wall_s": 0.5, "tokens": sum(map(len, outs)), "outputs": outs}}), flush=True)
"""


def test_the_worker_protocol_round_trips_through_a_stand_in(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(FAKE)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    with VllmCpu("/models/x", torch.bfloat16, [0, 1], 8, python=fake) as peer:
        assert peer.ready["got"] == {"model": "/models/x", "dtype": "bfloat16", "max_num_seqs": 8}
        out = peer.run([{"max_tokens": 3}, {"max_tokens": 2}])
        assert out["outputs"] == [[7, 7, 7], [7, 7]] and out["tokens"] == 5
    assert peer.proc.poll() == 0


def test_a_silent_worker_is_refused_after_its_timeout(tmp_path, monkeypatch):
    import measure.vllm_cpu as peer_module

    silent = tmp_path / "python"
    silent.write_text(f"#!{os.sys.executable}\nimport time\nprint('loading', flush=True)\ntime.sleep(60)\n")
    silent.chmod(silent.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(peer_module, "READY_TIMEOUT_S", 1)
    with pytest.raises(PeerUnavailable, match="did not answer within 1 s; its last lines:\nloading"):
        VllmCpu("m", torch.bfloat16, [0], 4, python=silent)
