"""`StaticDecodeEngine`: phase 3.8's engine whose decode steps run over static buffers, replayed as CUDA graphs.

Every scheduling decision is phase 3.8's. This phase refines two parts:

the runner   `StaticRunner` (runner.py): a decode-only step runs over static
             buffers, padded to a bucket, replayed as a CUDA graph on CUDA (run
             eagerly on a CPU); steps with prefill chunks keep phase 3.8's mixed pass.
the sampler  `DeviceSampler` (sampler.py): every pass samples on the device in one
             batch and makes ONE host transfer, the sampled ids; a row's draws are
             keyed on (seed, output index), so they do not depend on the batch.
"""

from __future__ import annotations

from phases.p3_8_chunked_prefill.engine import ChunkedPrefillEngine
from phases.p3_10_cuda_graphs.runner import StaleGraphs, StaticRunner, decode_buckets
from phases.p3_10_cuda_graphs.sampler import DeviceSampler

__all__ = ["StaticDecodeEngine", "StaleGraphs", "decode_buckets"]


class StaticDecodeEngine(ChunkedPrefillEngine):
    """Phase 3.8's engine with the static decode runner and the device sampler."""

    runner_class = StaticRunner

    def __init__(self, lm, *args, cuda_graphs: bool | None = None, buckets: list[int] | None = None, **kwargs):
        self.cuda_graphs, self.buckets = cuda_graphs, buckets   # read by make_runner, during 3.6's constructor
        super().__init__(lm, *args, **kwargs)

    def make_sampler(self) -> DeviceSampler:
        return DeviceSampler(self.lm.device)

    def make_runner(self) -> StaticRunner:
        return self.runner_class(self.lm, self.allocator, self.sampler, self.max_running, self.cuda_graphs,
                                 self.buckets)
