"""Phase 3.3 adds a paged KV cache to phase 2.3's scheduler: each sequence's K/V live in phase 3.1's shared pool, reached through its phase 3.2 block table.

Phase 2.3 gave every running sequence its own `DynamicCache`, a tensor that is
reallocated and copied one token longer on every forward pass. Here the K/V
of all sequences live in phase 3.1's pool, and a `PagedCache` (a drop-in
`transformers.Cache`) writes each new token into the slot its phase-3.2
`BlockTable` assigns, then hands attention a contiguous copy gathered block
by block. Greedy output is bit-identical to `DynamicCache`.

Files:
- paged_cache.py  `PagedCache(allocator)`: update() writes through the block table and gathers
- gather.py       `gather_python`: the per-block Python gather (one small copy per block: the slow part)
- scheduler.py    `PagedScheduler(ContinuousScheduler)`: continuous batching on one shared pool; a
                  sequence the pool cannot hold yet waits. The admission rule, one method per term:
                  `worst_case_tokens`, `blocks_to_admit`, `blocks_promised`, `can_admit`
- demo.py         `snapshot` (paged == DynamicCache, token for token), `grow_demo` (what one growing
                  sequence copies and allocates in each; measure/grow_bench.py) and `tput` (this phase's
                  engines, `TPUT_ENGINES`: `run_dynamic`, `run_paged`, handed to measure/tput.py)
- README.md       the idea, its files, how to run it; its tables: docs/measurements/p3_3_paged_cache.md
"""
