"""The model runner: a `Batch` -> a packed prefill pass and a decode pass -> logits, one row per emitting."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from phases.p2_2_scheduler.sequence import Sequence
from phases.p3_1_block_allocator.allocator import BlockAllocator
from phases.p3_6_batched_engine.attention import ATTN_NAME, PagedBatch, Segment, use_paged_attention


@dataclass
class Chunk:
    """Prefill work of one sequence in a step: positions start .. end - 1 (here a whole prompt)."""
    seq: Sequence
    start: int      # the pool already holds positions 0 .. start - 1
    length: int
    slots: list[int] = field(default_factory=list)   # pool slots of those positions (claimed when scheduled)

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def ids(self) -> list[int]:
        return self.seq.all_ids[self.start:self.end]

    @property
    def rows_kept(self) -> range:
        """Offsets of the rows whose logits the pass returns: the last, which gives the first token."""
        return range(self.length - 1, self.length)


@dataclass
class Batch:
    """One step's work, slots already claimed: prefill chunks, and decoding sequences (one token each)."""
    chunks: list[Chunk] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)
    decode_slots: list[int] = field(default_factory=list)   # the slot of each decode token, in `decode` order

    @property
    def emitting(self) -> list[Sequence]:
        """Whose token each logits row gives: each chunk's kept rows, then the decodes."""
        return [c.seq for c in self.chunks for _ in c.rows_kept] + self.decode

    @property
    def seqs(self) -> list[Sequence]:
        return [c.seq for c in self.chunks] + self.decode

    def __bool__(self) -> bool:
        return bool(self.chunks or self.decode)


class PagedRunner:
    """Forward passes whose attention reads and writes the pool through block tables."""

    attention_name = ATTN_NAME

    def __init__(self, lm, allocator: BlockAllocator):
        self.lm = lm
        self.allocator = allocator
        self.n_forward_passes = 0
        self.n_prefill_tokens = 0   # tokens whose K/V the prefill passes computed

    def run(self, batch: Batch) -> torch.Tensor:
        """Logits [len(batch.emitting), V]."""
        logits = []
        with use_paged_attention(self.lm.model, self.attention_name):
            if batch.chunks:
                logits.append(self.prefill(batch.chunks))
            if batch.decode:
                logits.append(self.decode(batch.decode, batch.decode_slots))
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    def prefill(self, chunks: list[Chunk]) -> torch.Tensor:
        """Every chunk packed into ONE pass, input_ids [1, N]. Returns logits [len(chunks), V]."""
        ids, positions, slots, segments = [], [], [], []
        for row, c in enumerate(chunks):
            segments.append(Segment(start=len(ids), length=c.length, context_len=c.start, row=row))
            ids += c.ids
            positions += range(c.start, c.end)
            slots += c.slots
        self.n_prefill_tokens += len(ids)
        dev = self.lm.device
        batch = self.paged_batch([c.seq for c in chunks], slots, is_decode=False, segments=segments)
        keep = torch.tensor([seg.start + r for seg, c in zip(segments, chunks) for r in c.rows_kept], device=dev)
        return self.forward(torch.tensor([ids], device=dev), torch.tensor([positions], device=dev), batch,
                            logits_to_keep=keep)[0]                                  # [S, V]

    def decode(self, seqs: list[Sequence], slots: list[int]) -> torch.Tensor:
        """Every sequence's last token in ONE pass, input_ids [S, 1]. Returns logits [S, V]."""
        dev = self.lm.device
        batch = self.paged_batch(seqs, slots, is_decode=True)
        ids = torch.tensor([[s.output_ids[-1]] for s in seqs], device=dev)            # [S, 1]
        positions = torch.tensor([[s.kv.n_filled - 1] for s in seqs], device=dev)     # [S, 1]
        return self.forward(ids, positions, batch)[:, -1]                              # [S, V]

    @torch.inference_mode()
    def forward(self, input_ids, position_ids, batch: PagedBatch, logits_to_keep=1) -> torch.Tensor:
        self.n_forward_passes += 1
        out = self.lm.model(input_ids=input_ids, position_ids=position_ids, paged=batch,
                            use_cache=False, logits_to_keep=logits_to_keep)
        return out.logits

    def block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        """[S, max_blocks] int32, padded with 0."""
        width = max(s.kv.n_blocks for s in seqs)
        rows = [s.kv.block_ids + [0] * (width - s.kv.n_blocks) for s in seqs]
        return torch.tensor(rows, dtype=torch.int32, device=self.lm.device)

    def paged_batch(self, seqs: list[Sequence], slots: list[int], is_decode: bool,
                    segments: list[Segment] | None = None) -> PagedBatch:
        """Where the new K/V go, and every sequence's table and length after this pass's writes."""
        dev = self.lm.device
        return PagedBatch(
            kv_store=self.allocator.kv_store,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=self.block_tables(seqs),
            seq_lens=torch.tensor([s.kv.n_filled for s in seqs], dtype=torch.int32, device=dev),
            is_decode=is_decode, segments=segments or [])
