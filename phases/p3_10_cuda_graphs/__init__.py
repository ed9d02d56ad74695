"""Phase 3.10 adds a decode step at GPU speed to phase 3.8's engine: static buffers, buckets, graphs, device sampling.

The decode pass runs phase 3.9's tuned kernel, whose split count is a grid axis, so one graph replays any context.
The step:
- buffers.py        `DecodeBuffers`: the decode inputs in preallocated device tensors, updated from what changed
- attention.py      `static_attention_forward` (AttentionInterface): a decode pass over the buffers with the
                    tuned kernel; any other pass goes to phase 3.8's attention
- runner.py         `StaticRunner(MixedRunner)`: a decode-only batch over the buffers, padded to its bucket
- graphs.py         `capture`: one decode pass recorded as a CUDA graph, in one small function
- graph_capture.py  warm a call up on a side stream, then record it; the caller's stream put back if it fails
- sampler.py        greedy, temperature, top-k, top-p and per-request seeds for the whole batch on the device
                    (Gumbel-max over hashed noise), one host transfer
- engine.py         `StaticDecodeEngine(ChunkedPrefillEngine)`: decode steps padded to buckets and replayed
                    as graphs (eager on CPU), mixed passes as in phase 3.8
And:
- extra_overlap.py  `OverlappedDecodeEngine`: the host builds and launches step N+1 before reading step N's tokens
                    (`OverlapBuffers`: rows whose next token is on the device only)
- demo.py           `graph_bench`: the decode step eager vs static vs graph per batch size, with phase 3.9's
                    kernel sections; `graph_workload`: the engine among the others
- README.md         the idea, its files, how to run it; its tables: docs/measurements/p3_10_cuda_graphs.md
"""
