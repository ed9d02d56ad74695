"""Phase 4.3: automatic prefix caching on phase 4.1's engine: full KV blocks are named by a chained hash of
their tokens and reused by later requests, so a shared prompt prefix is prefilled once.

Files, in reading order: block_hash.py (a block's name), evictor.py (which unused block goes first),
prefix_cache.py (the allocator's third block state and hash table), kv.py (`PrefixKV`, the KV part),
engine.py (`PrefixCachingEngine`), demo.py (`prefix_demo`).
"""

from phases.p4_3_prefix_caching.block_hash import ROOT_HASH, chain_hashes, hash_block
from phases.p4_3_prefix_caching.engine import CacheStats, PrefixCachingEngine
from phases.p4_3_prefix_caching.evictor import Evictor
from phases.p4_3_prefix_caching.prefix_cache import CachedBlock, PrefixCachingAllocator, PrefixMatch

__all__ = ["ROOT_HASH", "chain_hashes", "hash_block", "Evictor", "CachedBlock", "PrefixMatch",
           "PrefixCachingAllocator", "CacheStats", "PrefixCachingEngine"]
