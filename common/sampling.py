"""Pick the next token from logits: greedy, temperature, top-k, top-p.

Every engine calls `sample(logits, params, generator)` on the last position's
logits, one row per sequence. Greedy (temperature 0) is an argmax, so engines
can be checked token-for-token against Hugging Face `generate(do_sample=False)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0 means greedy
    top_k: int = 0             # 0 means no top-k cut
    top_p: float = 1.0         # 1 means no nucleus cut
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams()


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Mask (to -inf) every logit outside the top-k and outside the top-p nucleus.

    logits: [B, V] (already divided by the temperature). Returns [B, V].
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]           # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [B, V]
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p;
        # the most likely token is therefore always kept.
        before = probs.cumsum(-1) - probs
        drop_sorted = before >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: SamplingParams = GREEDY,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits: [B, V] for the last position. Returns token ids [B] (int64)."""
    if params.greedy:
        return logits.argmax(-1)
    scaled = filter_logits(logits.float() / params.temperature, params.top_k, params.top_p)
    probs = scaled.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def make_generator(params: SamplingParams, device: str | torch.device = "cpu") -> torch.Generator | None:
    """A seeded generator when the request names a seed (reproducible samples), else None."""
    if params.seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(params.seed)
    return g
