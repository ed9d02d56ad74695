"""Hugging Face attention, rerouted through the paged KV pool.

`paged_attention_forward` is registered with transformers' `AttentionInterface`
under ATTN_NAME. An unmodified HF model whose attention implementation is
switched to it (see `use_paged_attention`) hands every layer's post-RoPE
query/key/value to us, together with the `PagedBatch` the engine passed as an
extra `model(..., paged=batch)` keyword. No HF cache object is involved
(`past_key_values=None`): this function *is* the cache.

Two layouts reach it:
- decode: `input_ids [S, 1]`, one new token per sequence. query [S, H, 1, D],
  key/value [S, H_kv, 1, D]. The new K/V are written to their slots, then the
  paged decode-attention op reads every sequence's context straight from the
  pool, at its own length, in one call.
- prefill: the prompts of newly admitted sequences packed along one row,
  `input_ids [1, N]` (N = sum of segment lengths), each segment with its own
  positions. The linear layers run on all N tokens at once; attention runs
  per segment (causal inside a segment, never across two).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from phases.p3_5_paged_attention.ops import gather_kv, paged_decode_attention, plan_decode, plan_write, write_kv

ATTN_NAME = "engine_paged_pool"


@dataclass
class Segment:
    """One sequence's new tokens inside a packed prefill row."""
    start: int          # first index of this segment in the packed token axis
    length: int         # new tokens (prompt, or the rest of it after a cached prefix)
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

    # Worked out at the first layer that needs them, reused by every other layer of the pass.
    @cached_property
    def write_plan(self):
        return plan_write(self.kv_store, self.slot_mapping)

    @cached_property
    def decode_plan(self):
        return plan_decode(self.kv_store, self.block_tables, self.seq_lens)


def _write_new_kv(batch: PagedBatch, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
    # key/value [B, H_kv, T, D] -> one row per new token [N, H_kv, D], in slot_mapping order
    k = key.transpose(1, 2).reshape(-1, key.shape[1], key.shape[3])
    v = value.transpose(1, 2).reshape(-1, value.shape[1], value.shape[3])
    write_kv(batch.kv_store, layer_idx, k, v, batch.slot_mapping, plan=batch.write_plan)


def _prefill_segment(module, q, k_new, v_new, seg: Segment, batch: PagedBatch, scaling: float) -> torch.Tensor:
    """Causal attention of one segment's queries [1, H, T, D]; returns [1, T, H, D]."""
    if seg.context_len == 0:
        # Nothing earlier in the pool: attend over the fresh K/V with HF's own SDPA
        # path, so a fresh prompt is computed exactly as `model.generate` does.
        out, _ = sdpa_attention_forward(module, q, k_new, v_new, None, scaling=scaling, is_causal=True)
        return out
    # A prefix is already in the pool (prefix cache hit, or recomputation after
    # preemption): read the whole context (prefix + this segment) back from the pool.
    row = slice(seg.row, seg.row + 1)
    total = seg.context_len + seg.length                             # = seq_lens[row], known on the host
    # Passing the length spares the gather from reading it out of seq_lens: on a GPU that read
    # would wait for the stream, once per layer per segment.
    k_all, v_all = gather_kv(batch.kv_store, module.layer_idx, batch.block_tables[row], batch.seq_lens[row],
                             max_len=total)                          # [1, H_kv, total, D]
    # query i sits at absolute position context_len + i and sees keys 0..context_len + i
    q_pos = torch.arange(seg.context_len, total, device=q.device)[:, None]
    k_pos = torch.arange(total, device=q.device)[None, :]
    mask = (k_pos <= q_pos)[None, None]                              # [1, 1, T, total]
    groups = q.shape[1] // k_all.shape[1]
    out = F.scaled_dot_product_attention(q, k_all.repeat_interleave(groups, 1), v_all.repeat_interleave(groups, 1),
                                         attn_mask=mask, scale=scaling)
    return out.transpose(1, 2)


def paged_attention_forward(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                            paged: PagedBatch | None = None, **kwargs):
    """The AttentionInterface entry point. Returns (attn_output [B, T, H, D], None)."""
    if paged is None:
        raise RuntimeError(f"attention '{ATTN_NAME}' needs model(..., paged=PagedBatch); "
                           "run the model through BatchedPagedEngine")
    layer = module.layer_idx
    _write_new_kv(paged, layer, key, value)
    if paged.is_decode:
        # query [S, H, 1, D] -> [S, H, D]; every sequence at its own length, one call
        out = paged_decode_attention(query[:, :, 0, :], paged.kv_store, layer, paged.block_tables,
                                     paged.seq_lens, scaling, plan=paged.decode_plan)
        return out.unsqueeze(1), None                                 # [S, 1, H, D]
    outs = []
    for seg in paged.segments:
        span = slice(seg.start, seg.start + seg.length)
        outs.append(_prefill_segment(module, query[:, :, span], key[:, :, span], value[:, :, span],
                                     seg, paged, scaling))
    return torch.cat(outs, dim=1), None                               # [1, N, H, D]


AttentionInterface.register(ATTN_NAME, paged_attention_forward)


@contextmanager
def use_paged_attention(model):
    """Switch `model` to the paged attention for the duration of a forward pass.

    Switched per call, not once, because other engines in the same process (the
    benchmarks compare them) run the same model with SDPA and padding masks."""
    previous = model.config._attn_implementation
    if previous != ATTN_NAME:
        model.set_attn_implementation(ATTN_NAME)
    try:
        yield
    finally:
        if previous != ATTN_NAME:
            model.set_attn_implementation(previous)
