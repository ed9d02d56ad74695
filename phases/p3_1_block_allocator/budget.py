"""How many KV blocks fit: the pool is sized once, at startup, from a memory budget.

One block holds `block_size` tokens' K and V for every layer, so

    bytes/block = n_layers * 2 * n_kv_heads * block_size * head_dim * itemsize

(2 = one K and one V row per token per layer per KV head). For SmolLM2-135M
in bf16 at block_size 16: 30 * 2 * 3 * 16 * 64 * 2 = 368,640 bytes = 360 KiB.

    n_blocks = budget_bytes // bytes/block

where the budget is
- on CUDA: `memory_fraction` (the blog uses 80%) of the memory still free
  after the model's weights were loaded (`torch.cuda.mem_get_info`); the other
  20% is head-room for activations and the allocator's own slack;
- on CPU: a stated number of bytes (`DEFAULT_CPU_KV_BUDGET`, 1 GiB), because
  "free RAM" on a shared machine is neither stable nor ours to take.
"""

from __future__ import annotations

import torch

GiB = 1024 ** 3
MiB = 1024 ** 2
# The blog's choice: hand 80% of the memory left after model load to the KV pool.
DEFAULT_MEMORY_FRACTION = 0.8
# What the pool may take on a CPU, where we state a budget instead of measuring one.
DEFAULT_CPU_KV_BUDGET = 1 * GiB
KV_PER_TOKEN_LAYER = 2  # one K row and one V row


def bytes_per_block(n_layers: int, n_kv_heads: int, head_dim: int, block_size: int,
                    dtype: torch.dtype) -> int:
    """Bytes one block occupies in the pool: a [n_layers, 2, n_kv_heads, block_size, head_dim] slice."""
    return n_layers * KV_PER_TOKEN_LAYER * n_kv_heads * block_size * head_dim * dtype.itemsize


def kv_budget_bytes(device: str | torch.device, memory_fraction: float = DEFAULT_MEMORY_FRACTION,
                    cpu_budget_bytes: int = DEFAULT_CPU_KV_BUDGET) -> tuple[int, str]:
    """(bytes the pool may use, one line saying where that number came from)."""
    device = torch.device(device)
    if device.type == "cuda":
        if not 0 < memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
        free, total = torch.cuda.mem_get_info(device)
        budget = int(free * memory_fraction)
        why = (f"{memory_fraction:.0%} of the {free / GiB:.2f} GiB free after model load "
               f"(of {total / GiB:.2f} GiB on the GPU)")
        return budget, why
    if cpu_budget_bytes <= 0:
        raise ValueError(f"cpu_budget_bytes must be > 0, got {cpu_budget_bytes}")
    return int(cpu_budget_bytes), f"a stated CPU budget of {cpu_budget_bytes / MiB:,.0f} MiB"


def budget_n_blocks(n_layers: int, n_kv_heads: int, head_dim: int, block_size: int,
                    dtype: torch.dtype, device: str | torch.device,
                    memory_fraction: float = DEFAULT_MEMORY_FRACTION,
                    cpu_budget_bytes: int = DEFAULT_CPU_KV_BUDGET) -> int:
    """How many blocks the pool gets: budget // bytes per block (see the module docstring)."""
    per_block = bytes_per_block(n_layers, n_kv_heads, head_dim, block_size, dtype)
    budget, why = kv_budget_bytes(device, memory_fraction, cpu_budget_bytes)
    n_blocks = budget // per_block
    if n_blocks < 1:
        raise ValueError(f"the KV budget ({why}: {budget:,} bytes) does not hold even one block "
                         f"of {per_block:,} bytes; raise the budget or lower block_size")
    return n_blocks
