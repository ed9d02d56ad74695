"""Phase 4.3: full KV blocks named by a chained hash of their tokens, reused so a shared prefix is prefilled once."""

from phases.p4_3_prefix_caching.block_hash import ROOT_HASH, chain_hashes, hash_block
from phases.p4_3_prefix_caching.engine import CacheStats, PrefixCachingEngine
from phases.p4_3_prefix_caching.evictor import Evictor
from phases.p4_3_prefix_caching.prefix_cache import CachedBlock, PrefixCachingAllocator, PrefixMatch

__all__ = ["ROOT_HASH", "chain_hashes", "hash_block", "Evictor", "CachedBlock", "PrefixMatch",
           "PrefixCachingAllocator", "CacheStats", "PrefixCachingEngine"]
