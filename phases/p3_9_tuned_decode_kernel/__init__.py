"""Phase 3.9 adds a tuned paged decode kernel to phase 3.5's: tiles of blocks, tensor-core dots, a split-KV rule.

- decode_kernel.py  Triton: paged decode attention in tiles of several blocks, scored with `tl.dot`, the
                    split count a grid axis fixed per launch; `LaunchConfig`, `launch_config`
- merge_kernel.py   Triton: the split-KV merge (partials and log-sum-exps -> output) in one launch
- split_rule.py     programs per (sequence, KV head): batch x KV heads against the SMs, capped by the context
- bench.py          the kernel beside SDPA and phase 3.5's kernel (ms, GB/s, share of HBM), and the sweep's table
- demo.py           `decode_bench`: bench.py's two tables as this phase's demo
- aot_check.py      every launch config and the merge compiled for an H100 without one: registers, spills, shared
And:
- tuning.py         every launch config and split count timed on a GPU (the table behind DEFAULT_CONFIG)
- README.md         the idea, its files, how to run it; its tables: docs/measurements/p3_9_tuned_decode_kernel.md
"""
