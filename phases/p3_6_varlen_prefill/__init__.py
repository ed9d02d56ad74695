"""Phase 3.6 adds varlen prefill and chunked prefill to phase 3.5's engine: ONE forward pass per step, decode tokens and prefill chunks together, each layer's prefill attention ONE kernel launch for the whole pack.

The kernel (plus its references, each the CPU path or a test oracle):
- plan.py       `plan_prefill`: each segment cut into query tiles (segment, first row) plus the host-side
                lengths; made once per forward pass, shared by every layer
- checks.py     input checks for the kernel, the references and the CPU path (built on 3.4's and 3.5's)
- reference.py  PyTorch: the fp32 oracle (gather + masked attention), SDPA over contiguous K/V (the second
                oracle), and the CPU path (one copy of the blocks read, one SDPA per segment)
- kernel.py     Triton: `paged_prefill_attention_triton`, flash-attention style over (query tile, head),
                K/V read in place through the block tables; causal, GQA, sliding window, softcap
- ops.py        what the engine imports: the kernel on CUDA, the CPU path on CPU
- pack.py       `random_prefill_pack`: a packed prefill in a scattered, NaN-padded pool, for tests and benchmarks
- aot_check.py  compiles the kernel for an H100 without one and reports registers, spills, shared memory
The engine built on it:
- attention.py  `varlen_attention_forward` (transformers' AttentionInterface): a mixed row of decode tokens
                (phase 3.5's decode kernel) and prefill chunks (the varlen kernel), `MixedBatch`
- engine.py     `ChunkedPrefillEngine(BatchedPagedEngine)`: a token budget per step (`max_num_batched_tokens`),
                prompts prefilled in chunks, one mixed pass per step
And:
- demo.py       `prefill_bench`: prefill tok/s (3.5's loop vs the varlen path vs contiguous SDPA/flash), the
                whole prefill pass per engine, streams' inter-token latency with and without chunking
- README.md     the idea, its files, how to run it; its tables: docs/measurements/p3_6_varlen_prefill.md
"""
