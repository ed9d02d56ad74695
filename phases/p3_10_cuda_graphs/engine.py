"""`StaticDecodeEngine`: phase 3.8's engine whose decode steps run over static buffers, replayed as CUDA graphs.

Every scheduling decision is phase 3.8's. The engine picks two parts, `StaticRunner` (runner.py) and
`DeviceSampler` (common/sampling.py: the whole batch sampled on the device, one host transfer, draws keyed on
(seed, output index)), and hands one's output to the other in `emit`: the ids sampled after a static step
become the next step's input ids on the device, without a round trip through the host.
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

    def __init__(self, lm, *args, cuda_graphs: bool | None = None, buckets: list[int] | None = None, **kwargs):
        self.cuda_graphs, self.buckets = cuda_graphs, buckets   # read by make_runner, during 3.6's constructor
        super().__init__(lm, *args, **kwargs)

    def make_sampler(self) -> DeviceSampler:
        return DeviceSampler(self.lm.device)

    def make_runner(self) -> StaticRunner:
        return StaticRunner(self.lm, self.allocator, self.max_running, self.cuda_graphs, self.buckets)

    def emit(self, seqs: list[Sequence], logits: torch.Tensor) -> list[StepOutput]:
        """After a static step, the ids are drawn on the device and handed to the runner's buffers: ids[i], seqs[i]'s,
        becomes the next input id of seqs[i]'s row. After a mixed pass, phase 3.6's emit: the rows of those
        sequences are stale anyway (their lengths moved on the host), and the next static step sends them whole."""
        if not self.runner.ran_static:
            return super().emit(seqs, logits)
        ids = self.sampler.draw(seqs, logits)                   # [S] int64, on the device
        tokens = ids.tolist()                                   # the step's one host transfer
        self.runner.buffers.record_sampled(seqs, ids, tokens)
        return self.update(seqs, tokens)
