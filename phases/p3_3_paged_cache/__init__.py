"""Paged KV cache: each sequence's K/V live in a shared pool of fixed-size blocks, reached through its block table.

Phase 2.3 gave every running sequence its own `DynamicCache`, a tensor that is
reallocated and copied one token longer on every forward pass. Here the K/V
of all sequences live in phase 3.1's pool, and a `PagedCache` (a drop-in
`transformers.Cache`) writes each new token into the slot its phase-3.2
`BlockTable` assigns, then hands attention a contiguous copy gathered block
by block. Greedy output is bit-identical to `DynamicCache`.

- `paged_cache.py`  `PagedCache(allocator)`: update() writes through the block table and gathers
- `gather.py`       `gather_python`: the per-block Python gather (the slow part phase 3.4 replaces)
- `scheduler.py`    `PagedScheduler(lm, max_running, block_size, n_blocks)`: continuous batching on
                    one shared pool; a sequence the pool cannot hold yet waits
- `tput.py`         the `tput` measurement: `EngineRunner`, `measure`, `run_tput`, `TPUT_ENGINES`
- `demo.py`         `snapshot` (paged == DynamicCache, token for token) and `tput`
"""
