"""`SwapSpace`: a second block pool in CPU memory, and the copies that move a group's blocks there and back.

When the engine preempts a group by swapping, its K/V leave the accelerator's
pool for a CPU pool of the same block shape (the paper's "CPU block
allocator", Fig. 4), and come back when there is room again:

    swap_out(tables)   GPU blocks -> fresh CPU blocks, the GPU blocks freed,
                       every table rewritten to list CPU block ids
    swap_in(tables)    CPU blocks -> fresh GPU blocks, the CPU blocks freed,
                       every table rewritten to list GPU block ids again

The tables are one group's: n samples that may share blocks. The move keeps that sharing:
a GPU block listed by 3 tables is copied ONCE, to one CPU block that the 3 tables then list (CPU
refcount 3), and it comes back as one GPU block with refcount 3. Only the block ids change; `n_filled`
and the order of blocks in each table stay as they were, so a swapped-in sequence resumes decoding
exactly where it stopped.

Each direction is ONE indexed copy, however many blocks move (`_copy`):

    cpu_store[cpu_ids] = gpu_store[gpu_ids].to("cpu")     # swap out
    gpu_store[gpu_ids] = cpu_store[cpu_ids].to(device)     # swap in

On CUDA the CPU pool is pinned (page-locked) memory; on a CPU-only machine both pools live in the same
RAM and the "transfer" is a memcpy.
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
    n_tokens: int = 0      # tokens of K/V those blocks held (a block's empty tail is copied too)
    n_bytes: int = 0
    seconds: float = 0.0   # time spent in the copies (synchronised clock)


class SwapSpace:
    def __init__(self, gpu: BlockAllocator, n_blocks: int, batched: bool = True):
        """A CPU pool of `n_blocks` blocks shaped like `gpu`'s blocks (same layers, heads, block size, dtype).

        `batched=False` copies block by block instead (one transfer each, as vLLM v0 did): only for
        measuring what batching saves (preempt_demo's micro-benchmark).
        """
        # gpu.kv_store: [n_blocks, n_layers, 2, n_kv_heads, block_size, head_dim]
        _, n_layers, _, n_kv_heads, block_size, head_dim = gpu.kv_store.shape
        self.gpu = gpu
        self.device = gpu.kv_store.device
        # Page-locked only where there is a GPU to DMA from (pinning needs CUDA; a CPU-only pool gains nothing).
        # The GPU's DMA engine reads and writes pinned memory directly; from ordinary pageable memory the driver
        # first copies through a pinned bounce buffer of its own, and cannot overlap the copy with anything.
        self.pinned = self.device.type == "cuda"
        # Phase 3.1's pool, its free list and counts as they are; a pinned store is put in place of its own,
        # built on the meta device (no memory) so that the host never holds two.
        dtype = gpu.kv_store.dtype
        self.cpu = BlockAllocator(n_blocks, n_layers, n_kv_heads, head_dim, block_size,
                                  device="meta" if self.pinned else "cpu", dtype=dtype)
        if self.pinned:
            self.cpu.kv_store = torch.zeros(self.cpu.kv_store.shape, dtype=dtype, pin_memory=True)
        self.batched = batched
        self.out = SwapTraffic()
        self.into = SwapTraffic()
        self.n_fallbacks = 0     # swap-outs refused because the CPU pool was full (those groups are recomputed)

    @staticmethod
    def distinct_blocks(tables: list[BlockTable]) -> list[int]:
        """Every block the tables list, each once, in first-seen order."""
        return list(dict.fromkeys(b for t in tables for b in t.block_ids))

    def can_swap_out(self, tables: list[BlockTable]) -> bool:
        return self.cpu.can_alloc(len(self.distinct_blocks(tables)))

    def can_swap_in(self, tables: list[BlockTable], reserve: int = 0) -> bool:
        """Would the group's blocks fit in the GPU pool, leaving `reserve` blocks free?"""
        return self.gpu.can_alloc(len(self.distinct_blocks(tables)) + reserve)

    def try_swap_out(self, tables: list[BlockTable]) -> bool:
        """Swap a preempted group's tables out if the CPU pool has room for them; if not, count a fallback and
        say so (the engine recomputes the group instead)."""
        if not self.can_swap_out(tables):
            self.n_fallbacks += 1
            return False
        self.swap_out(tables)
        return True

    def swap_out(self, tables: list[BlockTable]) -> int:
        """Move the tables' blocks to the CPU pool; returns how many distinct blocks were copied."""
        return self._move(tables, self.gpu, self.cpu, self.out)

    def swap_in(self, tables: list[BlockTable]) -> int:
        """Move the tables' blocks back into the GPU pool; returns how many distinct blocks were copied."""
        return self._move(tables, self.cpu, self.gpu, self.into)

    def _move(self, tables: list[BlockTable], src: BlockAllocator, dst: BlockAllocator,
              traffic: SwapTraffic) -> int:
        holders = Counter(b for t in tables for b in t.block_ids)  # block -> tables of the group listing it
        blocks = list(holders)
        if not dst.can_alloc(len(blocks)):
            raise OutOfBlocks(f"cannot move {len(blocks)} blocks: the destination pool has {dst.n_free} free "
                              f"of {dst.n_blocks}")
        # One destination block per distinct source block, with one owner per
        # listing table: the group's sharing survives the move.
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
        for table in tables:
            for b in table.block_ids:
                src.free(b)  # this table's claim; a block another group also holds stays with it
            table.block_ids = [mapping[b] for b in table.block_ids]
        traffic.n_swaps += 1
        traffic.n_tokens += self._tokens_held(tables)
        traffic.n_blocks += len(blocks)
        traffic.n_bytes += len(blocks) * self.gpu.bytes_per_block
        return len(blocks)

    @staticmethod
    def _tokens_held(tables: list[BlockTable]) -> int:
        """Tokens stored in the tables' distinct blocks (logical block i of a table holds tokens i*bs...)."""
        filled: dict[int, int] = {}
        for t in tables:
            for i, b in enumerate(t.block_ids):
                filled[b] = max(filled.get(b, 0), min(t.block_size, t.n_filled - i * t.block_size))
        return sum(filled.values())

    def _copy(self, src_store: torch.Tensor, dst_store: torch.Tensor, src_ids: list[int], dst_ids: list[int]) -> None:
        """dst_store[dst_ids] = src_store[src_ids]: whole blocks, all layers, K and V, in one indexed copy.

        A gather on the source device, one transfer (through a pinned staging buffer), a scatter on the
        destination device, rather than one small transfer per block. vLLM v0 instead issued one
        `cudaMemcpyAsync` per block, which is why the paper's swapping slows down at small block sizes (many
        small PCIe transfers, §7.3); a gather first pays for small blocks with one extra on-device copy instead.
        A swap-in needs no wait: the copy is queued on the stream, and every kernel that reads those blocks
        later is queued after it. A swap-out must wait for its copy, because the CPU reads the blocks right
        after. (`SwapTraffic.seconds` reads a synchronised clock, so the time of both copies is measured
        either way.)
        """
        if not src_ids:
            return
        src_idx = torch.tensor(src_ids, dtype=torch.int64, device=src_store.device)   # [m]
        dst_idx = torch.tensor(dst_ids, dtype=torch.int64, device=dst_store.device)   # [m]
        shape = (len(src_ids), *src_store.shape[1:])  # [m, n_layers, 2, n_kv_heads, block_size, head_dim]
        if src_store.device == dst_store.device:      # a CPU-only machine: both pools in the same RAM
            dst_store.index_copy_(0, dst_idx, src_store.index_select(0, src_idx))
        elif dst_store.device.type == "cpu":          # swap out
            moved = torch.empty(shape, dtype=src_store.dtype, pin_memory=self.pinned)
            # Blocking: the CPU scatters these bytes on the next line, so it must wait for them anyway.
            moved.copy_(src_store.index_select(0, src_idx))
            dst_store.index_copy_(0, dst_idx, moved)
        else:                                         # swap in
            moved = torch.empty(shape, dtype=src_store.dtype, pin_memory=self.pinned)
            torch.index_select(src_store, 0, src_idx, out=moved)  # gathered straight into pinned memory
            # Asynchronous: the CPU blocks were read above, so they may be reused at once; kernels
            # that later read the GPU blocks run on the same stream, after the copy. (Torch keeps
            # `moved` from being handed out again until the copy is done.)
            dst_store.index_copy_(0, dst_idx, moved.to(dst_store.device, non_blocking=self.pinned))


class NoSwapSpace:
    """The recovery part of "recompute" mode: no CPU pool, so every preempted group is recomputed. It counts
    what `SwapSpace` counts (all zero), so the engine reads either part the same way."""
    cpu = None

    def __init__(self):
        self.out = SwapTraffic()
        self.into = SwapTraffic()
        self.n_fallbacks = 0

    def try_swap_out(self, tables: list[BlockTable]) -> bool:
        return False
