"""Phase 3.1 adds one KV pool to phase 2.3: allocated once, carved into fixed-size blocks, handed out from a free list with reference counts.

Phase 2 gave every sequence its own growing `DynamicCache`. From here on the
KV cache lives in a single pool tensor
`[n_blocks, n_layers, 2, n_kv_heads, block_size, head_dim]`, and a sequence
owns a handful of blocks, wherever they are in the pool.

Files:
- allocator.py  `BlockAllocator` (alloc / free / incref / refcount), `OutOfBlocks`, `AllocatorError`,
                and `blocks_for` (tokens -> blocks, rounded up: the one ceiling division)
- budget.py     `budget_n_blocks`: the pool sized from the memory left after model load (CUDA) or a
                stated budget (CPU)
- demo.py       `alloc_demo`: blocks used by paging vs a static reservation, on the latency workload's
                real prompt/output token counts (`workload`, `workload_options`)
- README.md     the idea, its files, how to run it; its tables: docs/measurements/p3_1_block_allocator.md
"""

from phases.p3_1_block_allocator.allocator import (DEFAULT_BLOCK_SIZE, AllocatorError, BlockAllocator,
                                                   OutOfBlocks, blocks_for)
from phases.p3_1_block_allocator.budget import (DEFAULT_CPU_KV_BUDGET, DEFAULT_MEMORY_FRACTION,
                                                budget_n_blocks, bytes_per_block, kv_budget_bytes)

__all__ = ["BlockAllocator", "OutOfBlocks", "AllocatorError", "DEFAULT_BLOCK_SIZE", "blocks_for", "budget_n_blocks",
           "bytes_per_block", "kv_budget_bytes", "DEFAULT_CPU_KV_BUDGET", "DEFAULT_MEMORY_FRACTION"]
