"""The runner of phase 3.10: a decode-only step syncs the static buffers (buffers.py), pads the batch to the next
bucket and replays that (bucket, split count)'s CUDA graph (graphs.py), captured at first use; on CPU it runs
eagerly, with the CPU's counterpart where bf16 is native (extras/p3_10_cuda_graphs/cpu_step.py: packed weights,
decode attention compiled to read the pool in place). Steps with prefill chunks keep phase 3.8's mixed pass.
"""

from __future__ import annotations

import bisect
from contextlib import nullcontext

import torch

from extras.p3_10_cuda_graphs.cpu_step import PackedWeights, cpu_step_here
from phases.p2_2_scheduler.sequence import Sequence
from phases.p3_1_block_allocator.allocator import BlockAllocator, blocks_for
from phases.p3_6_batched_engine.attention import use_paged_attention
from phases.p3_6_batched_engine.runner import Batch
from phases.p3_8_chunked_prefill.runner import MixedRunner
from phases.p3_9_tuned_decode_kernel.split_rule import choose_splits, sm_count
from phases.p3_10_cuda_graphs.attention import STATIC_ATTN_NAME, StaticDecodeBatch
from phases.p3_10_cuda_graphs.buffers import DecodeBuffers, compute_slots
from phases.p3_10_cuda_graphs.graphs import capture


class StaleGraphs(RuntimeError):
    """The model or its dtype changed after the decode step was captured."""


def decode_buckets(max_running: int, buckets: list[int] | None = None) -> list[int]:
    """The batch sizes a decode step is padded to: powers of two below max_running, and max_running itself;
    or the given list, which must reach max_running (a full batch would have no graph otherwise)."""
    if buckets is None:
        return [1 << i for i in range((max_running - 1).bit_length())] + [max_running]   # 2^i < max_running
    if not buckets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in buckets):
        raise ValueError(f"decode buckets must be ints >= 1, got {buckets!r}")
    sizes = sorted(set(buckets))
    if sizes[-1] < max_running:
        raise ValueError(f"max_running={max_running} is over the largest decode bucket ({sizes[-1]}): add a bucket "
                         f"of at least {max_running} or lower max_running")
    return sizes


