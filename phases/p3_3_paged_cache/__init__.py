"""Phase 3.3 adds a paged KV cache to phase 2.3's scheduler: each sequence's K/V live in phase 3.1's shared pool, reached through its phase 3.2 block table.

A `PagedCache` (a drop-in `transformers.Cache`) writes each new token into the slot its `BlockTable`
assigns and hands attention a contiguous copy gathered block by block; greedy output is bit-identical
to `DynamicCache`. The files, in reading order: README.md.
"""
