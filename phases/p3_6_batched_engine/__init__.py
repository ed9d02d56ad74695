"""Phase 3.6 adds the batched engine to phase 3.5's kernels: continuous batching in ONE forward pass per step for every running sequence, an unmodified Hugging Face model's attention writing and reading the block pool; a sequence's KV state is its bare block table.

The engine, in four parts (the fourth, the sampler, is common/sampling.py):
- engine.py         `BatchedPagedEngine`: the scheduler part (waiting queue, running set, the admission
                    loop) and the step: schedule, run, sample, update; `WorstCaseAdmission`: phase 3.3's
                    admission rule, a part the loop asks
- kv.py             `BlockKV`: a block table per sequence; claims slots, frees blocks, counts for admission
- runner.py         `Chunk`, `Batch`, `PagedRunner`: one packed prefill pass and one decode pass per step
- attention.py      transformers' attention rerouted through the pool (`AttentionInterface`, `PagedBatch`,
                    `use_paged_attention`); what the pool cannot compute is refused by name
And:
- demo.py           `tput` and `workload_bench` (every engine side by side, through measure/tput.py and
                    measure/workload_bench.py), and this phase's engine runner `BATCHED`
- README.md         the idea, its files, how to run it; its tables: docs/measurements/p3_6_batched_engine.md
"""
