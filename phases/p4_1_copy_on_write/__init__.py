"""Phase 4.1 adds block sharing to phase 3.10's engine: sequences share KV blocks by reference count, and a shared block is copied only when written (copy-on-write), so n samples of one prompt store its K/V once.

Files:
- block_ops.py  fork a block table, copy-on-write before a write, one indexed copy for a step's copies
                (`CopyQueue`), `blocks_held` / `check_refcounts`
- kv.py         `CowKV(BlockKV)`: the KV part with forks and copy-on-write; `worst_case_blocks`
- engine.py     `SharingEngine(BatchedPagedEngine)` on 3.8's budget and 3.10's runner and sampler:
                `add_group(..., n=k)` prefills the prompt once and forks k samples over its blocks (`add()`
                is a group of one); `GroupWorstCaseAdmission`, phase 3.3's admission rule with shared
                blocks counted once (`worst_case_blocks`); `SequenceGroup`
- demo.py       `cow_demo`: the block tables of n samples right after the fork and after the copy-on-write
- README.md     the idea, its files, how to run it; its tables: docs/measurements/p4_1_copy_on_write.md
"""
