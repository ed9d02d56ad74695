"""Phase 4.7 on the tier's device: NCCL on CUDA (one GPU per worker; on a machine with one GPU the group has one
rank, so NCCL still runs every collective), gloo with ENGINE_TEST_DEVICE=cpu. The group's tokens equal one
worker's, in fp32 with TF32 off."""

import pytest
import torch

from phases.p4_5_speculative_decoding.engine import SpeculativeEngine
from phases.p4_7_tensor_parallel import TensorParallelEngine, launch
from common.processes import backend_for
from measure.collectives import count_collectives

pytestmark = pytest.mark.gpu


def world_for(device: str) -> int:
    return 2 if torch.device(device).type == "cpu" else min(2, torch.cuda.device_count())


@pytest.mark.parametrize("name", ["tiny", "dummy:qwen3-0.6b"])
def test_a_group_on_the_device_makes_one_workers_tokens(gpu_device, tier_models, name):
    one_lm = tier_models(name)
    prompts = [list(range(100 + 7 * i, 100 + 7 * i + 5 + 3 * i)) for i in range(4)]

    def run(engine):
        seqs = [engine.add(p, 8, ignore_eos=True) for p in prompts]
        engine.run()
        return [s.output_ids for s in seqs]

    expected = run(SpeculativeEngine(one_lm, cuda_graphs=False, n_blocks=64, max_num_batched_tokens=16))
    world = world_for(gpu_device)
    group, lm = launch(name, world, device=gpu_device, dtype=torch.float32)
    try:
        assert group.comm is not None and backend_for(lm.device) == ("gloo" if gpu_device == "cpu" else "nccl")
        stats = count_collectives(group.comm)
        engine = TensorParallelEngine(lm, group, n_blocks=64, max_num_batched_tokens=16)
        assert run(engine) == expected
        assert stats.n_all_reduce == lm.model.n_passes * (2 * lm.n_layers + 1)
    finally:
        group.close()
