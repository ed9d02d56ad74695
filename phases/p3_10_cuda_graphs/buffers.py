"""The decode step's inputs in preallocated device tensors, one row per decoding sequence, updated from what changed.

A CUDA graph replays kernels on fixed addresses, so a decode step's inputs live in tensors allocated once
and overwritten in place, sized for `max_rows` sequences (the engine's max_running) and `max_blocks` entries:

    input_ids    [R] int64        the token each row feeds (its last sampled one)
    positions    [R] int64        its position (= tokens in the pool before it)
    seq_lens     [R] int32        tokens in the pool after this step's write (position + 1); 0: an empty row
    block_tables [R, max_blocks] int32
    slot_mapping [R] int64        where this step's K/V go: computed ON the device from the three above
                                  (`compute_slots`, inside the graph), -1 on empty rows

Row i holds the step's i-th decoding sequence (`batch.decode` order). The host mirrors each row (`RowState`)
and sends only what the device cannot know, not the B x (3 + max_blocks) values nano-vllm rebuilds each step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.sampling import send
from phases.p2_2_scheduler.sequence import Sequence

EMPTY_SLOT = -1


@dataclass(eq=False)  # identity: one object per row a sequence is placed in
class RowState:
    """What the device holds for one row (the host's mirror of it)."""
    seq: Sequence
    token: int | None          # input_ids[row]; None: unknown (never written)
    length: int                # seq_lens[row]; positions[row] = length - 1
    blocks: list[int]          # block_tables[row, :len(blocks)]


class DecodeBuffers:
    """Static decode inputs for up to `max_rows` sequences of up to `max_blocks` blocks each."""

    def __init__(self, max_rows: int, max_blocks: int, block_size: int, device: torch.device | str):
        self.max_rows, self.max_blocks, self.block_size = max_rows, max_blocks, block_size
        self.device = torch.device(device)
        self.input_ids = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_rows, max_blocks, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((max_rows,), EMPTY_SLOT, dtype=torch.int64, device=device)
        self.rows: list[RowState] = []           # rows 0 .. n-1, in order
        self.row_of: dict[int, int] = {}         # seq_id -> its row
        self.longest_blocks = 0                  # most blocks any row's table holds (after the last sync)
        self.n_values_sent = 0                   # host -> device values written by `sync` (rows and entries)
        self.n_syncs = 0

    @property
    def n_rows(self) -> int:
        return len(self.rows)

    def sync(self, seqs: list[Sequence]) -> None:
        """Make row i hold seqs[i], with its next token, position, length and table (slots already claimed)."""
        if len(seqs) > self.max_rows:
            raise ValueError(f"{len(seqs)} decoding sequences do not fit {self.max_rows} static rows")
        self._place(seqs)
        self._send_changes()
        self.n_syncs += 1

    def advance(self) -> None:
        """After a step: every live row's position and length move on by one (its token was fed)."""
        n = self.n_rows
        self.positions[:n] += 1
        self.seq_lens[:n] += 1
        for r in self.rows:
            r.length += 1

    def record_sampled(self, seqs: list[Sequence], ids: torch.Tensor, tokens: list[int]) -> None:
        """Sampled ids [S] on the device (ids[i] is seqs[i]'s) become the next input ids of these sequences'
        rows, on the device; the mirror takes `tokens`, the same ids on the host. So the next sync sends none."""
        rows = [self.row_of[s.seq_id] for s in seqs]
        if rows == list(range(len(rows))):
            self.input_ids[:len(rows)].copy_(ids)                        # the step's rows, in order: one copy
        else:
            self.input_ids[send(torch.tensor(rows), self.device)] = ids  # some of them, or in another order
        for row, token in zip(rows, tokens):
            self.rows[row].token = token

    def row_tokens(self) -> list[int]:
        """Each row's next input as the host knows it: its sequence's last token."""
        return [state.seq.output_ids[-1] for state in self.rows]

    def _place(self, seqs: list[Sequence]) -> None:
        """Row i gets seqs[i]. A sequence that already holds a row takes it along (a copy on the device, its
        mirror with it); a new one gets an unknown row, sent whole. Rows left behind get length 0 and position 0:
        as a bucket's padding they read and write nothing, and their slot lookup stays inside the table."""
        ids = [s.seq_id for s in seqs]
        if ids == list(self.row_of):
            return         # the steady state: the same sequences as last step, in the same rows
        moves = [(self.row_of[i], row) for row, i in enumerate(ids) if self.row_of.get(i, row) != row]
        rows = [self.rows[self.row_of[s.seq_id]] if s.seq_id in self.row_of else RowState(s, None, -1, [])
                for s in seqs]
        if moves:
            src, dst = (send(torch.tensor(side), self.device) for side in zip(*moves))
            for t in (self.input_ids, self.positions, self.seq_lens, self.block_tables):
                t[dst] = t[src]          # t[src] is gathered first, so rows may move into each other's places
        self.seq_lens[len(seqs):self.n_rows] = 0
        self.positions[len(seqs):self.n_rows] = 0
        self.rows, self.row_of = rows, {i: row for row, i in enumerate(ids)}

    def _send_changes(self) -> None:
        """Send what the device cannot know, in two packed copies: rows whose token or length differ from the
        mirror (a sequence joined, or advanced in a mixed pass), and new table entries."""
        row_updates: list[tuple[int, int, int, int]] = []   # (row, token, position, length)
        entries: list[tuple[int, int, int]] = []            # (row, column, block id)
        longest = 0
        for row, (state, token) in enumerate(zip(self.rows, self.row_tokens())):
            length, blocks = state.seq.kv.n_filled, state.seq.kv.block_ids
            if state.token != token or state.length != length:
                row_updates.append((row, token, length - 1, length))
                state.token, state.length = token, length
            longest = max(longest, len(blocks))
            if len(blocks) > self.max_blocks:
                raise ValueError(f"sequence {state.seq.seq_id} holds {len(blocks)} blocks; the static tables "
                                 f"have room for {self.max_blocks}")
            if blocks != state.blocks:
                same = len(state.blocks) if blocks[:len(state.blocks)] == state.blocks else 0
                entries += [(row, col, blocks[col]) for col in range(same, len(blocks))]
                state.blocks = list(blocks)
        self.longest_blocks = longest
        if row_updates:
            values = send(torch.tensor(row_updates, dtype=torch.int64), self.device)
            rows = values[:, 0]
            self.input_ids[rows] = values[:, 1]
            self.positions[rows] = values[:, 2]
            self.seq_lens[rows] = values[:, 3].to(torch.int32)
        if entries:
            values = send(torch.tensor(entries, dtype=torch.int64), self.device)
            self.block_tables[values[:, 0], values[:, 1]] = values[:, 2].to(torch.int32)
        self.n_values_sent += 4 * len(row_updates) + 3 * len(entries)


def compute_slots(buffers: DecodeBuffers, n: int) -> torch.Tensor:
    """slot_mapping[:n] from tables and positions, on the device (no host value): block * block_size + offset,
    EMPTY_SLOT on empty rows. Written in place, so a graph that runs this reads the step's values."""
    bs = buffers.block_size
    pos = buffers.positions[:n]
    block = buffers.block_tables[:n].gather(1, (pos // bs)[:, None]).squeeze(1).to(torch.int64)
    slots = torch.where(buffers.seq_lens[:n] > 0, block * bs + pos % bs, EMPTY_SLOT)
    buffers.slot_mapping[:n].copy_(slots)
    return buffers.slot_mapping[:n]
