"""Reject bad requests before any forward pass runs.

Every engine from here on tokenizes and checks its requests up front, so a bad
prompt fails with a clear message instead of deep inside torch, and a batch
never half-runs before one of its rows turns out to be impossible.
"""

from __future__ import annotations


def check_max_new_tokens(max_new_tokens: int) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")


def check_prompt_ids(lm, prompt_ids: list[int], max_new_tokens: int, label: str = "prompt") -> list[int]:
    """Check one tokenized prompt: not empty, and prompt + new tokens fit the model's context."""
    check_max_new_tokens(max_new_tokens)
    if not prompt_ids:
        raise ValueError(f"{label}: empty prompt (no tokens)")
    need = len(prompt_ids) + max_new_tokens
    if need > lm.max_context:
        raise ValueError(f"{label}: {len(prompt_ids)} prompt tokens + {max_new_tokens} new tokens = {need} "
                         f"positions, more than the model's context of {lm.max_context}")
    return list(prompt_ids)


def tokenize_prompt(lm, prompt: str | list[int], max_new_tokens: int, label: str = "prompt") -> list[int]:
    """A prompt as token ids: text goes through the chat template, a list of ids is taken as is."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"{label}: empty prompt; give at least one character of text")
        ids = lm.prompt_ids(prompt)
    else:
        ids = list(prompt)
    return check_prompt_ids(lm, ids, max_new_tokens, label)


def tokenize_batch(lm, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """Token ids for every prompt of a batch; raises ValueError before any work if one is bad."""
    if isinstance(prompts, str):
        raise ValueError("prompts must be a list of strings, got a single string; wrap it in a list")
    if not prompts:
        raise ValueError("empty prompt list: give at least one prompt")
    return [tokenize_prompt(lm, p, max_new_tokens, label=f"prompt {i}") for i, p in enumerate(prompts)]
