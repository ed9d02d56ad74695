"""Which proposed tokens the target keeps: one verification pass's logits -> each sequence's new tokens.

Guesses d_1 .. d_m get the target's rows p_1 .. p_{m+1} (the first row: the sequence's last token).
greedy    keep d_i while it is argmax p_i; then emit that argmax (or argmax p_{m+1} if all match).
sampling  (Leviathan et al.) keep d_i with probability min(1, p_i(d_i) / q_i(d_i)), q_i what d_i was drawn from
          (a point mass for n-gram or greedy guesses); at the first rejection draw from max(0, p_i - q_i)
          renormalised, else from p_{m+1}: every emitted token is distributed as p_i. Residual and bonus draws use
          the j-th draw's noise (Gumbel-max), the test a second stream, seed ^ ACCEPT_STREAM.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from common.sampling import _as_int64, filter_rows, sampling_rows, uniform_noise

ACCEPT_STREAM = _as_int64(0xA5A5_5A5A_C3C3_3C3C)   # xor-ed into a seed: the acceptance test's own random stream


@dataclass
class Proposal:
    """What a proposer offers one sequence: `tokens` [m], and the distributions they were drawn from."""
    tokens: list[int]
    probs: torch.Tensor | None = None   # [m, V] q_i; None: each token is certain (a point mass)

    def __len__(self) -> int:
        return len(self.tokens)


def target_logits(logits: torch.Tensor, params: list, vocab: int) -> torch.Tensor:
    """logits [R, V] -> the scaled, top-k/top-p filtered logits each row samples from; greedy rows as they are."""
    rows = sampling_rows(params, [0] * len(params), [0] * len(params), vocab, logits.device)
    if rows is None:
        return logits.float()
    scaled = logits.float() / rows.temperature[:, None]
    return filter_rows(scaled, rows.top_k, rows.top_p) if rows.filtered else scaled


def accept(seqs: list, proposals: list[Proposal], logits: torch.Tensor, seeds: list[int]) -> list[list[int]]:
    """Each sequence's kept proposals, then one target token. seqs[i] proposed proposals[i]; its m_i + 1 rows of
    logits [R, V] follow those of seqs[:i]. seeds[i]: its draws' seed (unused when greedy)."""
    vocab = logits.shape[-1]
    counts = [len(p) + 1 for p in proposals]
    params = [s.sampling for s, n in zip(seqs, counts) for _ in range(n)]
    scaled = target_logits(logits, params, vocab)                                       # [R, V]
    argmax = scaled.argmax(-1).tolist()                                                 # [R]
    if all(s.sampling.greedy for s in seqs):
        return [_accept_greedy(p.tokens, argmax[r:r + n]) for p, r, n in zip(proposals, _starts(counts), counts)]

    # Sampled: p_i(d_i), q_i(d_i), the test's uniforms, and each row's token on a rejection (last row: the bonus).
    dev = logits.device
    seed_rows = torch.tensor([_as_int64(seeds[i]) for i, n in enumerate(counts) for _ in range(n)], device=dev)
    counters = torch.tensor([len(s.output_ids) + j for s, n in zip(seqs, counts) for j in range(n)], device=dev)
    probs = scaled.softmax(-1)                                                          # [R, V] p
    drafts = [t for p in proposals for t in p.tokens + [0]]   # row -> its proposed token (0: none, on last rows)
    drafted = torch.tensor(drafts, device=dev)
    q = torch.zeros_like(probs)                                                         # [R, V] q (0 on last rows)
    certain = [r + j for p, r in zip(proposals, _starts(counts)) if p.probs is None for j in range(len(p))]
    if certain:                                   # point masses, every row at once: q_i(d_i) = 1
        rows = torch.tensor(certain, device=dev)
        q[rows, drafted[rows]] = 1.0
    for p, r in zip(proposals, _starts(counts)):
        if p.probs is not None:                   # a draft's own distributions, copied in
            q[r:r + len(p)] = p.probs.to(q.dtype)
    p_at = probs.gather(1, drafted[:, None])[:, 0]                                      # [R] p_i(d_i)
    q_at = q.gather(1, drafted[:, None])[:, 0]                                          # [R] q_i(d_i)
    u = uniform_noise(seed_rows ^ ACCEPT_STREAM, counters, 1)[:, 0]                     # [R]
    kept = (u * q_at < p_at).tolist()                                                   # u < p/q, without dividing
    residual = (probs - q).clamp(min=0)                                                 # [R, V]
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, probs, residual)        # p == q: a rejection cannot happen; draw from p anyway
    gumbel = -torch.log(-torch.log(uniform_noise(seed_rows, counters, vocab)))
    drawn = (residual.log() + gumbel).argmax(-1).tolist()                               # [R]
    out = []
    for seq, p, r, n in zip(seqs, proposals, _starts(counts), counts):
        if seq.sampling.greedy:
            out.append(_accept_greedy(p.tokens, argmax[r:r + n]))
            continue
        n_kept = next((j for j in range(n - 1) if not kept[r + j]), n - 1)
        out.append(p.tokens[:n_kept] + [drawn[r + n_kept]])
    return out


def _accept_greedy(proposed: list[int], argmax: list[int]) -> list[int]:
    """The proposals while they equal the target's argmax, then the argmax at the first mismatch (or the bonus)."""
    n_kept = next((j for j, (d, best) in enumerate(zip(proposed, argmax)) if d != best), len(proposed))
    return proposed[:n_kept] + [argmax[n_kept]]


def _starts(counts: list[int]) -> list[int]:
    """Row where each sequence's rows begin."""
    return [0, *accumulate(counts)][:-1]
