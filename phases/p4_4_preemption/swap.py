"""`SwapSpace`: a second block pool in CPU memory (the paper's "CPU block allocator", Fig. 4), and the copies
that move a preempted group's blocks there and back. Sharing survives (a block listed by 3 tables is copied ONCE,
to one block of refcount 3); only block ids change, so a swapped-in sequence resumes where it stopped.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from common.clock import now, sync
from phases.p3_1_block_allocator.allocator import BlockAllocator, OutOfBlocks
from phases.p3_2_block_table.block_table import BlockTable


@dataclass
class SwapTraffic:
    """What crossed between the pools, one direction."""
    n_swaps: int = 0       # groups moved
    n_blocks: int = 0      # distinct blocks copied (a shared block counts once)
    n_tokens: int = 0      # tokens of K/V those blocks held
    n_bytes: int = 0
    seconds: float = 0.0   # time spent in the copies (synchronised clock)


class SwapSpace:
    def __init__(self, gpu: BlockAllocator, n_blocks: int, batched: bool = True):
        """A CPU pool shaped like `gpu`'s. `batched=False` copies block by block (vLLM v0), only to measure."""
        # gpu.kv_store: [n_blocks, n_layers, 2, n_kv_heads, block_size, head_dim]
        _, n_layers, _, n_kv_heads, block_size, head_dim = gpu.kv_store.shape
        self.gpu = gpu
        self.device = gpu.kv_store.device
        # Pinned only where a GPU DMAs from it: from pageable memory the driver copies through a bounce buffer.
        self.pinned = self.device.type == "cuda"
        dtype = gpu.kv_store.dtype
        # Phase 3.1's pool as it is; a pinned one is built on "meta" first so the host never holds two stores.
        self.cpu = BlockAllocator(n_blocks, n_layers, n_kv_heads, head_dim, block_size,
                                  device="meta" if self.pinned else "cpu", dtype=dtype)
        if self.pinned:
            self.cpu.kv_store = torch.zeros(self.cpu.kv_store.shape, dtype=dtype, pin_memory=True)
        self.batched = batched
        self.out, self.into = SwapTraffic(), SwapTraffic()
        self.n_fallbacks = 0     # swap-outs refused because the CPU pool was full (those groups are recomputed)

    def can_swap_in(self, tables: list[BlockTable], reserve: int = 0) -> bool:
        return self.gpu.can_alloc(len(set(b for t in tables for b in t.block_ids)) + reserve)

    def try_swap_out(self, tables: list[BlockTable]) -> bool:
        """Swap the tables out if the CPU pool has room; if not, count a fallback (the engine recomputes)."""
        if not self.cpu.can_alloc(len(set(b for t in tables for b in t.block_ids))):
            self.n_fallbacks += 1
            return False
        self.swap_out(tables)
        return True

    def swap_out(self, tables: list[BlockTable]) -> int:
        return self._move(tables, self.gpu, self.cpu, self.out)

    def swap_in(self, tables: list[BlockTable]) -> int:
        return self._move(tables, self.cpu, self.gpu, self.into)

    def _move(self, tables: list[BlockTable], src: BlockAllocator, dst: BlockAllocator, traffic: SwapTraffic) -> int:
        """Move the tables' blocks from `src` to `dst`; returns how many distinct blocks were copied."""
        holders = Counter(b for t in tables for b in t.block_ids)  # block -> tables of the group listing it
        blocks = list(holders)
        if not dst.can_alloc(len(blocks)):
            raise OutOfBlocks(f"cannot move {len(blocks)} blocks: the destination pool has {dst.n_free} free "
                              f"of {dst.n_blocks}")
        mapping = {b: dst.alloc() for b in blocks}
        for b, n_tables in holders.items():
            for _ in range(n_tables - 1):
                dst.incref(mapping[b])
        start = now(self.device)
        if self.batched:
            self._copy(src.kv_store, dst.kv_store, blocks, [mapping[b] for b in blocks])
        else:
            for b in blocks:  # one small transfer per block, queued without waiting (vLLM v0's cudaMemcpyAsync)
                dst.kv_store[mapping[b]].copy_(src.kv_store[b], non_blocking=self.pinned)
            sync(self.device)  # every queued copy has landed before either pool's blocks are read or reused
        traffic.seconds += now(self.device) - start
        filled: dict[int, int] = {}   # block -> tokens it holds (logical block i holds tokens i*bs ...)
        for table in tables:
            for i, b in enumerate(table.block_ids):
                filled[b] = max(filled.get(b, 0), min(table.block_size, table.n_filled - i * table.block_size))
                src.free(b)  # this table's claim; a block another group also holds stays with it
            table.block_ids = [mapping[b] for b in table.block_ids]
        traffic.n_swaps += 1
        traffic.n_tokens += sum(filled.values())
        traffic.n_blocks += len(blocks)
        traffic.n_bytes += len(blocks) * self.gpu.bytes_per_block
        return len(blocks)

    def _copy(self, src_store: torch.Tensor, dst_store: torch.Tensor, src_ids: list[int], dst_ids: list[int]) -> None:
        """dst_store[dst_ids] = src_store[src_ids], whole blocks: a gather, ONE transfer, a scatter (vLLM v0 issued
        one copy per block, why the paper's swapping slows at small blocks, §7.3). A swap-in is only queued."""
        if not src_ids:
            return
        src_idx = torch.tensor(src_ids, dtype=torch.int64, device=src_store.device)   # [m]
        dst_idx = torch.tensor(dst_ids, dtype=torch.int64, device=dst_store.device)   # [m]
        shape = (len(src_ids), *src_store.shape[1:])  # [m, n_layers, 2, n_kv_heads, block_size, head_dim]
        if src_store.device == dst_store.device:      # a CPU-only machine: both pools in the same RAM
            dst_store.index_copy_(0, dst_idx, src_store.index_select(0, src_idx))
            return
        moved = torch.empty(shape, dtype=src_store.dtype, pin_memory=self.pinned)
        if dst_store.device.type == "cpu":            # swap out: blocking, the CPU reads the bytes next
            moved.copy_(src_store.index_select(0, src_idx))
            dst_store.index_copy_(0, dst_idx, moved)
        else:                                         # swap in: gathered straight into pinned memory, sent async
            torch.index_select(src_store, 0, src_idx, out=moved)
            dst_store.index_copy_(0, dst_idx, moved.to(dst_store.device, non_blocking=self.pinned))


class NoSwapSpace:
    """Recompute mode's recovery part: no CPU pool; it counts what `SwapSpace` counts (all zero)."""
    cpu = None
    def __init__(self):
        self.out, self.into = SwapTraffic(), SwapTraffic()
        self.n_fallbacks = 0

    def try_swap_out(self, tables: list[BlockTable]) -> bool:
        return False
