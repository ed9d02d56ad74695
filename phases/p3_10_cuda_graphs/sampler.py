"""Sampling for the whole batch on the device, in a fixed number of tensor ops, with one host transfer.

The engines so far picked greedy rows with one argmax and then sampled every
other row on its own (`common.sampling.sample`, per request `torch.Generator`):
five to ten small ops per sampled row, so at 256 sampled sequences over a
thousand launches a step. Here every row is drawn at once:

    greedy            argmax(logits)                                  rows with temperature 0
    temperature       logits / T                                      [B, V], T per row
    top-k, top-p      one sort of the batch; a row keeps its k best tokens and the smallest
                      prefix whose mass reaches p (the first token always); the rest -inf
    draw              argmax(logits / T + Gumbel noise)               the Gumbel-max trick: the
                      argmax of log-probabilities plus independent Gumbel(0, 1) noise is a
                      sample from the softmax, so no cumulative sum or search is needed

Per-request seeds without a generator per row: the noise of token v for the
i-th output of a sequence is a hash of (its seed, i, v) (`uniform_noise`). So a
sequence's draws depend on its seed and its own position only: not on the batch
it shares, the bucket it was padded into, the step a preemption delayed it to,
or the device. A request with no seed gets a random one (`DeviceSampler.seed`).

The filters are the same as `common.sampling.filter_logits` (tests check it);
the draws differ from torch.multinomial's, so seeded sampled text differs from
the earlier phases' engines, with the same distribution.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from common.sampling import SEED_MAX, SEED_MIN, Sampler, SamplingParams
from phases.p3_10_cuda_graphs.buffers import send

UINT64 = 1 << 64


def _as_int64(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - UINT64 if c >= 1 << 63 else c


# SplitMix64 (Steele, Lea and Flood 2014): its finaliser turns consecutive integers into well-mixed bits.
GOLDEN = _as_int64(0x9E3779B97F4A7C15)
MIX_1 = _as_int64(0xBF58476D1CE4E5B9)
MIX_2 = _as_int64(0x94D049BB133111EB)
UNIFORM_BITS = 24          # an fp32 holds 24 bits exactly: u = (k + 0.5) / 2^24, never 0 or 1


def _shift_right(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> keeps the sign)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (multiplication wraps around, as the algorithm wants)."""
    x = (x ^ _shift_right(x, 30)) * MIX_1
    x = (x ^ _shift_right(x, 27)) * MIX_2
    return x ^ _shift_right(x, 31)


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """seeds, counters [B] int64 -> [B, vocab] fp32 uniforms in (0, 1), a function of (seed, counter, token):
    SplitMix64's mixer, in int64 tensor arithmetic that gives the same bits on a CPU and a GPU."""
    row = mix64(seeds + counters * GOLDEN)                                               # [B]
    tokens = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = mix64(row[:, None] + tokens[None, :] * GOLDEN)                               # [B, V]
    k = _shift_right(bits, 64 - UNIFORM_BITS).to(torch.float32)
    return (k + 0.5) / float(1 << UNIFORM_BITS)


@dataclass
class SamplingRows:
    """What the sampler needs per row, on the device. Made from host values once per step (`sampling_rows`)."""
    greedy: torch.Tensor        # [B] bool
    temperature: torch.Tensor   # [B] fp32 (1 on greedy rows: never used there)
    top_k: torch.Tensor         # [B] int64 (the vocabulary size: no cut)
    top_p: torch.Tensor         # [B] fp32 (1: no cut)
    seeds: torch.Tensor         # [B] int64
    counters: torch.Tensor      # [B] int64: which output of its sequence each row draws
    filtered: bool              # some row cuts by top-k or top-p (host-known: the sort is skipped otherwise)


