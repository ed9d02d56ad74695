"""`PaddedBatch`: B prompts, one shared `DynamicCache`, decoded in lock-step.

The cache holds K and V for the whole batch, per layer
`[B, n_kv_heads, T, head_dim]`, with T the same for every row: that is why all
rows must advance together, one column per step. Rows that already finished
are still fed a token (PAD) and still computed on every step; only the caller
knows to ignore their output. That carried work is the waste this phase measures.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from phases.p2_1_naive_batching.padding import left_pad


class PaddedBatch:
    """Prefill B left-padded prompts at once, then decode one column per `decode` call."""

    def __init__(self, lm, rows: list[list[int]]):
        if not rows:
            raise ValueError("a batch needs at least one row")
        self.lm = lm
        self.prompt_lens = [len(r) for r in rows]
        # [B, T] each; position_ids count real tokens only.
        self.input_ids, self.attention_mask, self.position_ids = left_pad(rows, lm.pad_token_id, lm.device)
        self.cache = DynamicCache()
        self.n_forward = 0                # forward passes run so far (1 prefill + decode steps)
        self._next_pos: torch.Tensor | None = None  # [B, 1] position of the token fed next

    @property
    def size(self) -> int:
        return len(self.prompt_lens)

    @property
    def n_pad(self) -> list[int]:
        """PAD tokens in front of each row."""
        width = max(self.prompt_lens)
        return [width - n for n in self.prompt_lens]

    @torch.inference_mode()
    def prefill(self) -> torch.Tensor:
        """Run every prompt through the model at once. Returns next-token logits [B, V]."""
        out = self.lm.model(self.input_ids, attention_mask=self.attention_mask, position_ids=self.position_ids,
                            past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self._next_pos = self.position_ids[:, -1:] + 1                      # [B, 1]
        self.n_forward = 1
        return out.logits[:, -1, :]

    @torch.inference_mode()
    def decode(self, next_ids: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (next_ids [B]); returns next-token logits [B, V].

        Every row, finished or not, gets a new column in the mask and the cache.
        """
        if self._next_pos is None:
            raise RuntimeError("call prefill() before decode()")
        ones = torch.ones((self.size, 1), dtype=self.attention_mask.dtype, device=self.attention_mask.device)
        self.attention_mask = torch.cat([self.attention_mask, ones], dim=1)  # [B, T + steps]
        out = self.lm.model(next_ids.view(self.size, 1).to(self.lm.device), attention_mask=self.attention_mask,
                            position_ids=self._next_pos, past_key_values=self.cache, use_cache=True,
                            logits_to_keep=1)
        self._next_pos = self._next_pos + 1
        self.n_forward += 1
        return out.logits[:, -1, :]


def cache_bytes(cache) -> int:
    """Bytes of the K and V tensors a `DynamicCache` really holds right now (all layers)."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total
