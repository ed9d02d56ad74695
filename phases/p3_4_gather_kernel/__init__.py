"""Phase 3.4: gather many sequences' K/V from the block pool in one Triton launch instead of a Python loop per block.

Files:
- checks.py     input checks shared by every paged kernel and reference
- reference.py  `gather_reference`: the batched gather as one torch indexing op (CPU path, oracle)
- kernel.py     `gather_triton`: the same gather as a Triton kernel, grid (sequence, block, KV head)
- dispatch.py   `gather_kv`: kernel on CUDA, reference on CPU (said once)
- demo.py       `gather_bench`: Python per-block gather vs reference vs kernel
"""
