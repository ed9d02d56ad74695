"""Phase 4.1: sequences share KV blocks by reference count, and a shared block is copied only when written
(copy-on-write), so n samples of one prompt store its K/V once.

Files: block_ops.py (fork, copy-on-write, `CopyQueue`), kv.py (`CowKV`, the KV part), engine.py
(`SharingEngine`, `add_group(..., n=k)`), demo.py (`cow_demo`).
"""
