"""Hugging Face attention over the paged pool for a MIXED pass: decode tokens and prefill chunks in one row,
`input_ids [1, N]`:

    rows 0 .. D-1     one decode token per decoding sequence (its last sampled token)
    rows D .. N-1     the prefill chunks, back to back: chunk s owns rows D + cu[s] .. D + cu[s+1] - 1
                      (a whole prompt, or the next piece of one; cu = cu_seqlens_q)

`block_tables` / `seq_lens` hold one row per sequence in that same order. Any other batch (phase 3.6's
decode pass) goes to phase 3.6's attention unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from transformers import AttentionInterface

from phases.p3_6_batched_engine.attention import PagedBatch, check_call, paged_attention_forward, write_new_kv
from phases.p3_5_paged_attention.ops import paged_decode_attention, plan_decode
from phases.p3_7_varlen_prefill.ops import paged_prefill_attention
from phases.p3_7_varlen_prefill.plan import PrefillPlan

VARLEN_ATTN_NAME = "engine_varlen_pool"


@dataclass
class MixedBatch(PagedBatch):
    """Phase 3.6's pass metadata over all N rows (decode rows first: `block_tables` [D + P, max_blocks],
    `seq_lens` [D + P]), plus the split into decode rows and prefill chunks."""
    n_decode: int = 0                          # D: rows (and table rows) 0 .. D-1 are decode tokens
    cu_seqlens_q: torch.Tensor | None = None   # [P + 1] int32: chunk rows, counted from row D
    context_lens: torch.Tensor | None = None   # [P] int32: tokens of each chunk's sequence in the pool before it
    prefill_plan: PrefillPlan | None = None    # plan_prefill(cu, context) from host lists, once per pass

    @property
    def n_prefill_tokens(self) -> int:
        return self.slot_mapping.shape[0] - self.n_decode

    # The two halves' views, made at the first layer and shared by every other.
    @cached_property
    def decode_tables(self) -> torch.Tensor:
        return self.block_tables[:self.n_decode]                      # [D, max_blocks]

    @cached_property
    def decode_lens(self) -> torch.Tensor:
        return self.seq_lens[:self.n_decode]                          # [D]

    @cached_property
    def prefill_tables(self) -> torch.Tensor:
        return self.block_tables[self.n_decode:]                      # [P, max_blocks]

    @cached_property
    def decode_plan(self):
        """Phase 3.5's CPU decode plan, over the decode rows only (None on a GPU)."""
        return plan_decode(self.kv_store, self.decode_tables, self.decode_lens)


def varlen_attention_forward(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                             paged: PagedBatch | None = None, sliding_window: int | None = None,
                             softcap: float | None = None, **kwargs):
    """The AttentionInterface entry point. query [1, H, N, D], key/value [1, H_kv, N, D] for a MixedBatch;
    returns (attn_output [1, N, H, D], None). Writes all N new K/V into the pool, then runs phase 3.5's decode
    attention on rows 0 .. D-1 and phase 3.7's varlen prefill attention ONCE on rows D .. N-1 (each chunk
    attends its sequence's earlier tokens in the pool, and itself, causally)."""
    if not isinstance(paged, MixedBatch):
        return paged_attention_forward(module, query, key, value, attention_mask, scaling, dropout, paged=paged,
                                       sliding_window=sliding_window, softcap=softcap, **kwargs)
    check_call(module, sliding_window, kwargs)
    layer = module.layer_idx
    write_new_kv(paged, layer, key, value)
    d = paged.n_decode
    q = query[0].transpose(0, 1)                                       # [N, H, D], packed rows (a view)
    outs = []
    if d:
        outs.append(paged_decode_attention(q[:d], paged.kv_store, layer, paged.decode_tables, paged.decode_lens,
                                           scaling, plan=paged.decode_plan, sliding_window=sliding_window,
                                           softcap=softcap))           # [D, H, D]
    if paged.n_prefill_tokens:
        # The chunks' own new K/V [T, H_kv, D]: the CPU path reads a fresh chunk's from here, not the pool.
        new_kv = (key[0].transpose(0, 1)[d:], value[0].transpose(0, 1)[d:])
        outs.append(paged_prefill_attention(q[d:], paged.kv_store, layer, paged.prefill_tables,
                                            paged.cu_seqlens_q, paged.context_lens, scaling, sliding_window,
                                            softcap, plan=paged.prefill_plan, new_kv=new_kv))   # [T, H, D]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.unsqueeze(0), None                                      # [1, N, H, D]


AttentionInterface.register(VARLEN_ATTN_NAME, varlen_attention_forward)
