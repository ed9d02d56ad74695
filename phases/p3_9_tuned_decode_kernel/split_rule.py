"""How many programs share one (sequence, KV head) in the decode kernel: the split-KV rule.

The grid is batch x n_kv_heads x n_splits; HBM is busy only when every SM has programs streaming K/V. So:

- batch x n_kv_heads >= PROGRAMS_PER_SM x SMs: the GPU is full, split nothing (a split costs an fp32
  partial and a merge);
- otherwise split the context into enough pieces to fill it, none shorter than MIN_BLOCKS_PER_SPLIT
  blocks (below that the merge costs more than the parallelism buys), at most MAX_SPLITS;
- round down to a power of two, so a CUDA-graph engine captures few grids per batch bucket.

On a CPU (no SMs; the PyTorch path ignores splits): one split. The constants come from
`python -m measure.decode_tuning` on an H100.
"""

from __future__ import annotations

import torch

PROGRAMS_PER_SM = 1          # split only while batch x KV heads leaves SMs idle (the tuning sweep)
MIN_BLOCKS_PER_SPLIT = 128   # blocks (2,048 tokens of 16-token blocks) a split reads at the least
MAX_SPLITS = 16


def floor_power_of_two(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def choose_splits(batch: int, n_kv_heads: int, n_sms: int, context_blocks: int) -> int:
    """Programs per (sequence, KV head) for a decode launch over `batch` sequences of at most
    `context_blocks` blocks, on a GPU of `n_sms` SMs (0: not a GPU)."""
    programs = batch * n_kv_heads
    if n_sms <= 0 or programs >= PROGRAMS_PER_SM * n_sms:
        return 1
    wanted = PROGRAMS_PER_SM * n_sms // max(programs, 1)
    by_context = context_blocks // MIN_BLOCKS_PER_SPLIT
    return floor_power_of_two(min(wanted, by_context, MAX_SPLITS))


def sm_count(device: torch.device | str) -> int:
    """The GPU's streaming multiprocessors (0 on a CPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count
