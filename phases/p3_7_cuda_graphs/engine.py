"""`StaticDecodeEngine`: phase 3.6's engine whose decode steps run over static buffers, replayed as CUDA graphs.

On a GPU most of phase 3.5/3.6's decode step with 256 sequences is not GPU work
but Python building tensors from lists and launching some 1,500 kernels one by
one (the README has the H100's figures). This phase keeps every scheduling
decision of phase 3.6 and changes how a decode-only step runs:

static buffers  the step's inputs live in tensors allocated once (buffers.py), one
                row per decoding sequence; the metadata is updated on the device
                from what changed (a new block, a joined or moved sequence), and
                the slot mapping is computed on the device from the tables.
buckets         the batch is padded up to the next bucket (1, 2, 4, ..., max_running):
                padding rows have length 0, write nothing, read nothing, and their
                logits are dropped. Padding never changes a token (tests). Without
                graphs every batch size is its own bucket by default (padding an
                eager pass only adds work); tests pass buckets to pad on CPU too.
CUDA graphs     on CUDA, each (bucket, split count) is captured once, at first use
                (graphs.py), and replayed every step after: one call instead of
                ~1,500 launches. On CPU the same static step runs eagerly.
the kernel      the decode attention is phase 3.7's tuned kernel (decode_kernel.py),
                its split count chosen by split_rule.py from the batch, the KV
                heads, the SMs and the longest context.
sampling        every pass samples on the device in one batch (sampler.py) and
                makes ONE host transfer: the sampled ids. In a static step they also
                go straight into the next step's input_ids, on the device.

Mixed passes (decode tokens beside prefill chunks) stay phase 3.6's eager pass:
their shapes change every step. Later phases subclass this engine, so
copy-on-write, beams, prefix caching, preemption and the server decode this way
too; what they change in a table (a copied block, a fork, a swap-in, a
recomputation) is caught by the buffers' comparison with the sequences and sent.

Refused, with a message: a bucket list whose largest bucket is below
max_running (a full batch would have no graph), `cuda_graphs=True` off CUDA,
and a model or dtype changed after the first static step (a graph would
replay on the old weights' addresses).
"""

from __future__ import annotations

import bisect

import torch

from phases.p2_2_scheduler.sequence import Sequence, StepOutput
from phases.p3_1_block_allocator.allocator import blocks_for
from phases.p3_5_paged_attention.attention import use_paged_attention
from phases.p3_6_varlen_prefill.engine import ChunkedPrefillEngine
from phases.p3_7_cuda_graphs.attention import STATIC_ATTN_NAME, StaticDecodeBatch
from phases.p3_7_cuda_graphs.buffers import DecodeBuffers, compute_slots
from phases.p3_7_cuda_graphs.graphs import capture
from phases.p3_7_cuda_graphs.sampler import sample_rows, sampling_rows, seed_of
from phases.p3_7_cuda_graphs.split_rule import choose_splits, sm_count


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