class StaticRunner(MixedRunner):
    """Phase 3.8's runner with the static decode step. Refused: `cuda_graphs=True` off CUDA, `cpu_step=True` off
    a CPU, and a model or dtype changed after the first static step (`StaleGraphs`: a graph would replay the old
    addresses)."""

    attention_name = STATIC_ATTN_NAME

    def __init__(self, lm, allocator: BlockAllocator, max_running: int, cuda_graphs: bool | None = None,
                 buckets: list[int] | None = None, cpu_step: bool | None = None):
        super().__init__(lm, allocator)
        on_cuda = torch.device(lm.device).type == "cuda"
        if cuda_graphs and not on_cuda:
            raise ValueError(f"cuda_graphs=True needs the model on a CUDA device; it is on {lm.device} "
                             "(the static decode step runs eagerly there: leave cuda_graphs unset)")
        if cpu_step and torch.device(lm.device).type != "cpu":
            raise ValueError(f"cpu_step=True is the CPU's counterpart of a CUDA graph; the model is on {lm.device}")
        self.cuda_graphs = on_cuda if cuda_graphs is None else bool(cuda_graphs)
        self.cpu_step = cpu_step_here(lm) if cpu_step is None else bool(cpu_step)
        self.packed_weights = PackedWeights(lm.model) if self.cpu_step else None
        if buckets is None and not self.cuda_graphs:
            buckets = list(range(1, max_running + 1))   # eager: padding would only add work (tests pad on CPU too)
        self.buckets = decode_buckets(max_running, buckets)
        pool_tokens = allocator.n_blocks * allocator.block_size
        max_context = getattr(lm.model.config, "max_position_embeddings", None) or pool_tokens
        width = blocks_for(min(max_context, pool_tokens), allocator.block_size)   # table entries a row can need
        self.buffers = DecodeBuffers(self.buckets[-1], width, allocator.block_size, lm.device)
        self.n_sms = sm_count(lm.device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}   # -> (graph, logits)
        # One memory pool for every graph: captured largest first (demo.py's `capture_all`), the smaller reuse it.
        self._graph_pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        self.last_graph: tuple[int, int] | None = None   # the (bucket, splits) the last static step replayed
        self._captured_with: tuple | None = None         # the model/pool the static step was first run with
        self.ran_static = False                          # the last `run` was a static step
        self.n_static_steps = 0
        self.n_padded_rows = 0                           # padding rows run, over all static steps

    def run(self, batch: Batch) -> torch.Tensor:
        """Logits [len(batch.emitting), V], in batch.emitting's order."""
        self.ran_static = not batch.chunks
        with self.packed_weights.on() if self.packed_weights else nullcontext():   # a CPU step: packed linears
            if batch.chunks:
                return super().run(batch)
            with use_paged_attention(self.lm.model, self.attention_name):
                return self.static_pass(batch.decode)

    def static_pass(self, seqs: list[Sequence]) -> torch.Tensor:
        """Sync the buffers and run the pass padded to its bucket. Returns logits [n, V], row i seqs[i]'s."""
        self.buffers.sync(seqs)
        n = len(seqs)
        bucket = self.buckets[bisect.bisect_left(self.buckets, n)]
        logits = self.replay(self.decode_batch(bucket, self.buffers.longest_blocks))[:n]     # [n, V]
        self.buffers.advance()
        self.n_static_steps += 1
        self.n_padded_rows += bucket - n
        return logits

    def decode_batch(self, bucket: int, longest_blocks: int) -> StaticDecodeBatch:
        """Buffer rows 0 .. bucket-1 as the attention's batch, with the split count for the longest table."""
        b = self.buffers
        return StaticDecodeBatch(kv_store=self.allocator.kv_store, slot_mapping=b.slot_mapping[:bucket],
                                 block_tables=b.block_tables[:bucket], seq_lens=b.seq_lens[:bucket], is_decode=True,
                                 n_splits=choose_splits(bucket, self.lm.n_kv_heads, self.n_sms, longest_blocks),
                                 in_place=self.cpu_step)

    @torch.inference_mode()
    def replay(self, batch: StaticDecodeBatch) -> torch.Tensor:
        """The static pass: eager, or its (bucket, splits) graph, captured at first use. Returns logits [bucket, V]."""
        self.n_forward_passes += 1
        self._check_unchanged()
        if not self.cuda_graphs:
            return self.static_forward(batch)
        key = (batch.block_tables.shape[0], batch.n_splits)
        if key not in self.graphs:
            self.graphs[key] = capture(lambda: self.static_forward(batch), self._graph_pool)
        graph, logits = self.graphs[key]
        graph.replay()
        self.last_graph = key
        return logits.clone()    # the next replay overwrites the graph's output; a caller may keep rows

    def static_forward(self, batch: StaticDecodeBatch) -> torch.Tensor:
        """The decode pass over buffer rows 0 .. bucket-1: what a graph records. Returns logits [bucket, V]."""
        bucket = batch.block_tables.shape[0]
        compute_slots(self.buffers, bucket)
        out = self.lm.model(input_ids=self.buffers.input_ids[:bucket, None],
                            position_ids=self.buffers.positions[:bucket, None], paged=batch, use_cache=False,
                            logits_to_keep=1)
        return out.logits[:, -1]

    def _check_unchanged(self) -> None:
        weight = next(self.lm.model.parameters())
        now = (id(self.lm.model), weight.dtype, weight.data_ptr(), self.allocator.kv_store.data_ptr(),
               self.allocator.kv_store.dtype)
        if self._captured_with is None:
            self._captured_with = now
        elif now != self._captured_with:
            raise StaleGraphs("the model, its weights' dtype or placement, or the KV pool changed after this engine's "
                              "decode step was captured (a CUDA graph replays the addresses it recorded); build a "
                              "new engine for the changed model")
