"""`OverlappedDecodeEngine`: the host schedules decode step N+1 while the GPU still runs step N (phase 3.10's extra).

With CUDA graphs a decode step's wall time still holds the host's Python work (claiming slots, comparing rows,
appending tokens, finish checks), and `StaticDecodeEngine` does it in series with the GPU, because each step
waits for the sampled ids before the next one is built. This engine pipelines consecutive decode-only steps,
as vLLM V1's async scheduling does:

    call k:  [host: claim slots, sync rows for step k] -> launch step k (graph, sampler,
             a non-blocking copy of the ids to pinned host memory, an event)
             -> wait for step k-1's event -> [host: append its tokens, finish checks]
             -> return step k-1's outputs

The GPU orders step k after step k-1 (one stream), and step k's input ids are step k-1's sampled ids, copied
on the device (`OverlapBuffers.record_pending`): the host never needs a token to launch the next step. What
the host cannot know in advance is an EOS: a sequence that ends on one at step k-1 has already been given a
row in step k, which is wasted (`_complete`).

Only steady decode streaks overlap: a step with prefill chunks, or one that would admit a waiting request,
first completes the pass in flight and then runs as phase 3.8/3.10 do (`_rows_to_launch`).

On a CPU nothing runs asynchronously (the copy is a clone, the "wait" returns at once), so the tests there
check the bookkeeping: equal outputs, wasted rows, no leaked block. What the overlap buys is a GPU
measurement (`graph_workload`, `graph_bench`). It is a speed extra beside phase 3.10's engine, not a step
of the engine line: beams, forks, preemption and the server's aborts would each need their own answer to a
step in flight.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from phases.p2_2_scheduler.sequence import Sequence, Status, StepOutput
from phases.p3_6_batched_engine.attention import use_paged_attention
from phases.p3_10_cuda_graphs.buffers import DecodeBuffers, RowState
from phases.p3_10_cuda_graphs.engine import StaticDecodeEngine

HOST_BUFFERS = 2     # pinned host buffers for sampled ids: one being filled by step k, one read for step k-1


class OverlapBuffers(DecodeBuffers):
    """The static buffers of overlapped steps: a row's next input may be on the device only, sampled by the
    step in flight and not yet read by the host. Such a row is pending until `settle`: the host sends it no
    token, since the one it knows is a step old."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pending: set[RowState] = set()     # rows whose input_ids[row] only the device knows

    def record_pending(self, ids: torch.Tensor) -> None:
        """The step's sampled ids [n] become the rows' next input on the device, before the host reads them."""
        self.input_ids[:len(ids)].copy_(ids)
        self.pending = set(self.rows[:len(ids)])

    def record_sampled(self, seqs: list[Sequence], ids: torch.Tensor, tokens: list[int]) -> None:
        super().record_sampled(seqs, ids, tokens)
        self.pending.clear()

    def settle(self, seqs: list[Sequence], tokens: list[int]) -> None:
        """The host has read the pending tokens of these sequences' rows: the mirror holds them again."""
        read = {s.seq_id: t for s, t in zip(seqs, tokens)}
        for r in self.rows:
            if r in self.pending and r.seq.seq_id in read:
                r.token = read[r.seq.seq_id]
        self.pending = {r for r in self.pending if r.seq.seq_id not in read}

    def row_tokens(self) -> list[int]:
        """A pending row keeps the token the mirror holds (nothing is sent for it); nothing else of such a row
        may have moved."""
        tokens = []
        for state in self.rows:
            if state in self.pending:
                if state.length != state.seq.kv.n_filled:
                    raise RuntimeError(f"sequence {state.seq.seq_id}: its row's length changed ({state.length} -> "
                                       f"{state.seq.kv.n_filled}) while its next token was pending on the device")
                tokens.append(state.token)
            else:
                tokens.append(state.seq.output_ids[-1])
        return tokens


