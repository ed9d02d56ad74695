"""Route the model's RMSNorm, rotary embedding and SwiGLU to the fused kernels, only inside `fused_ops_on()`.

The model object is shared (the HF peers and the engine's prefill passes run the same modules), so
`install_fused_ops(model)` gives each recognised module a forward that checks one flag per call: the fused
kernel inside `fused_ops_on()`, its own forward elsewhere. A replayed graph runs no Python.

Recognised by name, from families whose code was read against the kernels (Llama, Qwen2/3, Mistral, and
Gemma 2's rotary); anything else is left alone: their RMSNorms, weight in x's dtype (not Gemma's
`(1 + weight)` norm); their SwiGLU MLPs with a SiLU; `apply_rotary_pos_emb` called as (q, k, cos, sin) in
HF's default layout (q, k [B, H, T, D]; cos, sin [B, T, D]).
"""

from __future__ import annotations

import sys
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from phases.p3_4_gather_kernel.dispatch import use_kernels

FUSABLE_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")
FUSABLE_MLPS = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP")
SILU_ACTIVATIONS = ("SiLU", "SiLUActivation")
ROTARY_FUNCTION = "apply_rotary_pos_emb"
FUSABLE_ROTARY_FILES = tuple(f"transformers.models.{m}.modeling_{m}"
                             for m in ("llama", "qwen2", "qwen3", "mistral", "gemma2"))
DEFAULT_UNSQUEEZE_DIM = 1        # HF's default: cos/sin [B, T, D] broadcast over the heads of q/k [B, H, T, D]

_active = 0                      # how many fused_ops_on() blocks are open (one per engine forward)
fused_calls: Counter = Counter()  # kernel launches made through this module, by kind (tests, the demo's counts)


@dataclass
class FusedModules:
    """What `install_fused_ops` gave a fused forward, and the norms it recognised as such but left alone."""
    norms: int = 0
    mlps: int = 0
    rotary_files: list[str] = field(default_factory=list)   # modeling modules whose apply_rotary_pos_emb routes
    left_norms: list[str] = field(default_factory=list)     # other *RMSNorm classes: their own forward always


@contextmanager
def fused_ops_on():
    """Inside: the installed modules launch the fused kernels (on tensors the kernels can take)."""
    global _active
    _active += 1
    try:
        yield
    finally:
        _active -= 1


def install_fused_ops(model: torch.nn.Module) -> FusedModules:
    """Give `model`'s recognised modules their dispatching forwards (once per model; later calls return the
    same record)."""
    done = getattr(model, "_fused_modules", None)
    if done is not None:
        return done
    found = FusedModules()
    for module in model.modules():
        kind = type(module).__name__
        if kind in FUSABLE_NORMS and hasattr(module, "variance_epsilon"):
            module.forward = _fused_norm_forward(module)
            found.norms += 1
        elif kind.endswith("RMSNorm"):
            found.left_norms.append(kind)
        elif kind in FUSABLE_MLPS and type(getattr(module, "act_fn", None)).__name__ in SILU_ACTIVATIONS:
            module.forward = _fused_mlp_forward(module)
            found.mlps += 1
        file = sys.modules.get(type(module).__module__)
        if hasattr(module, "o_proj") and type(module).__module__ in FUSABLE_ROTARY_FILES \
                and callable(getattr(file, ROTARY_FUNCTION, None)):
            if not getattr(getattr(file, ROTARY_FUNCTION), "routes_to_fused", False):
                setattr(file, ROTARY_FUNCTION, _fused_rotary(getattr(file, ROTARY_FUNCTION)))
            if file.__name__ not in found.rotary_files:
                found.rotary_files.append(file.__name__)
    found.left_norms = sorted(set(found.left_norms))
    model._fused_modules = found
    return found


def _fused_norm_forward(module):
    from phases.p3_11_fused_ops.kernels import rms_norm
    own = module.forward

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if _active and use_kernels(hidden_states.device) and module.weight.dtype == hidden_states.dtype:
            fused_calls["rms_norm"] += 1
            return rms_norm(hidden_states, module.weight, module.variance_epsilon)
        return own(hidden_states)
    return forward


def _fused_mlp_forward(module):
    from phases.p3_11_fused_ops.kernels import silu_and_mul
    own = module.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if _active and use_kernels(x.device):
            fused_calls["silu_and_mul"] += 1
            return module.down_proj(silu_and_mul(module.gate_proj(x), module.up_proj(x)))
        return own(x)
    return forward


def _fused_rotary(own):
    from phases.p3_11_fused_ops.kernels import rotary, rotary_refusal

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        # Only HF's default call, (q, k, cos, sin) or unsqueeze_dim=1 by name; anything else is the model's.
        default_call = not args and set(kwargs) <= {"unsqueeze_dim"} \
            and kwargs.get("unsqueeze_dim", DEFAULT_UNSQUEEZE_DIM) == DEFAULT_UNSQUEEZE_DIM
        if _active and default_call and use_kernels(q.device) and rotary_refusal(q, k, cos, sin) is None:
            fused_calls["rotary"] += 1
            return rotary(q, k, cos, sin)
        return own(q, k, cos, sin, *args, **kwargs)
    apply_rotary_pos_emb.routes_to_fused = True
    apply_rotary_pos_emb.__wrapped__ = own
    return apply_rotary_pos_emb
