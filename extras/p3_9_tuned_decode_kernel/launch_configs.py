"""Phase 3.9's decode kernel's launch table: blocks per key tile, warps and stages per (fp32?, head_dim). Speed only.

Any entry computes the same answer; an entry only decides how fast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LaunchConfig:
    """How one launch is cut: blocks per key tile, warps per program, loop trips in flight."""
    tile_blocks: int = 4
    num_warps: int = 2
    num_stages: int = 3

    def tile_blocks_for(self, block_size: int, min_keys: int) -> int:
        """At least `min_keys` keys per tile (a pool of 8-token blocks reads 2 per trip for 16)."""
        return max(self.tile_blocks, -(-min_keys // block_size))


# The fastest config on an H100 for Qwen3-0.6B's shape in bf16 at batch 32-256 (measure/decode_tuning.py).
DEFAULT_CONFIG = LaunchConfig(tile_blocks=4, num_warps=2, num_stages=3)

# Where DEFAULT_CONFIG spills registers (fp32, or head_dim 256), the same tile over more warps: the first
# count that compiled for an H100 without a spill (measure/decode_aot_check.py).
LAUNCH_CONFIGS = {
    (False, 128): DEFAULT_CONFIG,
    (False, 256): LaunchConfig(tile_blocks=4, num_warps=4, num_stages=3),
    (True, 128): LaunchConfig(tile_blocks=4, num_warps=8, num_stages=3),
    (True, 256): LaunchConfig(tile_blocks=4, num_warps=16, num_stages=3),
}


def launch_config(head_dim: int, dtype: torch.dtype) -> LaunchConfig:
    """The smallest entry of LAUNCH_CONFIGS covering head_dim (past 256: the most warps for that dtype)."""
    fp32 = dtype == torch.float32
    sizes = sorted(largest for is_fp32, largest in LAUNCH_CONFIGS if is_fp32 == fp32)
    return LAUNCH_CONFIGS[fp32, next((n for n in sizes if head_dim <= n), sizes[-1])]
