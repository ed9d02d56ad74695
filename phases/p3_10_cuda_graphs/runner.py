"""The runner of phase 3.10: a decode-only step runs over static buffers, padded to a bucket, replayed as a CUDA graph.

On a GPU most of a 256-sequence decode step of phases 3.6/3.8 is not GPU work
but Python building tensors from lists and launching some 1,500 kernels one by
one. This runner keeps phase 3.8's mixed pass for steps with prefill chunks
(their shapes change every step) and runs a decode-only step differently:

static buffers  the step's inputs live in tensors allocated once (buffers.py), one
                row per decoding sequence; the host sends only what changed (a new
                block, a joined or moved sequence), and the slot mapping is computed
                on the device from the tables.
buckets         the batch is padded up to the next bucket (1, 2, 4, ..., max_running):
                padding rows have length 0, write nothing, read nothing, and their
                logits are dropped. Padding never changes a token (tests).
CUDA graphs     on CUDA, each (bucket, split count) is captured once, at first use
                (graphs.py), and replayed every step after: one call instead of
                a launch per kernel. On CPU the same static step runs eagerly.
the kernel      on CUDA the decode attention is phase 3.9's tuned kernel, its split
                count chosen by 3.9's split rule from the batch, the KV heads, the
                SMs and the longest context; on CPU, phase 3.5's path.

The sampled ids of a static step go straight back into the next step's input ids,
on the device (`DeviceSampler.last`).
"""

from __future__ import annotations

import bisect

import torch

from phases.p2_2_scheduler.sequence import Sequence
from phases.p3_1_block_allocator.allocator import BlockAllocator, blocks_for
from phases.p3_6_batched_engine.attention import use_paged_attention
from phases.p3_6_batched_engine.runner import Batch
from phases.p3_8_chunked_prefill.runner import MixedRunner
from phases.p3_10_cuda_graphs.attention import STATIC_ATTN_NAME, StaticDecodeBatch
from phases.p3_10_cuda_graphs.buffers import DecodeBuffers, compute_slots
from phases.p3_10_cuda_graphs.graphs import capture
from phases.p3_10_cuda_graphs.sampler import DeviceSampler
from phases.p3_9_tuned_decode_kernel.split_rule import choose_splits, sm_count


class StaleGraphs(RuntimeError):
    """The model or its dtype changed after the decode step was captured."""


def decode_buckets(max_running: int, buckets: list[int] | None = None) -> list[int]:
    """The batch sizes a decode step is padded to: powers of two below max_running, and max_running itself;
    or the given list, which must reach max_running."""
    if buckets is None:
        sizes, b = [], 1
        while b < max_running:
            sizes.append(b)
            b *= 2
        return sizes + [max_running]
    if not buckets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in buckets):
        raise ValueError(f"decode buckets must be ints >= 1, got {buckets!r}")
    sizes = sorted(set(buckets))
    if sizes[-1] < max_running:
        raise ValueError(f"max_running={max_running} is over the largest decode bucket ({sizes[-1]}): a step with "
                         f"more than {sizes[-1]} sequences would have no captured graph; add a bucket of at least "
                         f"{max_running} or lower max_running")
    return sizes


