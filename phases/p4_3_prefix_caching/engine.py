"""`PrefixCachingEngine`: phase 4.1's engine, with prompts that start with cached blocks skipping their prefill.

The whole phase is a KV part, `PrefixKV` (kv.py): admission does not count a
cached block someone else holds, a new table maps the cached prefix in and
its prefill starts past it, full blocks are published once written, and a
fork continues its parent's chain of hashes. The scheduler, runner and
sampler are phase 4.1's, unchanged.

`PrefixCachingEngine(lm, prefix_caching=False)` chooses phase 4.1's `CowKV`
instead: phase 4.1's engine, step for step, as the "off" side of a comparison.

Known limit: requests admitted in the same step all look the cache up before
any of them has computed anything, so N requests arriving together with one
new system prompt all compute it; requests admitted in later steps hit.
"""

from __future__ import annotations

from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE, BlockAllocator
from phases.p4_1_copy_on_write.engine import SharingEngine
from phases.p4_3_prefix_caching.kv import CacheStats, PrefixKV
from phases.p4_3_prefix_caching.prefix_cache import PrefixCachingAllocator

__all__ = ["PrefixCachingEngine", "CacheStats", "prefix_cache_pool", "use_prefix_cache"]


def prefix_cache_pool(lm, prefix_caching: bool, block_size: int, n_blocks: int | None,
                      allocator: BlockAllocator | None) -> BlockAllocator | None:
    """The pool an engine with a prefix cache needs: a `PrefixCachingAllocator`, unless one is given or the
    cache is off (None: the engine makes its usual pool)."""
    if prefix_caching and allocator is None:
        return PrefixCachingAllocator.for_model(lm, block_size=block_size, n_blocks=n_blocks)
    return allocator


def use_prefix_cache(engine, prefix_caching: bool) -> None:
    """Give `engine` the prefix-cache KV part (`PrefixKV`), or leave it phase 4.1's `CowKV` when off."""
    engine.prefix_caching = prefix_caching
    engine.cache_stats = CacheStats()      # stays at zero with caching off
    if prefix_caching:
        engine.kv = PrefixKV(engine.allocator, engine.cache_stats)


class PrefixCachingEngine(SharingEngine):
    """Phase 4.1's engine (samples over shared blocks, copy-on-write) with automatic prefix caching."""

    def __init__(self, lm, *, prefix_caching: bool = True, block_size: int = DEFAULT_BLOCK_SIZE,
                 n_blocks: int | None = None, allocator: BlockAllocator | None = None, **engine_kwargs):
        allocator = prefix_cache_pool(lm, prefix_caching, block_size, n_blocks, allocator)
        super().__init__(lm, block_size=block_size, n_blocks=n_blocks, allocator=allocator, **engine_kwargs)
        use_prefix_cache(self, prefix_caching)
