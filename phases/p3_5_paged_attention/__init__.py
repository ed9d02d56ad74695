"""Phase 3.5: a fused Triton paged decode-attention kernel reads K/V in place from the pool (no gather), for a whole batch at different lengths.

The engine: `engine.py`, `BatchedPagedEngine(PagedScheduler)`: phase 3.3's scheduler with one packed prefill
pass and one decode pass per step; a sequence's KV state is its bare block table. `attention.py` reroutes
transformers' attention through the pool; `runners.py` and `demo.py` put every engine side by side (`tput`,
`workload_bench`).

Kernel files:
- kernel_checks.py  input checks for attention and the K/V store
- reference.py      PyTorch references: paged attention via gather, SDPA on contiguous K/V, the K/V store
- kernels.py        Triton: paged decode attention (plus a split-KV variant) and the K/V store
- ops.py            what the engine imports: kernels on CUDA, references on CPU
- kernel_demo.py    `attn_bench`: paged kernel vs SDPA on contiguous K/V vs the reference
"""
