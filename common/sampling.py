"""Pick the next token from logits: greedy, temperature, top-k, top-p.

Every engine calls `sample(logits, params, generator)` on the last position's
logits, one row per sequence. Greedy (temperature 0) is an argmax, so engines
can be checked token-for-token against Hugging Face `generate(do_sample=False)`.

`SamplingParams` checks itself when it is made (`validate()`), so no engine
ever meets a value that would crash a step: a temperature below
`GREEDY_BELOW_TEMPERATURE` is greedy (dividing logits by 1e-40 overflows to
inf, and `torch.multinomial` refuses the NaN probabilities that follow: vLLM
draws the same line), NaN and infinity are refused, and a seed must be one
`torch.Generator` takes. A request of `n` samples seeds sample i with
`seed + i`, so every one of those must fit too: `validate(n_samples=n)`.
A refusal is an `InvalidSamplingParams` (a ValueError) that names the
parameter, so a server can answer 400 with `param` set.

Two sampler parts, each `sample(seqs, logits) -> token ids`:
- `Sampler`: greedy rows in one argmax, each sampled row drawn on its own
  with its request's `torch.Generator` (a few small ops per sampled row);
- `DeviceSampler`: every row of the batch at once, in a fixed number of
  tensor ops and one host transfer. Its draws are keyed on (seed, output
  index), so a sequence's tokens do not depend on the batch it shares.
"""

from __future__ import annotations

import math
import numbers
import random
from dataclasses import dataclass

import torch

GREEDY_BELOW_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it samples greedily
# Seeds are 64-bit signed integers, as in vLLM's API; torch.Generator.manual_seed takes all of them.
SEED_MIN = -2**63
SEED_MAX = 2**63 - 1


class InvalidSamplingParams(ValueError):
    """A sampling parameter out of range; `param` names it (temperature, top_k, top_p, seed)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_finite(x) -> bool:
    """A real number (not a bool) that is neither NaN nor infinite (nor an int too big for a float)."""
    if not isinstance(x, numbers.Real) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0 (or anything below GREEDY_BELOW_TEMPERATURE) means greedy
    top_k: int = 0             # 0 means no top-k cut
    top_p: float = 1.0         # 1 means no nucleus cut
    seed: int | None = None    # sample i of a group draws with seed + i

    def __post_init__(self):
        self.validate()

    def validate(self, n_samples: int = 1) -> None:
        """Raise InvalidSamplingParams unless every value is in range for a request of `n_samples` samples."""
        t, k, p = self.temperature, self.top_k, self.top_p
        if not _is_finite(t) or t < 0:
            raise InvalidSamplingParams("temperature", f"must be a finite number >= 0, got {t!r}")
        if not _is_int(k) or k < 0:
            raise InvalidSamplingParams("top_k", f"must be an integer >= 0 (0: no cut), got {k!r}")
        if not _is_finite(p) or not 0 < p <= 1:
            raise InvalidSamplingParams("top_p", f"must be in (0, 1], got {p!r}")
        if self.seed is not None:
            last = self.seed + n_samples - 1 if _is_int(self.seed) else None
            if last is None or not SEED_MIN <= self.seed <= SEED_MAX or last > SEED_MAX:
                what = "" if n_samples == 1 else f" (sample i draws with seed + i, up to seed + {n_samples - 1})"
                raise InvalidSamplingParams("seed", f"must be an integer in [{SEED_MIN}, {SEED_MAX}]{what}, "
                                                    f"got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


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
        # Drop a token when the mass strictly before it already reaches top_p. The most likely
        # token is always kept, explicitly: a top_p below fp32's smallest number (5e-324 is a
        # valid float64) rounds to 0 in the comparison, which would drop every token.
        before = probs.cumsum(-1) - probs
        drop_sorted = before >= top_p
        drop_sorted[..., 0] = False
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


class Sampler:
    """The sampler part of an engine: one token per row of a pass's logits, each row its own request's.

    Greedy rows are one argmax for the whole batch; a sampled row draws with its request's generator, made
    from its seed the first time it samples (`forget` drops it when the request is over)."""

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = device
        self.generators: dict[int, torch.Generator | None] = {}   # seq_id -> its random stream

    def sample(self, seqs: list, logits: torch.Tensor) -> list[int]:
        """Row i of logits [S, V] is seqs[i]'s (anything with `seq_id` and `sampling`). Returns S token ids."""
        tokens = logits.float().argmax(-1)  # [S]; fp32 first: CPU argmax over bf16 is slower, same answer
        for i, seq in enumerate(seqs):
            if not seq.sampling.greedy:
                if seq.seq_id not in self.generators:
                    self.generators[seq.seq_id] = make_generator(seq.sampling, self.device)
                tokens[i] = sample(logits[i:i + 1], seq.sampling, self.generators[seq.seq_id])[0]
        # One copy to the host for the whole batch, after every row is picked (on a GPU each
        # read of a token is a wait for the stream).
        return tokens.tolist()

    def forget(self, seq) -> None:
        self.generators.pop(seq.seq_id, None)


