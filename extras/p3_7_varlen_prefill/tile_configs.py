"""Phase 3.7's prefill kernel's launch table: key tile, warps and stages per (fp32?, head_dim). Speed only.

Any entry computes the same answer; an entry only decides how fast. BLOCK_M is
the plan's block_m (64 by default).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_HEAD_DIM = 256



@dataclass(frozen=True)
class TileConfig:
    block_n: int       # key rows per tile (BLOCK_N)
    num_warps: int
    num_stages: int    # software-pipelining depth of the key-tile loop


# (fp32?, largest head_dim) -> config. Picked by compiling a few candidates for sm_90 without a GPU
# (measure/prefill_aot_check.py, with the 16-divisibility a launch marks on aligned pointers and strides):
# the largest tiles that built without register spills; not timed, tune them on a GPU. fp32 needs smaller
# tiles: exact fp32 `tl.dot` ("ieee") runs on the FMA units, not the tensor cores, and holds more per thread.
TILE_CONFIGS = {
    (False, 64): TileConfig(64, 4, 2), (False, 128): TileConfig(64, 8, 2), (False, 256): TileConfig(32, 8, 2),
    (True, 64): TileConfig(32, 8, 2), (True, 128): TileConfig(16, 8, 1), (True, 256): TileConfig(16, 8, 1),
}


def tile_config(head_dim: int, dtype: torch.dtype) -> TileConfig:
    """The kernel's key tile and launch settings for a head_dim (<= MAX_HEAD_DIM) and dtype."""
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} > {MAX_HEAD_DIM}: the prefill kernel has no tile config for it; "
                         f"use the PyTorch path (ops.paged_prefill_attention on CPU)")
    fp32 = dtype == torch.float32
    return next(config for (is_fp32, largest), config in TILE_CONFIGS.items()
                if is_fp32 == fp32 and head_dim <= largest)
