"""The cut model: on 2 workers (gloo, on this CPU) its logits equal the whole model's in fp32, and phase 0's loop
on it makes HF generate's tokens, heads split evenly or 2 + 1; bad sizes are refused before any worker starts,
and no worker outlives its driver."""

import multiprocessing
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from measure.collectives import count_collectives
from phases.p0_generate.generate import generate_ids
from phases.p4_6_model_sharding import ShardedModel, UnsupportedTensorParallel, launch, split
from phases.p4_6_model_sharding import lockstep
from tests.oracles import hf_greedy

LOGITS_ATOL = 1e-4      # fp32: a row-parallel sum adds the same terms in another order


# --- no worker started ------------------------------------------------------------------------------
def test_split_cuts_contiguous_ranges_that_cover_everything():
    assert split(3, 2) == [(0, 2), (2, 3)]
    assert split(8, 2) == [(0, 4), (4, 8)]
    for n in range(1, 12):
        for parts in range(1, n + 1):
            cut = split(n, parts)
            assert cut[0][0] == 0 and cut[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(cut, cut[1:]))
            assert max(hi - lo for lo, hi in cut) - min(hi - lo for lo, hi in cut) <= 1


@pytest.mark.parametrize("size", [0, -1, 3, True, 1.5, "2"])
def test_bad_sizes_are_refused_before_any_worker_starts(size):
    before = multiprocessing.active_children()
    with pytest.raises(UnsupportedTensorParallel, match="tensor_parallel_size"):
        launch("tiny", size, dtype="fp32")        # tiny has 2 KV heads: 3 workers would leave one with none
    assert multiprocessing.active_children() == before
    assert not dist.is_initialized()


def test_a_world_larger_than_the_gpus_is_refused_and_more_than_the_cores_warned(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="one GPU per worker; torch sees 1"):
        lockstep.check_launch(2, 8, "cuda")
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with pytest.warns(UserWarning, match="3 on 2 CPU cores"):
        lockstep.check_launch(3, 3, "cpu")


# --- two workers: tiny (GQA 4:2, one KV head each) and the packaged model (3 KV heads cut 2 + 1) --------------
@pytest.mark.parametrize("name, whole_fixture, heads",
                         [("tiny", "tiny32", (2, 1)), ("smollm2-135m", "smol32", (6, 2))], ids=["tiny", "smollm2-135m"])
def test_the_cut_models_logits_equal_the_whole_models_and_phase_0_runs_on_it(request, name, whole_fixture, heads):
    whole = request.getfixturevalue(whole_fixture)
    ids = torch.tensor([list(range(30, 47)), list(range(60, 77))])               # [2, 17]
    with torch.inference_mode():
        expected = whole.model(input_ids=ids, use_cache=False).logits             # [2, 17, V]
    group, lm = launch(name, 2, device="cpu", dtype="fp32")
    try:
        assert isinstance(lm.model, ShardedModel) and (lm.n_heads, lm.n_kv_heads) == heads
        assert group.held[0]["n_kv_heads"] + group.held[1]["n_kv_heads"] == whole.n_kv_heads
        assert group.held[0]["param_bytes"] < 0.75 * sum(p.numel() * 4 for p in whole.model.parameters())
        stats = count_collectives(group.comm)
        with torch.inference_mode():
            got = lm.model(input_ids=ids).logits
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=LOGITS_ATOL, rtol=0)
        n_ar = stats.n_all_reduce
        assert n_ar == 2 * whole.n_layers + 1                                   # two a layer, one for the embedding
        prompt = ids[0].tolist()
        assert generate_ids(lm, prompt, 8, ignore_eos=True).output_ids == hf_greedy(whole, prompt, 8, True)
        assert group.alive() == [True, True]
    finally:
        group.close()
    assert multiprocessing.active_children() == [] and not dist.is_initialized()


DRIVER = """
import sys, time
from phases.p4_6_model_sharding import launch
group, lm = launch("tiny", 2, device="cpu", dtype="fp32")
print(group.processes[0].pid, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL])
def test_no_worker_outlives_a_driver_stopped_by_ctrl_c_or_killed(how):
    import subprocess
    import sys

    driver = subprocess.Popen([sys.executable, "-c", DRIVER], cwd=os.path.dirname(os.path.dirname(__file__)),
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        worker = int(driver.stdout.readline())
        os.kill(driver.pid, how)
        driver.wait(30)
        deadline = time.monotonic() + 30
        while pid_alive(worker):
            assert time.monotonic() < deadline, f"worker {worker} outlived its driver"
            time.sleep(0.1)
    finally:
        driver.kill()


def pid_alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, dead but not yet reaped by init, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False

