"""`StaticDecodeEngine`: phase 3.8's engine whose decode steps run over static buffers, replayed as CUDA graphs.

It picks `StaticRunner` (runner.py) and `DeviceSampler` (common/sampling.py), and `emit` hands the ids sampled
after a static step to the runner's buffers: the next step's input ids, with no trip through the host.
"""

from __future__ import annotations

import torch

from common.sampling import DeviceSampler
from phases.p2_2_scheduler.sequence import Sequence, StepOutput
from phases.p3_8_chunked_prefill.engine import ChunkedPrefillEngine
from phases.p3_10_cuda_graphs.runner import StaleGraphs, StaticRunner, decode_buckets

__all__ = ["StaticDecodeEngine", "StaleGraphs", "decode_buckets"]


class StaticDecodeEngine(ChunkedPrefillEngine):
    """Phase 3.8's engine with the static decode runner and the device sampler."""

    def __init__(self, lm, *args, cuda_graphs: bool | None = None, buckets: list[int] | None = None,
                 cpu_step: bool | None = None, **kwargs):
        self.cuda_graphs, self.buckets, self.cpu_step = cuda_graphs, buckets, cpu_step   # read by make_runner
        super().__init__(lm, *args, **kwargs)

    def make_sampler(self) -> DeviceSampler:
        return DeviceSampler(self.lm.device)

    def make_runner(self) -> StaticRunner:
        return StaticRunner(self.lm, self.allocator, self.max_running, self.cuda_graphs, self.buckets, self.cpu_step)

    def emit(self, seqs: list[Sequence], logits: torch.Tensor) -> list[StepOutput]:
        """After a mixed pass, phase 3.6's emit (those rows are sent whole at the next static step anyway)."""
        if not self.runner.ran_static:
            return super().emit(seqs, logits)
        ids = self.sampler.draw(seqs, logits)                   # [S] int64, on the device
        tokens = ids.tolist()                                   # the step's one host transfer
        self.runner.buffers.record_sampled(seqs, ids, tokens)
        return self.update(seqs, tokens)