def sampling_rows(params: list[SamplingParams], seeds: list[int], counters: list[int], vocab: int,
                  device: torch.device | str) -> SamplingRows | None:
    """The rows' settings as device tensors (one host-to-device copy); None when every row is greedy."""
    if all(p.greedy for p in params):
        return None
    table = torch.tensor([[int(p.greedy), p.top_k if 0 < p.top_k < vocab else vocab, s, c]
                          for p, s, c in zip(params, seeds, counters)], dtype=torch.int64)
    floats = torch.tensor([[1.0 if p.greedy else p.temperature, p.top_p] for p in params], dtype=torch.float32)
    table, floats = send(table, torch.device(device)), send(floats, torch.device(device))
    filtered = any(not p.greedy and (0 < p.top_k < vocab or p.top_p < 1.0) for p in params)
    return SamplingRows(table[:, 0].bool(), floats[:, 0], table[:, 1], floats[:, 1], table[:, 2], table[:, 3], filtered)


def filter_rows(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """scaled [B, V] (already / temperature) -> the same with every token outside its row's top-k and
    top-p nucleus set to -inf. One sort for the batch."""
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)                  # [B, V]
    rank = torch.arange(scaled.shape[-1], device=scaled.device)
    in_top_k = rank[None, :] < top_k[:, None]
    probs = sorted_logits.masked_fill(~in_top_k, float("-inf")).softmax(-1)
    before = probs.cumsum(-1) - probs                  # mass strictly ahead of each token
    keep = in_top_k & (before < top_p[:, None])
    keep[:, 0] = True                                  # the most likely token always stays
    keep_vocab = torch.empty_like(keep).scatter_(-1, order, keep)
    return scaled.masked_fill(~keep_vocab, float("-inf"))


def sample_rows(logits: torch.Tensor, rows: SamplingRows | None) -> torch.Tensor:
    """logits [B, V] -> token ids [B] int64 on the device (no host transfer here)."""
    # bf16 -> fp32 is exact, so either argmax is phase 2.2's; fp32's argmax is the faster one on a CPU, and on a GPU the
    # copy would cost more than it saves.
    greedy_ids = (logits if logits.is_cuda else logits.float()).argmax(-1)
    if rows is None:
        return greedy_ids
    scaled = logits.float() / rows.temperature[:, None]
    if rows.filtered:
        scaled = filter_rows(scaled, rows.top_k, rows.top_p)
    gumbel = -torch.log(-torch.log(uniform_noise(rows.seeds, rows.counters, logits.shape[-1])))
    drawn = (scaled + gumbel).argmax(-1)
    return torch.where(rows.greedy, greedy_ids, drawn)


class DeviceSampler(Sampler):
    """The sampler part, on the device: every row of a pass in one batch of tensor ops, ONE host transfer.

    A row's i-th draw is keyed on (its request's seed, i), so it does not depend on the batch or the step.
    A request with no seed gets a random one the first time it samples. `last` keeps the last call's
    (sequences, ids on the device, ids on the host): a static decode step can feed the ids straight back."""

    def __init__(self, device: str | torch.device = "cpu"):
        super().__init__(device)
        self.seeds: dict[int, int] = {}     # seq_id -> the seed of a request that named none
        self.last: tuple | None = None

    def sample(self, seqs: list, logits: torch.Tensor) -> list[int]:
        ids = self.draw(seqs, logits)
        tokens = ids.tolist()
        self.last = (seqs, ids, tokens)
        return tokens

    def draw(self, seqs: list, logits: torch.Tensor, ahead: int = 0) -> torch.Tensor:
        """Each row's next token id [S], on the device. ahead: tokens a row has drawn that the host has not
        appended yet, so each draw keeps its output index."""
        if all(s.sampling.greedy for s in seqs):
            return sample_rows(logits, None)          # one argmax: no per-row parameters to send
        seeds = [self.seed(s) for s in seqs]
        rows = sampling_rows([s.sampling for s in seqs], seeds, [len(s.output_ids) + ahead for s in seqs],
                             logits.shape[-1], logits.device)
        return sample_rows(logits, rows)

    def seed(self, seq) -> int:
        """The int64 seed of `seq`'s draws: its request's, or one drawn at random once per sequence."""
        if seq.sampling.seed is not None:
            return _as_int64(seq.sampling.seed)
        if seq.seq_id not in self.seeds:
            self.seeds[seq.seq_id] = random.randint(SEED_MIN, SEED_MAX)
        return self.seeds[seq.seq_id]

    def forget(self, seq) -> None:
        super().forget(seq)
        self.seeds.pop(seq.seq_id, None)