class StaticRunner(MixedRunner):
    """Phase 3.8's runner; a decode-only step runs over static buffers, padded to a bucket, as a CUDA graph
    on CUDA.

    Refused, with a message: a bucket list whose largest bucket is below max_running (a full batch would have
    no graph), `cuda_graphs=True` off CUDA, and a model or dtype changed after the first static step (a graph
    would replay on the old weights' addresses: `StaleGraphs`)."""

    attention_name = STATIC_ATTN_NAME

    def __init__(self, lm, allocator: BlockAllocator, sampler: DeviceSampler, max_running: int,
                 cuda_graphs: bool | None = None, buckets: list[int] | None = None):
        super().__init__(lm, allocator)
        on_cuda = torch.device(lm.device).type == "cuda"
        if cuda_graphs and not on_cuda:
            raise ValueError(f"cuda_graphs=True needs the model on a CUDA device; it is on {lm.device} "
                             "(the static decode step runs eagerly there: leave cuda_graphs unset)")
        self.sampler = sampler
        self.cuda_graphs = on_cuda if cuda_graphs is None else bool(cuda_graphs)
        if buckets is None and not self.cuda_graphs:
            # Eager: padding would only add work, so every batch size is its own bucket (tests pass buckets to
            # pad on CPU too).
            buckets = list(range(1, max_running + 1))
        self.buckets = decode_buckets(max_running, buckets)
        max_context = getattr(lm.model.config, "max_position_embeddings", None)
        width = allocator.n_blocks if max_context is None else \
            min(allocator.n_blocks, blocks_for(max_context, allocator.block_size))
        self.buffers = DecodeBuffers(self.buckets[-1], width, allocator.block_size, lm.device)
        self.n_sms = sm_count(lm.device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._graph_pool = None
        self.last_graph: tuple[int, int] | None = None   # the (bucket, splits) the last static step replayed
        self._captured_with: tuple | None = None    # the model/pool the static step was first run with
        self._last_rows: list[Sequence] | None = None   # the rows of the last static step, if its ids were sampled
        self.n_static_steps = 0
        self.n_padded_rows = 0                      # padding rows run, over all static steps

    def run(self, batch: Batch) -> torch.Tensor:
        if batch.chunks:
            self._last_rows = None
            return super().run(batch)
        with use_paged_attention(self.lm.model, self.attention_name):
            rows, logits = self.static_pass(batch.decode)
        batch.decode = rows     # the buffers' row order is the logits' order: the sampler and update follow it
        return logits

    def static_pass(self, seqs: list[Sequence]) -> tuple[list[Sequence], torch.Tensor]:
        """Bring the buffers up to date (slots were claimed by the scheduler: only the diff is sent), run the
        pass padded to its bucket. Returns the sequences in row order and their logits [n, V].

        A table changed by anyone (a new block, a copied or forked block, a swap-in) is caught by the buffers'
        comparison with the sequences, and sent."""
        self._feed_back_sampled()
        rows = self.buffers.sync(seqs)
        n = len(rows)
        bucket = self.buckets[bisect.bisect_left(self.buckets, n)]
        batch = StaticDecodeBatch(
            kv_store=self.allocator.kv_store, slot_mapping=self.buffers.slot_mapping[:bucket],
            block_tables=self.buffers.block_tables[:bucket], seq_lens=self.buffers.seq_lens[:bucket],
            is_decode=True, n_splits=choose_splits(bucket, self.lm.n_kv_heads, self.n_sms, self.buffers.longest_blocks))
        logits = self.replay(batch)[:n]                                                 # [n, V]
        self.buffers.advance()
        self._last_rows = rows
        self.n_static_steps += 1
        self.n_padded_rows += bucket - n
        return rows, logits

    def _feed_back_sampled(self) -> None:
        """The last static step's sampled ids, still on the device, become its rows' next input ids."""
        last = self.sampler.last
        if self._last_rows is not None and last is not None and len(last[0]) == len(self._last_rows) \
                and all(a is b for a, b in zip(last[0], self._last_rows)):
            self.buffers.record_sampled(last[1], last[2])
        self._last_rows = None

    @torch.inference_mode()
    def replay(self, batch: StaticDecodeBatch) -> torch.Tensor:
        """The static pass: eager, or its bucket's graph (captured at first use). Returns logits [bucket, V]."""
        self.n_forward_passes += 1
        self._check_unchanged()
        if not self.cuda_graphs:
            return self.static_forward(batch)
        key = (batch.block_tables.shape[0], batch.n_splits)
        if key not in self.graphs:
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            self.graphs[key] = capture(lambda: self.static_forward(batch), self._graph_pool)
        graph, logits = self.graphs[key]
        graph.replay()
        self.last_graph = key
        # The graph's output is overwritten by the next replay; a caller may keep rows, so it gets its own copy.
        return logits.clone()

    def static_forward(self, batch: StaticDecodeBatch) -> torch.Tensor:
        """The decode pass over buffer rows 0 .. bucket-1: what a graph records. Returns logits [bucket, V]."""
        bucket = batch.block_tables.shape[0]
        compute_slots(self.buffers, bucket)
        out = self.lm.model(input_ids=self.buffers.input_ids[:bucket, None],
                            position_ids=self.buffers.positions[:bucket, None], paged=batch, use_cache=False,
                            logits_to_keep=1)
        return out.logits[:, -1]

    def _check_unchanged(self) -> None:
        """Refuse to run the static step on a model, dtype or pool other than the one it was first run with."""
        weight = next(self.lm.model.parameters())
        now = (id(self.lm.model), weight.dtype, weight.data_ptr(), self.allocator.kv_store.data_ptr(),
               self.allocator.kv_store.dtype)
        if self._captured_with is None:
            self._captured_with = now
        elif now != self._captured_with:
            raise StaleGraphs("the model, its weights' dtype or placement, or the KV pool changed after this engine's "
                              "decode step was captured (a CUDA graph replays the addresses it recorded); build a "
                              "new engine for the changed model")

    def capture_all(self) -> int:
        """Capture every bucket's graph (one split each) now, largest first (the smaller ones reuse its memory
        pool), instead of at first use. Rows are empty: nothing is written to the pool. Returns graphs captured."""
        if not self.cuda_graphs:
            return 0
        if self.buffers.n_rows:
            raise RuntimeError("capture_all runs before the first decode step (the buffers hold no sequence)")
        n_before = len(self.graphs)
        with use_paged_attention(self.lm.model, self.attention_name):
            for bucket in reversed(self.buckets):
                batch = StaticDecodeBatch(
                    kv_store=self.allocator.kv_store, slot_mapping=self.buffers.slot_mapping[:bucket],
                    block_tables=self.buffers.block_tables[:bucket], seq_lens=self.buffers.seq_lens[:bucket],
                    is_decode=True, n_splits=choose_splits(bucket, self.lm.n_kv_heads, self.n_sms, 0))
                self.replay(batch)
        return len(self.graphs) - n_before
