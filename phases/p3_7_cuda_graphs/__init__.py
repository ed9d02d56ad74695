"""Phase 3.7 adds a decode step at GPU speed to phase 3.6's engine: static buffers, batch buckets, CUDA graphs, a tuned decode kernel, sampling on the device.

The kernel:
- decode_kernel.py  Triton: paged decode attention in tiles of several blocks, scored with `tl.dot`, the
                    split count a grid axis (so one graph replays any context); `LaunchConfig`
- split_rule.py     programs per (sequence, KV head): batch x KV heads against the SMs, capped by the context
- merge_kernel.py   Triton: the split-KV merge (partials and log-sum-exps -> output) in one launch
- tuning.py         every launch config and split count timed on a GPU (the table behind DEFAULT_CONFIG)
- aot_check.py      every launch config and the merge compiled for an H100 without one: registers, spills, shared
The step:
- buffers.py        `DecodeBuffers`: the decode inputs in preallocated device tensors, updated from what changed
- attention.py      `static_attention_forward` (AttentionInterface): a decode pass over the buffers with the
                    tuned kernel; any other pass goes to phase 3.6's attention
- graph_capture.py  warm a call up on a side stream, then record it; the caller's stream put back if it fails
- graphs.py         `capture`: one decode pass recorded as a CUDA graph, in one small function
- sampler.py        greedy, temperature, top-k, top-p and per-request seeds for the whole batch on the device
                    (Gumbel-max over hashed noise), one host transfer
- engine.py         `StaticDecodeEngine(ChunkedPrefillEngine)`: decode steps padded to buckets and replayed
                    as graphs (eager on CPU), mixed passes as in phase 3.6
- overlap.py        `OverlappedDecodeEngine`: the host builds and launches step N+1 before reading step N's tokens
And:
- demo.py           `graph_bench`: the decode step eager vs static vs graph per batch size, the kernel against
                    phase 3.5's and SDPA (GB/s), and the tuning sweep
- README.md         the idea, its files, how to run it; its tables: docs/measurements/p3_7_cuda_graphs.md
"""
