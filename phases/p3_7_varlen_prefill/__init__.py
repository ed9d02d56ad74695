"""Phase 3.7 adds a varlen paged prefill kernel to phase 3.5's decode kernel: every prompt of a packed prefill attended in ONE launch per layer, each prompt's K/V read in place from the pool.

- plan.py       `plan_prefill`: each segment cut into query tiles (segment, first row) plus the host-side
                lengths; made once per forward pass, shared by every layer
- checks.py     input checks for the kernel and the references (built on 3.4's and 3.5's)
- reference.py  PyTorch: the fp32 oracle (gather + masked attention)
- kernel.py     Triton: `paged_prefill_attention_triton`, flash-attention style over (query tile, head),
                K/V read in place through the block tables; causal, GQA, sliding window, softcap
- ops.py        what an engine imports: the kernel on CUDA, a PyTorch path on CPU (in extras/)
- demo.py       `varlen_bench`: phase 3.6's per-segment loop beside this phase's one call
- README.md     the idea, its files, how to run it; its tables: docs/measurements/p3_7_varlen_prefill.md
"""
