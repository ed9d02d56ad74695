"""Beside phase 3.6: the models whose attention the paged pool would compute wrongly, refused by name.

Honoured (not refused): causal attention, GQA, any `scaling`, a sliding window and a logit softcap.
Refused: layer kinds other than full and sliding, chunked attention (Llama 4), attention sinks (gpt-oss),
bidirectional attention, and a layer whose config declares a window its attention call does not pass.
"""

from __future__ import annotations

# Layer types (config.layer_types) whose attention is causal with or without a sliding window.
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


class UnsupportedAttention(ValueError):
    """The model asks its attention for something the paged pool's attention does not compute."""


def check_attention_supported(model) -> None:
    """Refuse, by name, a model whose attention the pool would compute wrongly: layer kinds other than full
    and sliding, chunked attention (Llama 4), attention sinks (gpt-oss), bidirectional attention."""
    config = model.config
    name = type(model).__name__
    unknown = sorted(set(getattr(config, "layer_types", None) or ()) - set(SUPPORTED_LAYER_TYPES))
    if unknown:
        raise UnsupportedAttention(f"{name}: layer types {unknown} are not supported by the paged engines "
                                   f"(only {list(SUPPORTED_LAYER_TYPES)})")
    if getattr(config, "attention_chunk_size", None):
        raise UnsupportedAttention(f"{name}: chunked attention (attention_chunk_size="
                                   f"{config.attention_chunk_size}) is not supported by the paged engines")
    for module in model.modules():
        if getattr(module, "sinks", None) is not None:
            raise UnsupportedAttention(f"{name}: attention sinks ({type(module).__name__}.sinks) are not "
                                       "supported by the paged engines")
        if getattr(module, "is_causal", True) is False:
            raise UnsupportedAttention(f"{name}: bidirectional attention ({type(module).__name__}.is_causal=False) "
                                       "is not supported by the paged engines")


def declared_window(config, layer_idx: int) -> int | None:
    """The sliding window the model's config declares for a layer (None: full attention)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window if getattr(config, "use_sliding_window", True) else None


def check_call(module, sliding_window: int | None, kwargs: dict) -> None:
    """Refuse a call that asks for sinks, or passes no window where the config declares one (left to a
    mask we never build)."""
    if kwargs.get("s_aux") is not None:
        raise UnsupportedAttention(f"{type(module).__name__}: attention sinks (s_aux) are not supported "
                                   "by the paged engines")
    declared = declared_window(module.config, module.layer_idx)
    if declared is not None and sliding_window is None:
        raise UnsupportedAttention(f"{type(module).__name__} layer {module.layer_idx}: the config declares a "
                                   f"sliding window of {declared} but the attention call passes none; the paged "
                                   "engines honour only a window passed to the attention function")
