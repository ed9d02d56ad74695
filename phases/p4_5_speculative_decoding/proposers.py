"""Proposers guess each sequence's next few tokens: `propose(seqs, k, seeds)` -> one `Proposal` (maybe empty) per
sequence; `release(seq)` when a sequence stops speculating. A self-draft is an early exit, as in LayerSkip.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from common.sampling import SamplingParams, _as_int64, sample_rows, sampling_rows
from phases.p3_1_block_allocator.allocator import BlockAllocator, OutOfBlocks
from phases.p3_2_block_table.block_table import BlockTable
from phases.p3_6_batched_engine.runner import Batch, Chunk
from phases.p3_8_chunked_prefill.runner import MixedRunner
from phases.p4_5_speculative_decoding.acceptance import Proposal, target_logits

DEFAULT_MAX_N = 3        # longest suffix the n-gram proposer looks for (vLLM's prompt_lookup_max default is 5)
DEFAULT_MIN_N = 1
DRAFT_STREAM = _as_int64(0x5EED_D4AF_7000_0001)   # xor-ed into a seed: the draft's own random stream


class NgramProposer:
    """Prompt lookup: the tokens that followed the last earlier occurrence of the sequence's suffix."""

    name = "ngram"

    def __init__(self, max_n: int = DEFAULT_MAX_N, min_n: int = DEFAULT_MIN_N):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, seqs: list, k: int, seeds: list[int]) -> list[Proposal]:
        return [Proposal(lookup(s.all_ids, k, self.max_n, self.min_n)) for s in seqs]

    def release(self, seq) -> None:
        pass   # nothing kept per sequence


