"""The runner of phase 3.8: ONE mixed pass per step, input_ids [1, N] = [decode tokens | chunk | chunk | ...]
(attention.py), or phase 3.6's decode pass when no chunk is due. A chunk may stop short of its prompt's end
(`PartialChunk`): then it emits nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phases.p2_2_scheduler.sequence import Sequence
from phases.p3_6_batched_engine.attention import Segment, use_paged_attention
from phases.p3_6_batched_engine.runner import Batch, Chunk, PagedRunner
from phases.p3_8_chunked_prefill.attention import VARLEN_ATTN_NAME, MixedBatch
from phases.p3_7_varlen_prefill.ops import plan_prefill


@dataclass
class PartialChunk(Chunk):
    """Phase 3.6's chunk, which may now end before its prompt does: then it emits nothing."""

    @property
    def last(self) -> bool:
        return self.end == len(self.seq.all_ids)

    @property
    def rows_kept(self) -> range:
        return super().rows_kept if self.last else range(0)


class MixedRunner(PagedRunner):
    """Phase 3.6's runner with one mixed pass per step, under the varlen prefill attention."""

    attention_name = VARLEN_ATTN_NAME

    def __init__(self, lm, allocator):
        super().__init__(lm, allocator)
        self.n_chunks = 0           # prefill chunks run (a prompt prefilled in one piece counts one)
        self.n_mixed_passes = 0     # passes that carried decode tokens AND prefill chunks

    def run(self, batch: Batch) -> torch.Tensor:
        """Logits [len(batch.emitting), V]: one mixed pass, or the decode pass when no chunk is due."""
        with use_paged_attention(self.lm.model, self.attention_name):
            if batch.chunks:
                return self.mixed(batch.chunks, batch.decode, batch.decode_slots)
            return self.decode(batch.decode, batch.decode_slots)

    def mixed(self, chunks: list[Chunk], decoding: list[Sequence], decode_slots: list[int]) -> torch.Tensor:
        """Decode tokens, then the chunks, in ONE pass: input_ids [1, D + sum of chunk lengths]."""
        ids = [s.output_ids[-1] for s in decoding]       # the last token sampled; its K/V is written now
        positions = [s.kv.n_filled - 1 for s in decoding]
        slots = list(decode_slots)
        cu, context = [0], []                            # chunk rows (from row D), and what precedes each chunk
        for c in chunks:
            slots += c.slots
            ids += c.ids
            positions += range(c.start, c.end)
            cu.append(cu[-1] + c.length)
            context.append(c.start)
        n_decode = len(decoding)
        batch = self.mixed_batch(decoding, chunks, slots, cu, context)
        keep = [n_decode + cu[i] + r for i, c in enumerate(chunks) for r in c.rows_kept] + list(range(n_decode))
        dev = self.lm.device
        logits = self.forward(torch.tensor([ids], device=dev), torch.tensor([positions], device=dev), batch,
                              logits_to_keep=torch.tensor(keep, dtype=torch.int64, device=dev))[0]   # [K, V]
        self.n_prefill_tokens += cu[-1]
        self.n_chunks += len(chunks)
        self.n_mixed_passes += bool(decoding)
        return logits

    def mixed_batch(self, decoding: list[Sequence], chunks: list[Chunk], slots: list[int], cu: list[int],
                    context: list[int]) -> MixedBatch:
        """Phase 3.6's metadata with the decode/prefill split; cu and context are host lists, so the plan
        reads nothing back from a GPU."""
        dev = self.lm.device
        seqs = decoding + [c.seq for c in chunks]
        d = len(decoding)
        return MixedBatch(
            kv_store=self.allocator.kv_store,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=self.block_tables(seqs),
            seq_lens=torch.tensor([s.kv.n_filled for s in seqs], dtype=torch.int32, device=dev),
            is_decode=False,
            segments=[Segment(start=d + cu[i], length=c.length, context_len=c.start, row=d + i)
                      for i, c in enumerate(chunks)],
            n_decode=d,
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(context, dtype=torch.int32, device=dev),
            prefill_plan=plan_prefill(cu, context, device=dev))
