"""Reject a bad batch before any forward pass runs.

Phase 0's `check_request` already refuses one bad request (empty prompt, ids
outside the vocabulary, max_new_tokens <= 0, prompt + new tokens longer than
the context). A batch adds two rules: the list itself must be non-empty, and
EVERY prompt is checked before the first forward pass, so a batch never
half-runs before one of its rows turns out to be impossible. Errors name the
prompt's index.
"""

from __future__ import annotations

from phases.p0_generate.generate import check_request, prompt_to_ids


def tokenize_prompt(lm, prompt: str | list[int], max_new_tokens: int, label: str = "prompt") -> list[int]:
    """A prompt as token ids (text gets the chat template, ids pass through), checked; ValueError names `label`."""
    try:
        ids = prompt_to_ids(lm, prompt)
        check_request(lm, ids, max_new_tokens)
    except ValueError as e:
        raise ValueError(f"{label}: {e}") from None
    return ids


def tokenize_batch(lm, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """Token ids for every prompt of a batch; raises ValueError before any work if one is bad."""
    if isinstance(prompts, str):
        raise ValueError("prompts must be a list of strings, got a single string; wrap it in a list")
    if not prompts:
        raise ValueError("empty prompt list: give at least one prompt")
    return [tokenize_prompt(lm, p, max_new_tokens, label=f"prompt {i}") for i, p in enumerate(prompts)]
