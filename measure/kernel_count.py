"""Count the kernels a piece of code launches, on any device: aten ops that compute, and Triton launches.

On a GPU every aten op that computes something launches at least one kernel,
and every `kernel[grid](...)` of a Triton function launches one; view and
metadata ops (a transpose, a reshape of a contiguous tensor, an empty
allocation) launch none. Counting those two kinds of call, as PyTorch's
dispatcher and Triton see them, gives the number of kernels a decode step
costs without a GPU, from the same Python that runs on one. (It is a floor: a
cuBLAS matmul can be more than one kernel. A profiler on the GPU counts
exactly. And it counts what the code runs on the device it is on: a host read,
`item`, counts as one op, and a check that runs only on CPU tensors counts
there and not on a GPU.)

    with count_launches() as launches:
        engine.step()
    launches.total, launches.by_op.most_common(5)
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that only describe memory (views, metadata, allocations without a fill): no kernel on a GPU.
NO_KERNEL_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "unsqueeze", "squeeze", "transpose", "t", "permute",
    "expand", "slice", "select", "as_strided", "alias", "detach", "split", "split_with_sizes", "unbind",
    "narrow", "chunk", "unfold", "diagonal", "view_as_real", "view_as_complex", "squeeze_", "unsqueeze_",
    "as_strided_", "t_", "transpose_", "resize_",
    "view_as", "lift_fresh", "empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
})
TRITON_PREFIX = "triton:"


@dataclass
class Launches:
    by_op: Counter = field(default_factory=Counter)   # aten op name or "triton:<kernel>" -> launches
    inside_triton: int = 0    # > 0 while a Triton launch runs: the interpreter's own tensor copies are not kernels

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    @property
    def triton(self) -> int:
        return sum(n for op, n in self.by_op.items() if op.startswith(TRITON_PREFIX))


class _AtenCounter(TorchDispatchMode):
    def __init__(self, launches: Launches):
        super().__init__()
        self.launches = launches

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL_OPS and not self.launches.inside_triton:
            self.launches.by_op[name] += 1
        return func(*args, **(kwargs or {}))


def kernel_name(kernel) -> str:
    """A Triton kernel's function name (an autotuned kernel wraps its JITFunction: one level further)."""
    fn = kernel.fn
    return getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", "kernel")


@contextmanager
def count_launches():
    """Inside: every aten op that computes and every Triton launch is counted (yields `Launches`)."""
    from triton.runtime.jit import KernelInterface   # compiled and interpreted Triton functions both launch here

    launches = Launches()
    launch = KernelInterface.__getitem__

    def counted(kernel, grid):
        run = launch(kernel, grid)

        def call(*args, **kwargs):
            launches.by_op[TRITON_PREFIX + kernel_name(kernel)] += 1
            launches.inside_triton += 1
            try:
                return run(*args, **kwargs)
            finally:
                launches.inside_triton -= 1
        return call

    KernelInterface.__getitem__ = counted
    try:
        with _AtenCounter(launches):
            yield launches
    finally:
        KernelInterface.__getitem__ = launch
