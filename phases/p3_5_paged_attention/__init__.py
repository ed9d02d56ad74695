"""Phase 3.5 adds paged attention to phase 3.3's scheduler: a fused Triton decode-attention kernel reads K/V in place from the pool (no gather), so one forward pass serves every running sequence.

Two groups of modules, then the demo. The kernels (each with a PyTorch
reference that is the CPU path and the test oracle):
- kernel_checks.py  input checks for attention and the K/V store
- reference.py      PyTorch references: paged attention via gather, SDPA on contiguous K/V, the K/V store
- kernels.py        Triton: paged decode attention (plus a split-KV variant) and the K/V store
- plans.py          the CPU paths' per-pass index arithmetic (`WritePlan`, `DecodePlan`), made once per pass
- ops.py            what the engine imports: kernels on CUDA, references on CPU
The engine built on them:
- attention.py      transformers' attention rerouted through the pool (`AttentionInterface`, `PagedBatch`)
- engine.py         `BatchedPagedEngine(PagedScheduler)`: one packed prefill pass and one decode pass per
                    step; a sequence's KV state is its bare block table
And:
- demo.py           `attn_bench` (the kernel vs SDPA vs the references), `tput` and `workload_bench` (every
                    engine side by side, through measure/tput.py and measure/workload_bench.py), and this
                    phase's engine runner `BATCHED`
- README.md         the idea, its files, how to run it; its tables: docs/measurements/p3_5_paged_attention.md
"""