def lookup(ids: list[int], k: int, max_n: int = DEFAULT_MAX_N, min_n: int = DEFAULT_MIN_N) -> list[int]:
    """Up to k tokens that followed the last earlier occurrence of ids' final n tokens, longest n first."""
    length = len(ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = ids[length - n:]
        for i in range(length - n - 1, -1, -1):      # right to left: the latest occurrence wins
            if ids[i] == suffix[0] and ids[i:i + n] == suffix:
                return ids[i + n:i + n + k]
    return []


def self_draft(lm, n_layers: int):
    """The target's first `n_layers` layers under its own norm and head, a LoadedModel of its own; nothing copied."""
    layers = getattr(getattr(lm.model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(lm.model).__name__} has no `model.layers` list to take a self-draft from")
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or not 1 <= n_layers < len(layers):
        raise ValueError(f"a self-draft takes 1 .. {len(layers) - 1} of the target's {len(layers)} layers, "
                         f"got {n_layers!r}")
    # Shallow copies with their own module dicts leave the target whole; the shared config keeps one attention.
    inner = copy.copy(lm.model.model)
    inner._modules = dict(inner._modules)
    inner.layers = nn.ModuleList(list(layers)[:n_layers])
    draft = copy.copy(lm.model)
    draft._modules = dict(draft._modules)
    draft.model = inner
    return dataclasses.replace(lm, name=f"{lm.name}[:{n_layers} layers]", model=draft, n_layers=n_layers)


@dataclass(eq=False)
class DraftState:
    """What the draft keeps for one sequence; duck-types what the runner reads of a `Sequence` (`all_ids`, `kv`)."""
    fed: list[int]          # tokens whose K/V the draft's table holds, in order
    kv: BlockTable
    all_ids: list[int]      # this round: the sequence's tokens, then the draft's proposals so far


class DraftProposer:
    """A draft model k tokens ahead of each sequence, on a paged pool of its own."""

    name = "draft"

    def __init__(self, target_lm, draft_lm, n_blocks: int | None = None, block_size: int | None = None):
        t, d = target_lm, draft_lm       # a draft must speak the target's token ids
        if d.vocab_size != t.vocab_size or (d.tokenizer is not t.tokenizer and
                                            d.tokenizer.get_vocab() != t.tokenizer.get_vocab()):
            raise ValueError(f"the draft model's vocabulary ({d.vocab_size} entries) maps tokens to other ids "
                             f"than the target's ({t.vocab_size}): a draft must use the target's tokenizer")
        self.lm = draft_lm
        sizes = {"block_size": block_size} if block_size else {}
        self.allocator = BlockAllocator.for_model(draft_lm, n_blocks=n_blocks, **sizes)
        self.runner = MixedRunner(draft_lm, self.allocator)
        self.states: dict[int, DraftState] = {}       # seq_id -> its draft state
        self.n_out_of_blocks = 0                       # proposals skipped because the draft's pool was full

    def release(self, seq) -> None:
        state = self.states.pop(seq.seq_id, None)
        if state is not None:
            state.kv.release(self.allocator)

    def propose(self, seqs: list, k: int, seeds: list[int]) -> list[Proposal]:
        """k draft passes (phase 3.8's runner), the first feeding every token the draft has not seen."""
        seed_of = {s.seq_id: seed for s, seed in zip(seqs, seeds)}
        active = [(seq, self._state(seq)) for seq in seqs]
        tokens: dict[int, list[int]] = {s.seq_id: [] for s in seqs}
        probs: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s in seqs}
        for _ in range(k):
            chunks = []
            for seq, state in list(active):
                n_new = len(state.all_ids) - state.kv.n_filled
                try:
                    slots = self._append_slots(state, n_new, seqs)
                except OutOfBlocks:      # the draft's pool is full: this sequence proposes what it has
                    self.n_out_of_blocks += 1
                    active.remove((seq, state))
                    continue
                chunks.append(Chunk(state, state.kv.n_filled - n_new, n_new, slots))
            if not chunks:
                break
            logits = self.runner.run(Batch(chunks=chunks))                       # [len(chunks), V]
            for c in chunks:
                c.seq.fed = list(c.seq.all_ids)    # only now: a pass that raised wrote nothing
            picked, q = self._draw(active, logits, seed_of)
            for (seq, state), token, row in zip(active, picked, q):
                tokens[seq.seq_id].append(token)
                if row is not None:
                    probs[seq.seq_id].append(row)
                state.all_ids.append(token)
        return [Proposal(tokens[s.seq_id], torch.stack(probs[s.seq_id]) if probs[s.seq_id] else None) for s in seqs]

    def _append_slots(self, state: DraftState, n: int, proposing: list) -> list[int]:
        """`n` slots of the draft's pool; a full pool first drops the states of sequences not proposing now."""
        try:
            return state.kv.append_slots(self.allocator, n)
        except OutOfBlocks:
            asking = {s.seq_id for s in proposing}
            idle = [seq_id for seq_id in self.states if seq_id not in asking]
            if not idle:
                raise
            for seq_id in idle:
                self.states.pop(seq_id).kv.release(self.allocator)
            return state.kv.append_slots(self.allocator, n)

    def _state(self, seq) -> DraftState:
        """`seq`'s draft state, its table cut back to the longest prefix the sequence still agrees with."""
        ids = seq.all_ids
        if (state := self.states.get(seq.seq_id)) is None:
            state = self.states[seq.seq_id] = DraftState([], BlockTable(self.allocator.block_size), [])
        keep = min(common_prefix(state.fed, ids), len(ids) - 1)   # the last token is fed again: the first guess
        truncate(state.kv, self.allocator, keep)
        state.fed = state.fed[:keep]
        state.all_ids = list(ids)
        return state

    def _draw(self, active: list, logits: torch.Tensor, seed_of: dict[int, int]
              ) -> tuple[list[int], list[torch.Tensor | None]]:
        """Each row's guess: the argmax (greedy), or a draw from the draft's q, returned for acceptance's p / q."""
        params: list[SamplingParams] = [seq.sampling for seq, _ in active]
        vocab = logits.shape[-1]
        if all(p.greedy for p in params):
            return logits.float().argmax(-1).tolist(), [None] * len(params)
        seeds = [_as_int64(seed_of[seq.seq_id]) ^ DRAFT_STREAM for seq, _ in active]
        counters = [len(state.all_ids) for _, state in active]
        rows = sampling_rows(params, seeds, counters, vocab, logits.device)
        picked = sample_rows(logits, rows).tolist()
        q = target_logits(logits, params, vocab).softmax(-1)
        return picked, [None if p.greedy else q[i] for i, p in enumerate(params)]


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of a and b."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def truncate(table: BlockTable, allocator: BlockAllocator, n_filled: int) -> int:
    """Cut `table` back to its first `n_filled` tokens; the blocks past them go back. Returns how many went."""
    if not 0 <= n_filled <= table.n_filled:
        raise ValueError(f"cannot cut a table of {table.n_filled} tokens back to {n_filled}")
    keep = -(-n_filled // table.block_size)
    dropped = table.block_ids[keep:]
    for block_id in reversed(dropped):
        allocator.free(block_id)
    del table.block_ids[keep:]
    table.n_filled = n_filled
    return len(dropped)
