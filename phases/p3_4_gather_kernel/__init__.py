"""Phase 3.4 adds a Triton gather to phase 3.3: many sequences' K/V read from the block pool in one launch instead of a Python loop per block.

Files:
- checks.py       input checks shared by every paged kernel and reference
- reference.py    `gather_reference`: the batched gather as one torch indexing op (CPU path, oracle)
- kernel.py       `gather_triton`: the same gather as a Triton kernel, grid (sequence, block, KV head);
                  `use_interpreter_without_gpu`: runs Triton kernels on a CPU, in Triton's interpreter
- dispatch.py     `gather_kv` / `use_kernels`: kernel on CUDA, reference on CPU (said once)
- demo.py         `gather_bench`: Python per-block gather vs reference vs kernel; `stack_bench`: N passes
                  vs one padded stack (extras/p3_4_gather_kernel/pad_stack.py, the blog's road not taken)
- README.md       the idea, its files, how to run it; its tables: docs/measurements/p3_4_gather_kernel.md
"""
