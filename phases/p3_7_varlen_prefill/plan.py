"""The prefill "plan": what a packed prefill pass works out once, on the host, for all its layers.

A packed prefill row holds S segments (one per sequence) back to back:

    q rows:   [ seg 0: 5 tokens | seg 1: 1 token | seg 2: 20 tokens ]      N = 26
    cu_seqlens_q = [0, 5, 6, 26]                                             [S + 1]

The kernel runs one program per (query tile of BLOCK_M rows, query head). A
program must know its tile's segment and first row. That list is the same in
every layer, so it is made once per forward pass, one small int32 tensor:

    block_m = 16:  tiles = [(0, 0), (1, 0), (2, 0), (2, 16)]                [n_tiles, 2]
                            seg 0    seg 1   seg 2 rows 0..15, rows 16..19

A tile never straddles two segments, so causality never crosses one. The
lengths are kept as Python ints too: the checks never read a GPU tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from phases.p3_4_gather_kernel.checks import is_power_of_two

DEFAULT_BLOCK_M = 64   # query rows per tile on a GPU (an untuned starting point; see kernel.py)
MIN_DOT_TILE = 16      # `tl.dot` needs every tile dimension >= 16
TILE_FIELDS = 2        # a tile is (segment, first query row inside that segment)


@dataclass(frozen=True)
class PrefillPlan:
    seg_starts: tuple[int, ...]     # [S] first packed row of each segment (cu_seqlens_q[:-1])
    seg_lens: tuple[int, ...]       # [S] new tokens of each segment
    context_lens: tuple[int, ...]   # [S] tokens of that sequence already in the pool before this pass
    block_m: int                    # query rows per tile: the kernel's BLOCK_M
    tiles: torch.Tensor             # [n_tiles, 2] int32 on the pool's device: (segment, first row in it)

    @property
    def n_segments(self) -> int:
        return len(self.seg_lens)

    @property
    def n_tokens(self) -> int:
        return sum(self.seg_lens)

    @property
    def n_tiles(self) -> int:
        return self.tiles.shape[0]

    @property
    def total_lens(self) -> tuple[int, ...]:
        """[S] tokens of each sequence in the pool once this segment is written (context + new)."""
        return tuple(c + n for c, n in zip(self.context_lens, self.seg_lens))


def query_tiles(seg_lens: Sequence[int], block_m: int) -> list[tuple[int, int]]:
    """(segment, first row) of every query tile, segment by segment; an empty segment has none."""
    return [(seg, first) for seg, n in enumerate(seg_lens) for first in range(0, n, block_m)]


def _as_ints(name: str, values: torch.Tensor | Sequence[int]) -> list[int]:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise ValueError(f"{name} must be 1-d, got shape {tuple(values.shape)}")
        if values.dtype.is_floating_point or values.dtype == torch.bool:
            raise ValueError(f"{name} must hold integers, got {values.dtype}")
        return [int(x) for x in values.tolist()]    # one device -> host copy per pass on a GPU
    return [int(x) for x in values]


def plan_prefill(cu_seqlens_q: torch.Tensor | Sequence[int], context_lens: torch.Tensor | Sequence[int],
                 block_m: int = DEFAULT_BLOCK_M, device: torch.device | str | None = None) -> PrefillPlan:
    """Check the segment layout and cut it into query tiles, once per forward pass.

    cu_seqlens_q [S + 1] (segment s owns packed rows cu[s] .. cu[s+1] - 1), context_lens [S]: tensors, or
    lists of ints (no device -> host copy). device: where `tiles` goes (default: cu_seqlens_q's, else CPU).
    """
    if not is_power_of_two(block_m) or block_m < MIN_DOT_TILE:
        raise ValueError(f"block_m must be a power of two >= {MIN_DOT_TILE} (tl.dot tiles), got {block_m}")
    cu = _as_ints("cu_seqlens_q", cu_seqlens_q)
    ctx = _as_ints("context_lens", context_lens)
    if not cu or cu[0] != 0:
        raise ValueError(f"cu_seqlens_q must start at 0 and have S + 1 entries, got {cu}")
    seg_lens = [b - a for a, b in zip(cu, cu[1:])]
    if any(n < 0 for n in seg_lens):
        raise ValueError(f"cu_seqlens_q must be non-decreasing (segment lengths >= 0), got {cu}")
    if len(ctx) != len(seg_lens):
        raise ValueError(f"context_lens has {len(ctx)} entries but cu_seqlens_q describes {len(seg_lens)} segments")
    if any(c < 0 for c in ctx):
        raise ValueError(f"context_lens must be >= 0, got {ctx}")
    if device is None:
        device = cu_seqlens_q.device if isinstance(cu_seqlens_q, torch.Tensor) else "cpu"
    tiles = torch.tensor(query_tiles(seg_lens, block_m), dtype=torch.int32).reshape(-1, TILE_FIELDS)
    return PrefillPlan(tuple(cu[:-1]), tuple(seg_lens), tuple(ctx), block_m, tiles.to(device))
