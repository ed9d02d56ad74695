"""What the CPU paths derive once per forward pass instead of once per layer.

A forward pass runs the same paged operations in every layer (30 in
SmolLM2-135M) over the same block tables, lengths and slots; only the layer
index changes. Whatever depends on those alone is worked out once and handed
to each layer:

- `WritePlan`: where each new token's K/V goes, as (block, offset) pairs,
  and which tokens store nothing (padding slots);
- `DecodePlan`: which block every (sequence, logical block) reads, and which
  of the gathered slots hold a real token.

Making a plan also checks the inputs' *values* (slots inside the pool, block
ids and lengths that fit), which means reading tensor contents; the layers
then check only shapes. At one sequence, doing that index arithmetic and those
checks in every layer is a large share of a decode step. The Triton kernels do this arithmetic
inside each program, so on a GPU no plan is made (see `ops.plan_write`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phases.p3_1_block_allocator.allocator import blocks_for
from phases.p3_4_gather_kernel.checks import check_tables
from phases.p3_4_gather_kernel.reference import max_length
from phases.p3_5_paged_attention.kernel_checks import PADDING_SLOT


@dataclass(frozen=True)
class WritePlan:
    rows: torch.Tensor | None   # [T'] int64: tokens that store something; None when every token does
    blocks: torch.Tensor        # [T'] int64: the block each stored token goes to
    offsets: torch.Tensor       # [T'] int64: its slot inside that block


@dataclass(frozen=True)
class DecodePlan:
    ids: torch.Tensor           # [B * n_logical] int64: block read per (sequence, logical block); 0 past the end
    valid: torch.Tensor         # [B, n_logical * block_size] bool: slot holds one of the sequence's tokens
    n_logical: int              # blocks covering the longest sequence


def plan_write(kv_store: torch.Tensor, slot_mapping: torch.Tensor) -> WritePlan:
    """slot_mapping [T] (block_id * block_size + offset, or -1 for padding) -> where each token goes."""
    n_blocks, block_size = kv_store.shape[0], kv_store.shape[4]
    if slot_mapping.numel() and kv_store.device.type == "cpu":
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < PADDING_SLOT or hi >= n_blocks * block_size:
            raise ValueError(f"slot_mapping must lie in [0, {n_blocks * block_size}) (or be {PADDING_SLOT} "
                             f"for padding), got values in [{lo}, {hi}]")
    keep = slot_mapping != PADDING_SLOT
    rows = None if bool(keep.all()) else keep.nonzero()[:, 0]
    slots = (slot_mapping if rows is None else slot_mapping[rows]).long()
    return WritePlan(rows, slots // block_size, slots % block_size)


def plan_decode(kv_store: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                max_len: int | None = None) -> DecodePlan:
    """block_tables [B, max_blocks], seq_lens [B] -> the blocks to gather and the mask, for every layer."""
    check_tables(kv_store, block_tables, seq_lens)
    block_size, device = kv_store.shape[4], kv_store.device
    n_logical = blocks_for(max_length(seq_lens, max_len), block_size)
    lens = seq_lens.to(device)[:, None]                                               # [B, 1]
    starts = torch.arange(n_logical, device=device) * block_size                      # [n_logical]
    # Table entries past a sequence's end are padding: read block 0 there (masked by `valid`).
    ids = torch.where(starts[None, :] < lens, block_tables[:, :n_logical].long(), 0).reshape(-1)
    valid = torch.arange(n_logical * block_size, device=device)[None, :] < lens       # [B, L]
    return DecodePlan(ids, valid, n_logical)
