"""Hugging Face attention through the paged pool: query [B, H, T, D], key/value [B, H_kv, T, D]. Decode,
`[S, 1]`: phase 3.5's paged op reads each context at its own length. Prefill, packed `[1, N]`: per segment."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from extras.p3_6_batched_engine.support import UnsupportedAttention, check_call  # noqa: F401
from extras.p3_6_batched_engine.switch import switch_attention
from phases.p3_5_paged_attention.ops import gather_kv, paged_decode_attention, plan_decode, plan_write, write_kv
from phases.p3_5_paged_attention.reference import soft_cap, visible_keys

ATTN_NAME = "engine_paged_pool"


@dataclass
class Segment:
    """One sequence's new tokens inside a packed prefill row."""
    start: int          # first index of this segment in the packed token axis
    length: int         # new tokens (the prompt, or the part of it past what the pool already holds)
    context_len: int    # tokens of this sequence already in the pool before this pass
    row: int            # this sequence's row in PagedBatch.block_tables


@dataclass
class PagedBatch:
    """What every attention layer of one forward pass needs to find K/V in the pool."""
    kv_store: torch.Tensor      # [n_blocks, n_layers, 2, n_kv_heads, block_size, head_dim]
    slot_mapping: torch.Tensor  # [N] int64: pool slot of each new token, in token order
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor      # [S] int32: tokens in the pool per sequence AFTER this pass's writes
    is_decode: bool             # True: [S, 1] layout; False: packed [1, N] prefill
    segments: list[Segment] = field(default_factory=list)  # prefill only

    # Worked out at the first layer, reused by every other.
    @cached_property
    def write_plan(self):
        return plan_write(self.kv_store, self.slot_mapping)

    @cached_property
    def decode_plan(self):
        return plan_decode(self.kv_store, self.block_tables, self.seq_lens)


def write_new_kv(batch: PagedBatch, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
    # -> [N, H_kv, D], in slot_mapping order
    k = key.transpose(1, 2).reshape(-1, key.shape[1], key.shape[3])
    v = value.transpose(1, 2).reshape(-1, value.shape[1], value.shape[3])
    write_kv(batch.kv_store, layer_idx, k, v, batch.slot_mapping, plan=batch.write_plan)


def _prefill_segment(module, q, k_new, v_new, seg: Segment, batch: PagedBatch, scaling: float,
                     sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of one segment's queries [1, H, T, D]; returns [1, T, H, D]."""
    total = seg.context_len + seg.length                             # = seq_lens[row], known on the host
    window_binds = sliding_window is not None and total > sliding_window
    if seg.context_len == 0 and softcap is None and not window_binds:
        # HF's own SDPA path, so a fresh prompt is computed exactly as `model.generate` does.
        out, _ = sdpa_attention_forward(module, q, k_new, v_new, None, scaling=scaling, is_causal=True)
        return out
    if seg.context_len == 0:
        k_all, v_all = k_new, v_new                                  # [1, H_kv, T, D]
    else:
        # A prefix is already in the pool: read prefix + segment back. max_len spares a GPU sync per layer.
        row = slice(seg.row, seg.row + 1)
        k_all, v_all = gather_kv(batch.kv_store, module.layer_idx, batch.block_tables[row], batch.seq_lens[row],
                                 max_len=total)                      # [1, H_kv, total, D]
    # query i sits at absolute position context_len + i and sees keys 0..context_len + i (the last w, windowed)
    mask = visible_keys(torch.arange(seg.context_len, total, device=q.device),
                        torch.arange(total, device=q.device), sliding_window)[None, None]   # [1, 1, T, total]
    groups = q.shape[1] // k_all.shape[1]
    k_all, v_all = k_all.repeat_interleave(groups, 1), v_all.repeat_interleave(groups, 1)
    if softcap is None:
        out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scaling)
    else:
        # SDPA has no softcap: written out, in fp32 like the references.
        scores = soft_cap(q.float() @ k_all.float().transpose(-1, -2) * scaling, softcap)
        out = (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v_all.float()).to(q.dtype)
    return out.transpose(1, 2)


def paged_attention_forward(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                            paged: PagedBatch | None = None, sliding_window: int | None = None,
                            softcap: float | None = None, **kwargs):
    """Returns (attn_output [B, T, H, D], None). Honours `scaling`, `sliding_window` and `softcap` (Gemma 2)."""
    if paged is None:
        raise RuntimeError(f"attention '{ATTN_NAME}' needs model(..., paged=PagedBatch); "
                           "run the model through BatchedPagedEngine")
    check_call(module, sliding_window, kwargs)
    write_new_kv(paged, module.layer_idx, key, value)
    if paged.is_decode:
        out = paged_decode_attention(query[:, :, 0, :], paged.kv_store, module.layer_idx, paged.block_tables,
                                     paged.seq_lens, scaling, plan=paged.decode_plan,
                                     sliding_window=sliding_window, softcap=softcap)
        return out.unsqueeze(1), None                                 # [S, 1, H, D]
    outs = []
    for seg in paged.segments:
        span = slice(seg.start, seg.start + seg.length)
        outs.append(_prefill_segment(module, query[:, :, span], key[:, :, span], value[:, :, span],
                                     seg, paged, scaling, sliding_window, softcap))
    return torch.cat(outs, dim=1), None                               # [1, N, H, D]


AttentionInterface.register(ATTN_NAME, paged_attention_forward)


@contextmanager
def use_paged_attention(model, name: str = ATTN_NAME):
    """Switch `model` to attention `name` for one step's passes (other engines use SDPA), then back."""
    previous = model.config._attn_implementation
    if previous != name:
        switch_attention(model, name)
    try:
        yield
    finally:
        if previous != name:
            switch_attention(model, previous)
