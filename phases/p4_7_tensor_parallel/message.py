"""The control message: what the driver tells every worker, as two broadcasts of int64 tensors.

A worker keeps only its shard and its pool, so it is told exactly what to do with them:

    PASS      run a forward pass: ids, positions, and the batch's metadata (each new token's slot, each
              sequence's block table and length, the packed row's layout), rebuilt over ITS pool
    COPY      copy whole blocks inside the pool (copy-on-write)
    SWAP_OUT  blocks from the pool to the CPU pool, and SWAP_IN back (preemption)
    SETUP     (re)build the pools: n_blocks, block_size, CPU blocks
    STOP      leave the loop

Block ids are the driver's (every pool has the same blocks). A message is a header, int64 [HEADER_LEN],
then one int64 payload whose length the header gives; a PASS's is (a segment: start, length, context_len, row)

    [ ids B*T | positions B*T | slots B*T | tables S*W | lens S | segments 4*P | keep K ]
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from phases.p3_6_batched_engine.attention import ATTN_NAME, PagedBatch, Segment
from phases.p3_7_varlen_prefill.ops import plan_prefill
from phases.p3_8_chunked_prefill.attention import VARLEN_ATTN_NAME, MixedBatch
from phases.p3_10_cuda_graphs.attention import STATIC_ATTN_NAME, StaticDecodeBatch

PASS, COPY, SWAP_OUT, SWAP_IN, SETUP, STOP = range(6)
HEADER_LEN = 13
# header slots of a PASS
OP, KIND, ATTN, B, T, S, W, P, K, KEEP, N_DECODE, N_SPLITS, IS_DECODE = range(HEADER_LEN)
# The batch types a pass may carry (a worker rebuilds the same type), and the attention names it may run under.
BATCH_KINDS = (PagedBatch, MixedBatch, StaticDecodeBatch)
ATTENTION_NAMES = (ATTN_NAME, VARLEN_ATTN_NAME, STATIC_ATTN_NAME)


def header(op: int, *values: int) -> torch.Tensor:
    out = torch.zeros(HEADER_LEN, dtype=torch.int64)
    out[0] = op
    out[1:1 + len(values)] = torch.tensor(values, dtype=torch.int64)
    return out


def encode_pass(input_ids: torch.Tensor, position_ids: torch.Tensor, paged: PagedBatch, logits_to_keep,
                attention: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A PASS message: (header [HEADER_LEN] on the CPU, payload on the batch's device)."""
    if type(paged) not in BATCH_KINDS:
        raise TypeError(f"tensor parallelism sends {[k.__name__ for k in BATCH_KINDS]}, not {type(paged).__name__}")
    if attention not in ATTENTION_NAMES:
        raise ValueError(f"tensor parallelism runs attention {list(ATTENTION_NAMES)}, not {attention!r}")
    b, t = input_ids.shape
    s, w = paged.block_tables.shape
    keep = logits_to_keep if torch.is_tensor(logits_to_keep) else None
    segs = [x for seg in paged.segments for x in (seg.start, seg.length, seg.context_len, seg.row)]
    head = header(PASS, BATCH_KINDS.index(type(paged)), ATTENTION_NAMES.index(attention), b, t, s, w,
                  len(paged.segments),
                  -1 if keep is None else keep.numel(), 0 if keep is not None else int(logits_to_keep),
                  getattr(paged, "n_decode", 0), getattr(paged, "n_splits", 1), int(paged.is_decode))
    dev = input_ids.device
    parts = [input_ids.reshape(-1), position_ids.reshape(-1), paged.slot_mapping, paged.block_tables.reshape(-1),
             paged.seq_lens, torch.tensor(segs, dtype=torch.int64, device=dev)]
    if keep is not None:
        parts.append(keep)
    return head, torch.cat([p.to(torch.int64) for p in parts])


@dataclass
class Pass:
    """A decoded PASS: the model call's arguments, over the receiving worker's pool."""
    input_ids: torch.Tensor      # [B, T]
    position_ids: torch.Tensor   # [B, T]
    batch: PagedBatch
    logits_to_keep: object       # an int, or a tensor of rows
    attention: str


def payload_len(head: list[int]) -> int:
    """Elements of the payload that follows a header (0: none)."""
    op = head[OP]
    if op == PASS:
        bt, s = head[B] * head[T], head[S]
        return 3 * bt + s * head[W] + s + 4 * head[P] + max(head[K], 0)
    if op in (COPY, SWAP_OUT, SWAP_IN):
        return 2 * head[1]
    return 0


def decode_pass(head: list[int], payload: torch.Tensor, kv_store: torch.Tensor) -> Pass:
    """The PASS whose header and payload these are, as a batch over `kv_store` (this worker's pool)."""
    bt, s, w, p = head[B] * head[T], head[S], head[W], head[P]
    cuts = [bt, bt, bt, s * w, s, 4 * p, max(head[K], 0)]
    ids, pos, slots, tables, lens, segs, keep = torch.split(payload, cuts)
    segments = [Segment(*row) for row in segs.view(p, 4).tolist()]
    common = dict(kv_store=kv_store, slot_mapping=slots, block_tables=tables.view(s, w).to(torch.int32),
                  seq_lens=lens.to(torch.int32), segments=segments)
    kind = BATCH_KINDS[head[KIND]]
    if kind is MixedBatch:
        cu = [0] + list(itertools.accumulate(seg.length for seg in segments))
        context = [seg.context_len for seg in segments]
        dev = payload.device
        batch = MixedBatch(**common, is_decode=False, n_decode=head[N_DECODE],
                           cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
                           context_lens=torch.tensor(context, dtype=torch.int32, device=dev),
                           prefill_plan=plan_prefill(cu, context, device=dev))
    elif kind is StaticDecodeBatch:
        batch = StaticDecodeBatch(**common, is_decode=True, n_splits=head[N_SPLITS])
    else:
        batch = PagedBatch(**common, is_decode=bool(head[IS_DECODE]))
    return Pass(ids.view(head[B], head[T]), pos.view(head[B], head[T]), batch,
                keep if head[K] >= 0 else head[KEEP], ATTENTION_NAMES[head[ATTN]])
