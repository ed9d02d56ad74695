"""One sequence growing token by token: what its KV cache copies and allocates, measured on the tensors themselves.

    measure_growth(lm, prompt_ids, new_tokens, make_cache, checkpoints) -> rows

`make_cache(lm, total_tokens)` returns (cache, storage, held): an HF `Cache`, a
function that lists the tensors holding its K/V now, and one that gives the bytes
the sequence holds (DynamicCache: its tensors; a paged pool: its blocks, the last
one's unused tail included). The model runs greedy,
one token per forward pass (`model(ids, past_key_values=cache)`), and after
every pass the harness looks at those tensors:

- a tensor whose address changed was reallocated: growing it copied its old
  contents (DynamicCache's `torch.cat` does this for K and V of every layer,
  every step), and for that moment the old and the new copy both existed;
- `cache.update` returning tensors that are not the storage means it built a
  contiguous copy for attention to read (phase 3.3's PagedCache gathers the
  pool's blocks every step; phase 3.5's kernel reads the pool in place and
  makes none).

Each row (at the token counts in `checkpoints`) gives: bytes held, the largest
tensor allocated while growing (one contiguous piece of memory), allocations and
bytes copied to grow so far, bytes copied to attend so far, and the peak of held
bytes plus the transient second copy of a reallocation. A pool allocated before
the sequence starts is not a growth allocation: it is never reallocated.
"""

from __future__ import annotations

from typing import Callable

import torch

MB = 1 << 20


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def measure_growth(lm, prompt_ids: list[int], new_tokens: int, make_cache: Callable,
                   checkpoints: list[int]) -> list[dict]:
    """Grow one sequence by `new_tokens` greedy tokens; a row at every token count in `checkpoints`."""
    cache, storage, held_bytes = make_cache(lm, len(prompt_ids) + new_tokens)
    attend_bytes = 0
    original_update = cache.update

    def update(key_states, value_states, layer_idx, *args, **kwargs):
        nonlocal attend_bytes
        k, v = original_update(key_states, value_states, layer_idx, *args, **kwargs)
        held = {t.data_ptr() for t in storage()}
        if k.data_ptr() not in held:
            attend_bytes += _tensor_bytes(k) + _tensor_bytes(v)
        return k, v

    cache.update = update      # an instance attribute: the model calls past_key_values.update(...)
    stats = dict(allocations=0, grow_bytes=0, peak_bytes=0, largest=0)
    previous: dict[int, tuple[int, int]] = {}    # slot index -> (address, bytes) after the last pass
    rows, n_tokens = [], 0
    ids = torch.tensor([prompt_ids], device=lm.device)
    with torch.inference_mode():
        for step in range(new_tokens):
            out = lm.model(input_ids=ids, past_key_values=cache, use_cache=True)
            n_tokens += ids.shape[1]
            tensors = storage()
            held = held_bytes()
            transient = 0
            for i, t in enumerate(tensors):
                before = previous.get(i)
                if before is not None and before[0] != t.data_ptr():
                    stats["allocations"] += 1
                    stats["grow_bytes"] += before[1]          # the old contents, copied into the new tensor
                    transient = max(transient, before[1])     # old and new coexist while copying one tensor
                    stats["largest"] = max(stats["largest"], _tensor_bytes(t))
                previous[i] = (t.data_ptr(), _tensor_bytes(t))
            stats["peak_bytes"] = max(stats["peak_bytes"], held + transient)
            if n_tokens in checkpoints or step == new_tokens - 1:
                rows.append(dict(tokens=n_tokens, held_mb=held / MB,
                                 largest_mb=stats["largest"] / MB,
                                 allocations=stats["allocations"], grow_copied_mb=stats["grow_bytes"] / MB,
                                 attend_copied_mb=attend_bytes / MB, peak_mb=stats["peak_bytes"] / MB))
            ids = out.logits[:, -1:].argmax(-1)
    return rows
