"""`PrefixCachingEngine`: phase 4.1's engine with a `PrefixKV` (kv.py) on a `PrefixCachingAllocator`
(prefix_cache.py); scheduler, runner and sampler unchanged. `prefix_caching=False`: phase 4.1's engine, step
for step, the "off" side of a comparison."""

from __future__ import annotations

from phases.p3_1_block_allocator.allocator import BlockAllocator
from phases.p4_1_copy_on_write.engine import SharingEngine
from phases.p4_1_copy_on_write.kv import CowKV
from phases.p4_3_prefix_caching.kv import CacheStats, PrefixKV
from phases.p4_3_prefix_caching.prefix_cache import PrefixCachingAllocator

__all__ = ["PrefixCachingEngine", "CacheStats"]


class PrefixCachingEngine(SharingEngine):
    """Phase 4.1's engine (samples over shared blocks, copy-on-write) with automatic prefix caching."""

    def __init__(self, lm, *args, prefix_caching: bool = True, allocator: PrefixCachingAllocator | None = None,
                 **kwargs):
        # read by make_allocator and make_kv during phase 3.6's constructor
        self.prefix_caching, self.given_allocator = prefix_caching, allocator
        self.cache_stats = CacheStats()      # stays at zero with caching off
        super().__init__(lm, *args, **kwargs)

    def make_allocator(self, block_size: int, n_blocks: int | None) -> BlockAllocator:
        """A `PrefixCachingAllocator`, caching on or off (with nothing published it acts as phase 3.1's)."""
        if self.given_allocator is not None:
            return self.given_allocator
        return PrefixCachingAllocator.for_model(self.lm, block_size=block_size, n_blocks=n_blocks)

    def make_kv(self) -> CowKV:
        """`PrefixKV`; with caching off, phase 4.1's `CowKV`."""
        return PrefixKV(self.allocator, self.cache_stats) if self.prefix_caching else super().make_kv()
