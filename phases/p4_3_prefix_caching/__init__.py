"""Phase 4.3 adds automatic prefix caching to phase 4.1's engine: full KV blocks are named by a chained hash of their tokens and reused by later requests, so a shared prompt prefix is prefilled once.

Files:
- block_hash.py    `hash_block(parent_hash, tokens)` and `chain_hashes`: a full block's name covers every
                   token before it
- evictor.py       `Evictor`, the order in which unused cached blocks give their memory back (least
                   recently used, then the deepest prefix first)
- prefix_cache.py  `PrefixCachingAllocator`, phase 3.1's allocator plus the global `hash -> CachedBlock`
                   table and a third block state, cached-free
- kv.py            `PrefixKV(CowKV)`: the KV part that maps cached prompt blocks in, publishes new full
                   ones after each pass and discounts held hits in admission; `CacheStats`
- engine.py        `PrefixCachingEngine(SharingEngine)`: phase 4.1's engine on a `PrefixCachingAllocator`,
                   with `PrefixKV` (on by default; `prefix_caching=False` chooses `CowKV`)
- demo.py          `prefix_demo`, one-shot and few-shot system prompts with and without the cache: hit
                   rate, prefill tokens skipped, TTFT, throughput
- README.md        the idea, its files, how to run it; its tables: docs/measurements/p4_3_prefix_caching.md
"""

from phases.p4_3_prefix_caching.block_hash import ROOT_HASH, chain_hashes, hash_block
from phases.p4_3_prefix_caching.engine import CacheStats, PrefixCachingEngine
from phases.p4_3_prefix_caching.evictor import Evictor
from phases.p4_3_prefix_caching.prefix_cache import CachedBlock, PrefixCachingAllocator, PrefixMatch

__all__ = ["ROOT_HASH", "chain_hashes", "hash_block", "Evictor", "CachedBlock", "PrefixMatch",
           "PrefixCachingAllocator", "CacheStats", "PrefixCachingEngine"]