class StaticDecodeEngine(ChunkedPrefillEngine):
    """Phase 3.6's engine; decode-only steps run over static buffers, padded to a bucket, as CUDA graphs on CUDA."""

    attention_name = STATIC_ATTN_NAME

    def __init__(self, lm, *args, cuda_graphs: bool | None = None, buckets: list[int] | None = None,
                 static_decode: bool = True, **kwargs):
        super().__init__(lm, *args, **kwargs)
        on_cuda = torch.device(lm.device).type == "cuda"
        if cuda_graphs and not on_cuda:
            raise ValueError(f"cuda_graphs=True needs the model on a CUDA device; it is on {lm.device} "
                             "(the static decode step runs eagerly there: leave cuda_graphs unset)")
        self.static_decode = static_decode
        self.cuda_graphs = static_decode and (on_cuda if cuda_graphs is None else bool(cuda_graphs))
        if buckets is None and not self.cuda_graphs:
            buckets = list(range(1, self.max_running + 1))   # eager: padding would be wasted work, so every size
        self.buckets = decode_buckets(self.max_running, buckets)
        max_context = getattr(lm.model.config, "max_position_embeddings", None)
        width = self.allocator.n_blocks if max_context is None else \
            min(self.allocator.n_blocks, blocks_for(max_context, self.block_size))
        self.buffers = DecodeBuffers(self.buckets[-1], width, self.block_size, lm.device)
        self.n_sms = sm_count(lm.device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._graph_pool = None
        self.last_graph: tuple[int, int] | None = None   # the (bucket, splits) the last static step replayed
        self._captured_with: tuple | None = None    # the model/pool the static step was first run with
        self._seeds: dict[int, int] = {}            # seq_id -> seed of a request that named none
        self._last_sampled: tuple | None = None     # (seqs, ids on the device, ids on the host) of the last _sample
        self.n_static_steps = 0
        self.n_padded_rows = 0                      # padding rows run, over all static steps

    # --- the decode step ------------------------------------------------------------------------
    def _decode(self, seqs: list[Sequence]) -> list[StepOutput]:
        """Every decoding sequence's next token from the static buffers, padded to a bucket."""
        if not self.static_decode:
            return super()._decode(seqs)
        rows, logits = self._static_pass(seqs)
        self._last_sampled = None
        outputs = self._emit(rows, logits)
        sampled = self._last_sampled
        if sampled is not None and (sampled[0] is rows or (len(sampled[0]) == len(rows) and
                                                         all(a is b for a, b in zip(sampled[0], rows)))):
            self.buffers.record_sampled(sampled[1], sampled[2])    # next step's input ids, already on the device
        return outputs

    def _static_pass(self, seqs: list[Sequence]) -> tuple[list[Sequence], torch.Tensor]:
        """Claim each sequence's next slot, bring the buffers up to date, run the pass padded to its bucket.
        Returns the sequences in row order and their logits [n, V]."""
        for s in seqs:
            self._append_slots(s, 1)       # host bookkeeping (copy-on-write included); the device gets the diff
        rows = self.buffers.sync(seqs)
        n = len(rows)
        bucket = self.buckets[bisect.bisect_left(self.buckets, n)]
        batch = StaticDecodeBatch(
            kv_store=self.allocator.kv_store, slot_mapping=self.buffers.slot_mapping[:bucket],
            block_tables=self.buffers.block_tables[:bucket], seq_lens=self.buffers.seq_lens[:bucket],
            is_decode=True, n_splits=choose_splits(bucket, self.lm.n_kv_heads, self.n_sms, self.buffers.longest_blocks))
        logits = self._forward(None, None, batch)[:n]                                    # [n, V]
        self.buffers.advance()
        self.n_static_steps += 1
        self.n_padded_rows += bucket - n
        return rows, logits

    @torch.inference_mode()
    def _forward(self, input_ids, position_ids, batch, logits_to_keep=1) -> torch.Tensor:
        if not isinstance(batch, StaticDecodeBatch):
            return super()._forward(input_ids, position_ids, batch, logits_to_keep)
        self.n_forward_passes += 1
        self._check_unchanged()
        if not self.cuda_graphs:
            return self._static_forward(batch)
        key = (batch.block_tables.shape[0], batch.n_splits)
        if key not in self.graphs:
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            self.graphs[key] = capture(lambda: self._static_forward(batch), self._graph_pool)
        graph, logits = self.graphs[key]
        graph.replay()
        self.last_graph = key
        # The graph's output is overwritten by the next replay; a caller may keep rows past it, so it gets
        # its own copy.
        return logits.clone()

    def _static_forward(self, batch: StaticDecodeBatch) -> torch.Tensor:
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
                self._forward(None, None, batch)
        return len(self.graphs) - n_before

    # --- sampling: the whole batch on the device, one transfer ---------------------------------
    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """One token per row of logits [S, V], drawn on the device (sampler.py); ONE copy to the host."""
        ids = self._draw(seqs, logits)
        tokens = ids.tolist()
        self._last_sampled = (seqs, ids, tokens)
        return tokens

    def _draw(self, seqs: list[Sequence], logits: torch.Tensor, ahead: int = 0) -> torch.Tensor:
        """Each row's next token id [S], on the device. ahead: tokens a row has drawn that the host has not
        appended yet (an overlapped step, overlap.py), so each draw keeps its output index."""
        if all(s.sampling.greedy for s in seqs):
            return sample_rows(logits, None)          # one argmax: no per-row parameters to send
        seeds = [seed_of(self._generators.get(s.seq_id), self._seeds, s.seq_id) for s in seqs]
        rows = sampling_rows([s.sampling for s in seqs], seeds, [len(s.output_ids) + ahead for s in seqs],
                             logits.shape[-1], logits.device)
        return sample_rows(logits, rows)

    def _finish(self, seq: Sequence) -> None:
        super()._finish(seq)
        self._seeds.pop(seq.seq_id, None)

    def abort(self, seq: Sequence) -> None:
        super().abort(seq)
        self._seeds.pop(seq.seq_id, None)