class SampledIds:
    """A step's sampled ids [n] on their way to the host: on CUDA a non-blocking copy into pinned memory
    and an event after it, so launching the next step does not wait; elsewhere a plain copy."""

    def __init__(self, ids: torch.Tensor, host_buffer: torch.Tensor | None):
        self.n = ids.shape[0]
        self.event = None
        if ids.is_cuda:
            self.host = host_buffer[:self.n]
            self.host.copy_(ids, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(ids.device))   # the stream the copy was queued on
        else:
            self.host = ids.clone()

    def read(self) -> list[int]:
        """The ids on the host: waits for the copy only (not for later work queued on the GPU)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


@dataclass
class InFlight:
    """A decode step launched but not yet read back: its sequences in row order and their sampled ids."""
    rows: list[Sequence]
    ids: SampledIds


class OverlappedDecodeEngine(StaticDecodeEngine):
    """`StaticDecodeEngine` whose consecutive decode-only steps overlap: step N+1 is built and launched
    before step N's tokens are read. `step()` returns the tokens of the step before the one it launched.

    Greedy tokens equal HF `generate` (fp32), as the engine's do, and a seeded draw depends only on (seed,
    output index, token), which `DeviceSampler.draw(ahead=1)` keeps. Admissions happen a step later than in
    `StaticDecodeEngine`. (On a GPU, in bf16, a wasted row or a later admission can change a step's bucket or
    split count and so the rounding: greedy near-ties may then differ from `StaticDecodeEngine`'s, as between
    any two batch compositions.)"""

    overlaps_steps = True      # for timers (measure/step_bench.py): do not synchronise between steps

    def __init__(self, lm, *args, **kwargs):
        super().__init__(lm, *args, **kwargs)
        # Whichever runner make_runner gave, its buffers become overlap buffers: no step has run yet, so no graph
        # has recorded their addresses.
        b = self.runner.buffers
        self.runner.buffers = OverlapBuffers(b.max_rows, b.max_blocks, b.block_size, b.device)
        self._in_flight: InFlight | None = None
        self._undelivered: list[StepOutput] = []   # outputs of a pass completed outside step() (abort)
        on_cuda = torch.device(lm.device).type == "cuda"
        self._host_ids = [torch.empty(self.max_running, dtype=torch.int64, pin_memory=True) if on_cuda else None
                          for _ in range(HOST_BUFFERS)]
        self._next_buffer = 0
        self.n_overlapped_steps = 0                   # decode steps launched before the previous one was read
        self.n_wasted_rows = 0                        # rows of sequences that had ended on an EOS in flight

    @property
    def has_work(self) -> bool:
        return super().has_work or self._in_flight is not None or bool(self._undelivered)

    # --- one step -------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        previous, self._in_flight = self._in_flight, None
        rows = self._rows_to_launch(previous)
        if previous is None and rows is None:
            return self._undelivered_and(super().step())       # prefill, admission, mixed pass: in series
        with use_paged_attention(self.lm.model, self.runner.attention_name):
            if rows:
                try:
                    self._in_flight = self._launch(rows, ahead=previous is not None)
                except Exception:
                    self._in_flight = previous       # not lost: the next step() reads it
                    raise
                self.n_steps += 1
                self.n_overlapped_steps += previous is not None
            outputs = self._complete(previous) if previous is not None else []
        return self._undelivered_and(outputs)

    def _rows_to_launch(self, previous: InFlight | None) -> list[Sequence] | None:
        """The sequences of the next overlapped decode step, or None when the next step must wait for the
        pass in flight (or is not a decode-only step): prefill still due, or a waiting request the pool
        could take now."""
        statuses = [s.status for s in self.running]     # one pass; `in` and `count` below scan it in C
        if Status.PREFILLING in statuses:
            return None
        if self.waiting and self.n_free_slots:
            head, admission = self.waiting[0], self.admission
            if admission.can_admit(head, admission.blocks_left()):
                return None
        if previous is None:
            return [s for s in self.running if s.status is Status.DECODING] or None
        # Every decoding sequence must be in flight. Those of the rows in flight that still decode are among
        # them (a row holds one sequence), so equal counts mean the same sequences.
        live = [s for s in previous.rows if s.status is Status.DECODING]
        if len(live) != statuses.count(Status.DECODING):
            return None
        # A sequence whose token in flight is its last (by length) is left out; one that ended on an EOS
        # in flight cannot be known yet and keeps its row.
        return [s for s in live if len(s.output_ids) + 1 < s.max_new_tokens] or None

    def _launch(self, seqs: list[Sequence], ahead: bool) -> InFlight:
        """Claim a slot per row, run one static decode step and draw its tokens, all queued on the device;
        start their copy home. Nothing here waits for the GPU: host values go through pinned memory
        (`common.sampling.send`)."""
        for s in seqs:
            self.kv.append_slots(s, 1)
        logits = self.runner.static_pass(seqs)   # [n, V], row i seqs[i]'s
        self.kv.written(seqs)                     # queued, not run: the peak of blocks held is what it reads
        ids = self.sampler.draw(seqs, logits, ahead=int(ahead))
        self.runner.buffers.record_pending(ids)   # the next step's input ids, on the device
        buffer = self._host_ids[self._next_buffer]
        self._next_buffer = (self._next_buffer + 1) % HOST_BUFFERS
        return InFlight(seqs, SampledIds(ids, buffer))

    def _complete(self, flight: InFlight) -> list[StepOutput]:
        """Read a launched step's tokens and hand them to its sequences (finish checks, timings, retiring).

        A row whose sequence ended on an EOS while it was in flight is wasted: its token is dropped
        (`n_wasted_rows`), its K/V write landed in a slot the sequence's worst-case reservation already
        covered, and the block goes back with the rest when the sequence retired."""
        tokens = flight.ids.read()
        live = [(s, t) for s, t in zip(flight.rows, tokens) if s.status is Status.DECODING]
        self.n_wasted_rows += len(flight.rows) - len(live)
        seqs, tokens = [s for s, _ in live], [t for _, t in live]
        # The ids were read after their own event; a synchronised clock would wait for the step launched
        # since, putting host and GPU back in series.
        outputs = self.update(seqs, tokens, t=time.perf_counter())
        if self._in_flight is None:
            self.runner.buffers.settle(seqs, tokens)   # nothing launched after it: the mirror is current
        return outputs

    def _undelivered_and(self, outputs: list[StepOutput]) -> list[StepOutput]:
        held, self._undelivered = self._undelivered, []
        return held + outputs

    # --- leaving early --------------------------------------------------------------------------
    def abort(self, seq: Sequence) -> None:
        """Complete the pass in flight first (its outputs come with the next step), then abort as before."""
        if self._in_flight is not None:
            flight, self._in_flight = self._in_flight, None
            self._undelivered += self._complete(flight)
        super().abort(seq)
