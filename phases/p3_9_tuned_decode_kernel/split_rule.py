"""How many programs share one (sequence, KV head) in the decode kernel: the split-KV rule.

The decode kernel's grid is batch x n_kv_heads x n_splits. Each program streams
its share of K/V from HBM, and HBM is only kept busy when every SM has a few
programs to switch between while their loads are in flight. So:

- batch x n_kv_heads already >= PROGRAMS_PER_SM x SMs: the GPU is full, split nothing
  (a split costs a partial output in fp32 and a merge);
- otherwise split each sequence's context into enough pieces to get there, but
  never pieces shorter than MIN_BLOCKS_PER_SPLIT blocks (below that the merge and
  the per-program start cost more than the extra parallelism buys), and at most
  MAX_SPLITS;
- the count is rounded down to a power of two, so a CUDA-graph engine captures at
  most log2(MAX_SPLITS) + 1 graphs per batch bucket (the count changes with the
  context length, and a graph replays one grid).

On a CPU there are no SMs to fill (the PyTorch path ignores splits): one split.
The constants are what the split sweep (`python -m measure.decode_tuning`)
measured on an H100.
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