# --- the whole batch on the device ---------------------------------------------------------------------
UINT64 = 1 << 64
UNIFORM_BITS = 24          # an fp32 holds 24 bits exactly: u = (k + 0.5) / 2^24, never 0 or 1


def _as_int64(c: int) -> int:
    """An unsigned 64-bit constant (or a seed) as the int64 with the same bits."""
    return c - UINT64 if c >= 1 << 63 else c


# SplitMix64 (Steele, Lea and Flood 2014): its finaliser turns consecutive integers into well-mixed bits.
GOLDEN = _as_int64(0x9E3779B97F4A7C15)
MIX_1 = _as_int64(0xBF58476D1CE4E5B9)
MIX_2 = _as_int64(0x94D049BB133111EB)


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


def send(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host `values` on `device`, without making the host wait for the GPU. A copy from ordinary (pageable)
    host memory first waits for everything queued on the stream; from pinned memory it is queued like a
    kernel. (torch's caching host allocator keeps the pinned block alive until the copy has run.)"""
    if device.type == "cuda":
        values = values.pin_memory()
    return values.to(device, non_blocking=True)


@dataclass
class SamplingRows:
    """What the device sampler needs per row, on the device. Made from host values once per pass."""
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
    """`filter_logits` for every row at once, each with its own top_k [B] and top_p [B]: scaled [B, V] (already
    / temperature) -> the same with every token outside its row's top-k and top-p nucleus set to -inf.
    One sort for the batch."""
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
    # bf16 -> fp32 is exact, so either argmax is the same; fp32's argmax is the faster one on a CPU, and on a GPU
    # the copy would cost more than it saves.
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
    """The sampler part for the whole batch on the device: one set of tensor ops, ONE host transfer.

        greedy        argmax(logits)                              rows with temperature 0
        temperature   logits / T                                  [B, V], T per row
        top-k, top-p  one sort of the batch (`filter_rows`): a row keeps its k best tokens and the
                      smallest prefix whose mass reaches p (the first token always); the rest -inf
        draw          argmax(logits / T + Gumbel noise)           the Gumbel-max trick: the argmax of
                      log-probabilities plus independent Gumbel(0, 1) noise is a sample from the
                      softmax, so no cumulative sum or search is needed

    Per-request seeds without a generator per row: the noise of token v for the i-th output of a sequence is
    a hash of (its seed, i, v) (`uniform_noise`). So a sequence's draws depend on its seed and its own
    position only: not on the batch it shares, the bucket it was padded into, the step a preemption delayed
    it to, or the device. A request with no seed gets a random one, once (`seed`). The filters are
    `filter_logits`'s; the draws differ from torch.multinomial's (`Sampler`), with the same distribution."""

    def __init__(self, device: str | torch.device = "cpu"):
        super().__init__(device)
        self.seeds: dict[int, int] = {}     # seq_id -> the seed of a request that named none

    def sample(self, seqs: list, logits: torch.Tensor) -> list[int]:
        return self.draw(seqs, logits).tolist()

    def draw(self, seqs: list, logits: torch.Tensor, ahead: int = 0) -> torch.Tensor:
        """Each row's next token id [S], on the device. ahead: tokens a row has drawn that the host has not
        appended yet, so each draw keeps its output index."""
        if all(s.sampling.greedy for s in seqs):
            return sample_rows(logits, None)          # one argmax: no per-row parameters to send
        rows = sampling_rows([s.sampling for s in seqs], [self.seed(s) for s in seqs],
                             [len(s.output_ids) + ahead for s in seqs], logits.shape[-1], logits.device)
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
