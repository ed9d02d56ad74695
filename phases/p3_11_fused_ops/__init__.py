"""Phase 3.11 adds fused kernels to phase 3.10's decode step: RMSNorm, rotary embedding and SwiGLU's gate, one launch each.

- kernels.py   Triton: `rms_norm`, `rotary` (q and k in one launch), `silu_and_mul`; fp32 inside, rounded where
               the model's PyTorch code rounds
- layers.py    `install_fused_ops(model)`: the recognised modules get forwards that launch the kernels only inside
               `fused_ops_on()` (the model is shared with prefill passes and the HF peers)
- engine.py    `FusedDecodeEngine(StaticDecodeEngine)`: the static decode step (and so its CUDA graph) with the
               fused kernels; `FusedOverlappedEngine`, the same with phase 3.10's overlapped steps
- demo.py      `fused_bench`: kernels per decode step, phase 3.10 vs this phase (any device), and the step's wall
               and GPU time (CUDA); `fused_workload`: the equal and mixed work
- README.md    the idea, its files, how to run it; its tables: docs/measurements/p3_11_fused_ops.md
"""
