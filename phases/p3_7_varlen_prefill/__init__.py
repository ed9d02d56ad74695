"""Phase 3.7 adds a varlen paged prefill kernel to phase 3.5's decode kernel: every prompt of a packed prefill attended in ONE launch per layer, each prompt's K/V read in place from the pool.

The kernel, plus its references (each the CPU path or a test oracle):
- plan.py       `plan_prefill`: each segment cut into query tiles (segment, first row) plus the host-side
                lengths; made once per forward pass, shared by every layer
- checks.py     input checks for the kernel, the references and the CPU path (built on 3.4's and 3.5's)
- reference.py  PyTorch: the fp32 oracle (gather + masked attention), SDPA over contiguous K/V (the second
                oracle), and the CPU path (one copy of the blocks read, one SDPA per segment)
- kernel.py     Triton: `paged_prefill_attention_triton`, flash-attention style over (query tile, head),
                K/V read in place through the block tables; causal, GQA, sliding window, softcap
- ops.py        what an engine imports: the kernel on CUDA, the CPU path on CPU
And:
- pack.py       `random_prefill_pack`: a packed prefill in a scattered, NaN-padded pool, for tests and benchmarks
- aot_check.py  compiles the kernel for an H100 without one and reports registers, spills, shared memory
- demo.py       `varlen_bench`: one layer's attention over packed prefills, phase 3.6's per-segment loop beside
                this phase's one call and no paging at all (measure/prefill_attention.py's table)
- README.md     the idea, its files, how to run it; its tables: docs/measurements/p3_7_varlen_prefill.md
"""
