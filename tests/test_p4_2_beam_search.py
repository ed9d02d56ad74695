"""Beam search over shared blocks: the best sequence equals HF generate(num_beams=k, do_sample=False),
beams fork and free blocks every step with refcounts always right, and nothing leaks."""

import pytest
import torch

from common.sampling import SamplingParams
from phases.p4_1_copy_on_write.block_ops import check_refcounts
from phases.p4_2_beam_search.beam import BeamSearch
from phases.p4_2_beam_search.engine import BeamSearchEngine
from tests.oracles import hf_greedy

MAX_NEW = 12
# the best beam of the first ends with EOS inside 12 tokens, the second's runs to the cap
PACKAGED_PROMPTS = ["Name one fruit.", "What is 2 + 2?"]


@torch.inference_mode()
def hf_beam(lm, prompt_ids, k, max_new_tokens, **kwargs) -> list[int]:
    # A dummy model has no EOS (its text is noise): HF's beam search then takes its config's own (an empty
    # list makes it fail), which random weights almost never produce in a few tokens.
    ids = torch.tensor([prompt_ids], device=lm.device)
    out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=k, do_sample=False,
                            max_new_tokens=max_new_tokens, eos_token_id=sorted(lm.eos_token_ids) or None,
                            pad_token_id=lm.pad_token_id, **kwargs)
    return out[0, len(prompt_ids):].tolist()


def _run_checked(engine):
    """Run to the end, checking after every step that refcounts equal the number of tables holding each block."""
    while engine.has_work:
        engine.step()
        check_refcounts(engine.allocator, [s.kv for s in engine.running])
    assert engine.allocator.n_free == engine.allocator.n_blocks


@pytest.mark.parametrize("k", [2, 3])
def test_best_beam_equals_hf_packaged_model(smol32, k):
    engine = BeamSearchEngine(smol32, block_size=16, n_blocks=128)
    groups = [engine.add_beam_search(p, MAX_NEW, beam_width=k) for p in PACKAGED_PROMPTS]
    _run_checked(engine)
    for g in groups:
        assert g.best == hf_beam(smol32, g.prompt_ids, k, MAX_NEW), (k, g.prompt)
    assert any(g.hypotheses[0].finish_reason == "eos" for g in groups)  # the EOS path was exercised


@pytest.mark.parametrize("k,kwargs", [(2, {}), (3, dict(early_stopping=True)), (3, dict(length_penalty=0.5)),
                                      (2, dict(early_stopping="never", length_penalty=2.0))])
def test_best_beam_equals_hf_tiny_model_small_blocks(tiny32, k, kwargs):
    engine = BeamSearchEngine(tiny32, block_size=4, n_blocks=256)
    gen = torch.Generator().manual_seed(k)
    prompts = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in (3, 13)]
    groups = [engine.add_beam_search(p, MAX_NEW, beam_width=k, **kwargs) for p in prompts]
    _run_checked(engine)
    for g in groups:
        assert g.best == hf_beam(tiny32, g.prompt_ids, k, MAX_NEW, **kwargs)
    assert engine.n_copied > 0  # beams that shared a partial block copied it before writing


def test_beams_share_history_and_free_pruned_blocks_every_step(tiny32):
    engine = BeamSearchEngine(tiny32, block_size=2, n_blocks=128)
    group = engine.add_beam_search(list(range(300, 305)), 10, beam_width=4)
    engine.step()                                   # prefill once, then 4 beams forked from the prompt
    assert engine.n_forward_passes == 1 and len(group.seqs) == 4
    assert all(s.kv.block_ids == group.seqs[0].kv.block_ids for s in group.seqs)
    shared_ever, freed_ever = False, False
    while not group.done:
        before = {b for s in group.seqs for b in s.kv.block_ids}
        engine.step()
        if group.done:
            break
        tables = [s.kv for s in group.seqs]
        held = {b for t in tables for b in t.block_ids}
        shared_ever |= any(engine.allocator.refcount(b) > 1 for b in held - set(tables[0].block_ids[:2]))
        freed_ever |= any(engine.allocator.refcount(b) == 0 for b in before - held)
        assert engine.allocator.n_used == len(held)   # a block no beam holds is free at once
    assert shared_ever and freed_ever               # generated blocks were shared, pruned ones freed
    assert engine.allocator.n_free == engine.allocator.n_blocks
    assert [s.output_ids for s in group.seqs] == [h.token_ids for h in group.hypotheses]


def test_beams_ride_in_the_same_batch_as_samples_and_plain_requests(tiny32):
    prompt = list(range(500, 509))
    alone = BeamSearchEngine(tiny32, block_size=4, n_blocks=128)
    solo = alone.add_beam_search(prompt, 8, beam_width=3)
    alone.run()
    engine = BeamSearchEngine(tiny32, max_running=16, block_size=4, n_blocks=256)
    beams = engine.add_beam_search(prompt, 8, beam_width=3)
    other = engine.add_beam_search(list(range(700, 706)), 8, beam_width=2)
    plain = engine.add(list(range(900, 911)), 8, ignore_eos=True)
    samples = engine.add_group(list(range(900, 911)), 8, SamplingParams(temperature=0.9, seed=3), ignore_eos=True,
                               n=2)
    _run_checked(engine)
    assert engine.n_forward_passes == engine.n_steps  # one pass per step: all of them decode together
    assert beams.best == solo.best and other.done and samples.done
    assert plain.output_ids == hf_greedy(tiny32, plain.prompt_ids, 8, ignore_eos=True)


def test_beam_search_refuses_bad_input(tiny32):
    engine = BeamSearchEngine(tiny32, max_running=4, block_size=4, n_blocks=16)
    with pytest.raises(ValueError, match="beam width"):
        engine.add_beam_search([5, 6], 4, beam_width=0)
    with pytest.raises(ValueError, match="max_running"):
        engine.add_beam_search([5, 6], 4, beam_width=5)
    with pytest.raises(ValueError, match="whole pool"):
        engine.add_beam_search([5, 6], 30, beam_width=4)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearch(2, 4, {2}, early_stopping="sometimes")
    assert not engine.has_work


def test_scores_meet_the_logits_on_their_device_and_only_the_candidates_come_back():
    """The H100 failure ("Expected all tensors to be on the same device, cuda:0 and cpu") without a GPU:
    under FakeTensorMode a tensor has a shape and a device but no data, and ops still check devices."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    search = BeamSearch(3, 8, {2})
    search.running_scores, search.running_tokens = torch.tensor([-0.5, -1.0, -2.0]), [[5], [6], [7]]
    with FakeTensorMode(allow_non_fake_inputs=True):
        scores, index = search._top_candidates(torch.empty(3, 100, device="cuda"))  # logits on "cuda"
    assert scores.device.type == index.device.type == "cpu"
    assert scores.shape == index.shape == (search.n_candidates,)
    assert search.running_scores.device.type == "cpu"


def test_share_demo_runs_quick():
    from measure.cli import run_demo
    report = run_demo("share_demo", model="tiny", device="cpu", dtype="fp32", quick=True)
    runs = report.data["runs"]
    assert [r["method"] for r in runs] == ["parallel sampling", "beam search"]
    assert all(0 < r["saving"] < 1 and len(r["held"]) == r["decode_passes"] for r in runs)


@pytest.mark.notebook("07_sharing.ipynb")
def test_notebook_runs():
    from tests.nbrun import run_notebook
    run_notebook("07_sharing.ipynb")
