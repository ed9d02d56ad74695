"""The decode step's inputs in preallocated device tensors, one row per running sequence, updated from what changed.

A CUDA graph replays kernels on fixed addresses, so a decode step's inputs must
live in tensors allocated once and overwritten in place. They are sized for
`max_rows` sequences (the engine's max_running) and `max_blocks` table entries:

    input_ids    [R] int64        the token each row feeds (its last sampled one)
    positions    [R] int64        its position (= tokens in the pool before it)
    seq_lens     [R] int32        tokens in the pool after this step's write (position + 1); 0: an empty row
    block_tables [R, max_blocks] int32
    slot_mapping [R] int64        where this step's K/V go: computed ON the device from the three above
                                  (`compute_slots`, inside the graph), -1 on empty rows

Rows. The n decoding sequences sit in rows 0 .. n-1 (a step runs rows 0 .. bucket-1;
rows n .. bucket-1 are padding). A sequence keeps its row while it decodes (`_place`).

What changed. The buffers keep a host mirror of what each row holds on the device
(`RowState`); `sync(seqs)` places the sequences, compares the mirror with each one and
sends only what the device cannot know (`_send_changes`). So a step sends a few entries,
not B x (3 + max_blocks) values rebuilt from Python lists. (nano-vllm rebuilds them every
step and copies them into its graph's inputs: simpler, but turning B tables of Python ints
into a tensor each step costs the host more than the rest of a step here.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phases.p2_2_scheduler.sequence import Sequence

EMPTY_SLOT = -1


def send(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`values` (host) on `device`, without making the host wait for the GPU. A copy from ordinary (pageable)
    host memory first waits for everything queued on the stream, which would stall an overlapped step
    (extra_overlap.py) behind the step in flight; from pinned memory it is queued like a kernel. (torch's caching
    host allocator keeps the pinned block alive until the copy has run.)"""
    if device.type == "cuda":
        values = values.pin_memory()
    return values.to(device, non_blocking=True)


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
        self._placed: set[int] = set()           # seq_id of every sequence in a row: the steady state's check
        self.longest_blocks = 0                  # most blocks any row's table holds (after the last sync)
        self.n_values_sent = 0                   # host -> device values written by `sync` (rows and entries)
        self.n_syncs = 0

    @property
    def n_rows(self) -> int:
        return len(self.rows)

    # --- one step -------------------------------------------------------------------------------
    def sync(self, seqs: list[Sequence]) -> list[Sequence]:
        """Make rows 0 .. len(seqs)-1 hold these sequences, each with its next token, position, length and
        table (slots already claimed). Returns the sequences in row order (the order of the step's logits)."""
        if len(seqs) > self.max_rows:
            raise ValueError(f"{len(seqs)} decoding sequences do not fit {self.max_rows} static rows")
        self._place(seqs)
        self._send_changes()
        self.n_syncs += 1
        return [r.seq for r in self.rows]

    def advance(self) -> None:
        """After a step: every live row's position and length move on by one (its token was fed)."""
        n = self.n_rows
        self.positions[:n] += 1
        self.seq_lens[:n] += 1
        for r in self.rows:
            r.length += 1

    def record_sampled(self, ids: torch.Tensor, tokens: list[int]) -> None:
        """The step's sampled ids [n] (device) become the rows' next input; `tokens` is the same on the host."""
        self.input_ids[:len(tokens)].copy_(ids)
        for r, t in zip(self.rows, tokens):
            r.token = t

    def row_tokens(self) -> list[int]:
        """Each row's next input as the host knows it: its sequence's last token."""
        return [state.seq.output_ids[-1] for state in self.rows]

    # --- placing rows ---------------------------------------------------------------------------
    def _place(self, seqs: list[Sequence]) -> None:
        """Put `seqs` in rows 0 .. len(seqs)-1. A sequence keeps its row while it decodes; when one leaves
        (finished, preempted, aborted, or in a prefill pass instead) the last rows move into the holes, so the
        live rows stay a prefix, and the rows left behind get seq_lens 0 and position 0 (they read nothing and
        write nothing)."""
        n = len(seqs)
        if n == len(self.rows) and {s.seq_id for s in seqs} == self._placed:
            return         # the steady state: the same sequences as last step, each already in its row
        wanted = {s.seq_id for s in seqs}
        kept = {state.seq.seq_id: state for state in self.rows if state.seq.seq_id in wanted}
        old = self.rows
        new_rows: list[RowState | None] = [None] * n
        moves_src, moves_dst = [], []
        # Sequences already in a row below n stay there; the rest fill the holes (moved or new).
        for row, state in enumerate(old[:n]):
            if state.seq.seq_id in kept:
                new_rows[row] = state
        holes = [row for row in range(n) if new_rows[row] is None]
        movers = [(row, kept[s.seq.seq_id]) for row, s in enumerate(old) if row >= n and s.seq.seq_id in kept]
        for (src, state), dst in zip(movers, holes):
            new_rows[dst] = state
            moves_src.append(src)
            moves_dst.append(dst)
        placed = {r.seq.seq_id for r in new_rows if r is not None}
        free = iter(row for row in range(n) if new_rows[row] is None)
        for s in seqs:
            if s.seq_id not in placed:
                new_rows[next(free)] = RowState(s, None, -1, [])     # unknown: everything is sent
        if moves_src:
            src = send(torch.tensor(moves_src), self.device)
            dst = send(torch.tensor(moves_dst), self.device)
            for t in (self.input_ids, self.positions, self.seq_lens, self.block_tables):
                t[dst] = t[src]
        if len(old) > n:
            # Rows left behind: empty (length 0), and at position 0, so that as a bucket's padding even the
            # slot lookup (compute_slots' gather of table column position // block_size) stays in the table.
            self.seq_lens[n:len(old)] = 0
            self.positions[n:len(old)] = 0
        self.rows = new_rows
        self._placed = {r.seq.seq_id for r in new_rows}

    def _send_changes(self) -> None:
        """Write what the device does not know yet: changed rows' token/position/length, new table entries.

        A steady decode step changes nothing the device does not know: the sampler wrote each row's next token
        into input_ids on the device (`record_sampled`), positions and lengths advance by one on the device
        (`advance`), and the table gains an entry only when a sequence enters a new block (once every
        block_size steps). What the device cannot know (a new block, a block replaced by copy-on-write, a
        sequence that joined, moved row, came back from preemption, or advanced in a mixed pass) is sent: the
        changed rows' values in one packed host-to-device copy, the new table entries in another."""
        row_updates: list[tuple[int, int, int, int]] = []   # (row, token, position, length)
        entries: list[tuple[int, int, int]] = []            # (row, column, block id)
        longest = 0
        for row, (state, token) in enumerate(zip(self.rows, self.row_tokens())):
            seq = state.seq
            length = seq.kv.n_filled
            if state.token != token or state.length != length:
                row_updates.append((row, token, length - 1, length))
                state.token, state.length = token, length
            blocks = seq.kv.block_ids
            if len(blocks) > longest:
                longest = len(blocks)
            if len(blocks) > self.max_blocks:
                raise ValueError(f"sequence {seq.seq_id} holds {len(blocks)} blocks; the static tables have "
                                 f"room for {self.max_blocks}")
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
