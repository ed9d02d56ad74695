"""Beside phase 3.6: `switch_attention`, a cheap `model.set_attn_implementation(name)`.

transformers' `set_attn_implementation` checks the name, then walks every submodule looking for submodels
with configs of their own (hundreds of modules on a 28-layer model), and the engines switch twice per step.
That walk does no more than the config's own setter when every submodel shares the top config (a causal LM
and its inner model do). So the full call runs the first time a model meets a name, and after that, where
the configs are shared, only the setter: what the attention layers read (`config._attn_implementation`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel


@dataclass
class _SwitchState:
    """What `switch_attention` learnt about one model."""
    configs_shared: bool                            # every transformers submodel uses model.config itself
    checked: set[str] = field(default_factory=set)  # names transformers has already checked for it


_SWITCH_STATE: "weakref.WeakKeyDictionary[torch.nn.Module, _SwitchState]" = weakref.WeakKeyDictionary()


def switch_attention(model, name: str) -> None:
    """Set `model`'s attention implementation to `name`, cheaply: transformers' `set_attn_implementation`
    walks every submodule, which does no more than the config's setter when every submodel shares the top
    config. So the full call runs once per model and name, then (configs shared) only the setter."""
    state = _SWITCH_STATE.get(model)
    if state is None:
        shared = all(m.config is model.config for m in model.modules() if isinstance(m, PreTrainedModel))
        state = _SWITCH_STATE[model] = _SwitchState(shared)
    if name in state.checked and state.configs_shared:
        model.config._attn_implementation = name
        return
    model.set_attn_implementation(name)
    state.checked.add(name)
