"""Phase 3.9 adds a tuned paged decode kernel to phase 3.5's: tiles of blocks, tensor-core dots, a split-KV rule.

- decode_kernel.py  Triton: paged decode attention in tiles of several blocks, scored with `tl.dot`, the
                    split count a grid axis fixed per launch; `LaunchConfig`, `launch_config`
- merge_kernel.py   Triton: the split-KV merge (partials and log-sum-exps -> output) in one launch
- split_rule.py     programs per (sequence, KV head): batch x KV heads against the SMs, capped by the context
- demo.py           `decode_bench`: the kernel beside SDPA and phase 3.5's (measure/decode_bench.py)
- README.md         the idea, its files, how to run it; its tables: docs/measurements/p3_9_tuned_decode_kernel.md
The launch sweep (measure/decode_tuning.py) and the sm_90 compile check (measure/decode_aot_check.py) live in measure/.
"""
