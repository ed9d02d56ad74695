"""Phase 3.5 adds paged decode attention to phase 3.4's gather: a fused Triton kernel reads every sequence's K/V in place from the pool through its block table (no gather, no padded copy), a whole batch at different lengths in one launch, plus a kernel that writes new K/V into the pool by slot.

- kernels.py        Triton: paged decode attention and the K/V store
- reference.py      the PyTorch oracle: paged attention via phase 3.4's gather, in fp32
- ops.py            what an engine imports: kernels on CUDA, PyTorch paths on CPU (extras/p3_5_paged_attention/)
- kernel_checks.py  input checks for attention and the K/V store
- demo.py           `attn_bench`: one layer's decode attention, the kernel vs SDPA vs the references
- README.md         the idea, its files, how to run it; its tables: docs/measurements/p3_5_paged_attention.md
"""
