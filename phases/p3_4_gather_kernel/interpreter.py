"""Run Triton kernels without a GPU: switch on Triton's CPU interpreter, whatever was imported first.

Triton compiles kernels only for GPUs. With TRITON_INTERPRET=1 it instead runs
each program of the grid in Python on numpy arrays: slow, but exact enough to
test a kernel against its reference on a laptop.

The switch is read when `@triton.jit` decorates a function. Triton's own
standard library (`tl.sum`, `tl.max`, `tl.zeros`, `tl.cdiv`, ...) is made of
`@triton.jit` functions decorated when `triton` is first imported, and
torch._dynamo imports triton as soon as a model is loaded. If that happened
before the switch was on, those helpers were built for the compiler, and a
kernel that calls them under the interpreter fails with "Cannot call
@triton.jit'd outside of the scope of a kernel". So after turning the switch
on, rebuild the standard library if it was built the other way.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

INTERPRET_ENV = "TRITON_INTERPRET"


def use_interpreter_without_gpu() -> bool:
    """Without CUDA, turn the interpreter on (unless the user set TRITON_INTERPRET). Returns whether it is on.

    Call it before defining `@triton.jit` kernels.
    """
    if not torch.cuda.is_available():
        os.environ.setdefault(INTERPRET_ENV, "1")
    interpreting = os.environ.get(INTERPRET_ENV, "0") == "1"
    if interpreting and "triton.language" in sys.modules:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
        if not isinstance(tl.standard.sum, InterpretedFunction):
            importlib.reload(tl.standard)  # re-decorate tl.sum, tl.max, ... now that the switch is on
            importlib.reload(tl)           # and rebind the `tl.` names to them
    return interpreting
