"""`AsyncEngine`: the served engine, stepped by one thread while requests come and go on an asyncio loop.

A forward pass blocks, so the engine lives in a thread that nothing else touches (the README draws the two
sides). The loop posts "add" and "abort" to an inbox; the thread drains it between steps, steps, and hands
each request its `TokenEvent`s with one `loop.call_soon_threadsafe` per step. A step that raises fails only
its culprit's client; an error the engine cannot recover from fails every request in it, as a shutdown does.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import AsyncIterator

from common.sampling import GREEDY, SamplingParams
from phases.p4_1_copy_on_write.engine import SequenceGroup
from phases.p5_1_served_engine.engine import StepFailed
from phases.p5_2_async_engine.detokenize import TextStream

log = logging.getLogger(__name__)

DEFAULT_MAX_WAITING = 64   # requests accepted but not yet producing tokens
STOP_JOIN_TIMEOUT_S = 10   # how long stop() waits for the engine thread to finish its step


class QueueFull(RuntimeError):
    """The waiting line is full: try again later (HTTP 503)."""


class EngineFailed(RuntimeError):
    """The engine raised during a step, or stopped, while this request was in it."""


@dataclass
class TokenEvent:
    index: int               # which of the request's samples (choices[index])
    token_id: int
    finished: bool
    reason: str | None       # the engine's finish_reason once finished: "eos" or "length"


@dataclass
class ChoiceDelta:
    index: int
    text: str                # new text for choices[index] (may be '' on the last delta)
    n_tokens: int            # tokens this sample has generated so far
    finish_reason: str | None = None  # OpenAI's "stop" or "length", on the sample's last delta


class Request:
    """One API request of `n` samples, as the event loop sees it."""

    def __init__(self, request_id: int, prompt_ids: list[int], n: int, max_tokens: int,
                 sampling: SamplingParams, ignore_eos: bool, loop: asyncio.AbstractEventLoop,
                 label: str | None = None):
        self.request_id = request_id
        self.label = label or f"request {request_id}"  # what the logs call it (the API's response id)
        self.prompt_ids = prompt_ids
        self.n = n
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.ignore_eos = ignore_eos
        self.events: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        self.accepted: asyncio.Future = loop.create_future()  # resolved once the engine has queued it
        self.done = [False] * n      # loop side: samples that need nothing more from the engine
        self.waiting = True          # loop side: counts against max_waiting until its first token
        self.group: SequenceGroup | None = None   # engine side: the engine's group, its samples in order
        self.ended: set[int] = set() # engine side: samples finished or aborted
        self.arrival = time.monotonic()        # loop side: when it came


class AsyncEngine:
    def __init__(self, engine, max_waiting: int = DEFAULT_MAX_WAITING):
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.engine = engine            # a ServingEngine
        self.max_waiting = max_waiting
        self.n_queued = 0                              # loop side: requests counted against max_waiting
        self._inbox: deque[tuple[str, Request, int | None]] = deque()
        self._wake = threading.Event()
        self._owner: dict[SequenceGroup, Request] = {}  # engine side: the engine's group -> its request
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

    # --- lifecycle (event loop) -------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will submit requests."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Finish the current step, fail whatever is still in flight, join the thread."""
        if self._thread is None:
            return
        self._stopping = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join, STOP_JOIN_TIMEOUT_S)

    # --- requests (event loop) --------------------------------------------------------
    async def submit(self, prompt_ids: list[int], n: int = 1, max_tokens: int = 16,
                     sampling: SamplingParams = GREEDY, ignore_eos: bool = False,
                     label: str | None = None) -> Request:
        """Queue a request and return once the engine accepted it (`label` names it in the logs). Raises QueueFull
        past `max_waiting`, and the engine's ValueError for a request it can never run."""
        if self._thread is None or self._stopping:
            raise EngineFailed("the engine is not running")
        if self.n_queued >= self.max_waiting:
            raise QueueFull(f"{self.n_queued} requests are already waiting (max_waiting={self.max_waiting}); "
                            "try again later")
        req = Request(next(self._ids), list(prompt_ids), n, max_tokens, sampling, ignore_eos, self._loop, label)
        self.n_queued += 1
        self._post("add", req)
        try:
            await req.accepted
        except asyncio.CancelledError:
            self.abort(req)  # the client left before the engine saw it: drop it right after the add
            raise
        except BaseException:
            self._started(req)
            raise
        return req

    def abort(self, req: Request, index: int | None = None) -> None:
        """End sample `index` (or every sample) now; the engine frees its blocks at the next drain."""
        indices = range(req.n) if index is None else [index]
        if all(req.done[i] for i in indices):
            return
        for i in indices:
            req.done[i] = True
        if all(req.done):
            self._started(req)
        self._post("abort", req, index)

    async def tokens(self, req: Request) -> AsyncIterator[TokenEvent]:
        """Every token of every sample of `req` as it is made; aborts what is left if the consumer leaves."""
        try:
            while not all(req.done):
                event = await req.events.get()
                if isinstance(event, BaseException):
                    raise event
                if req.done[event.index]:
                    continue  # a sample already ended here (stop string); its last tokens were in flight
                req.done[event.index] = event.finished
                yield event
        finally:
            if not all(req.done):
                self.abort(req)

    async def texts(self, req: Request, stops: list[str] | None = None) -> AsyncIterator[ChoiceDelta]:
        """Text deltas per sample, detokenized incrementally (detokenize.py); a stop string ends its sample early."""
        streams = [TextStream(self.engine.lm.tokenizer, stops) for _ in range(req.n)]
        async for ev in self.tokens(req):
            stream = streams[ev.index]
            delta = stream.push(ev.token_id)
            if stream.stopped:
                self.abort(req, ev.index)  # the engine stops making tokens nobody will read
                yield ChoiceDelta(ev.index, delta + stream.finish(), stream.n_tokens, "stop")
            elif ev.finished:
                reason = "length" if ev.reason == "length" else "stop"  # EOS is a "stop" in OpenAI's terms
                yield ChoiceDelta(ev.index, delta + stream.finish(), stream.n_tokens, reason)
            elif delta:
                yield ChoiceDelta(ev.index, delta, stream.n_tokens)

    # --- loop-side callbacks (scheduled from the engine thread) --------------------------
    def _started(self, req: Request) -> None:
        """`req` no longer counts as waiting (first token, refusal, or abort)."""
        if req.waiting:
            req.waiting = False
            self.n_queued -= 1

    def _settle(self, req: Request, error: BaseException | None) -> None:
        if req.accepted.done():
            return  # the client already left (cancelled)
        if error is None:
            req.accepted.set_result(None)
        else:
            req.accepted.set_exception(error)

    def _deliver(self, batch: dict[Request, list]) -> None:
        for req, events in batch.items():
            self._started(req)
            for ev in events:
                req.events.put_nowait(ev)

    # --- engine thread ----------------------------------------------------------------
    def _post(self, op: str, req: Request, index: int | None = None) -> None:
        self._inbox.append((op, req, index))  # deque.append is atomic: no lock needed
        self._wake.set()

    def _call(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the event loop is closed: nobody is left to tell

    def _run(self) -> None:
        while True:
            self._drain()
            if self._stopping:
                break
            if not self.engine.has_work:
                self._wake.wait()   # idle: sleep until a request or an abort arrives
                self._wake.clear()  # cleared before the next drain, so no wake-up is lost
                continue
            try:
                outputs = self.engine.step()
            except StepFailed as failure:
                self._dispatch(failure.outputs)   # made before the failure: real tokens
                self._fail_culprits(failure)
                outputs = []
            except Exception as e:  # noqa: BLE001 - the engine could not recover: fail what is in it, not the server
                log.exception("engine step %d failed and the engine could not isolate it; failing every request "
                              "in it: %s", self.engine.n_steps, self._labels(self._owner.values()))
                self._fail_all(EngineFailed(f"engine step failed: {type(e).__name__}: {e}"))
                continue
            self._dispatch(outputs)
            self.engine.finished.clear()   # kept for `run()`'s answer; a server has routed their tokens already
        self._fail_all(EngineFailed("the server is shutting down"))

    def _drain(self) -> None:
        while self._inbox:
            op, req, index = self._inbox.popleft()
            if op == "add":
                self._add(req)
            elif req.group is not None:
                self._abort(req, index)

    def _add(self, req: Request) -> None:
        if self._stopping:
            self._call(self._settle, req, EngineFailed("the server is shutting down"))
            return
        try:
            # One group of n samples sharing the prompt's blocks; sample i draws with seed + i.
            req.group = self.engine.add_group(req.prompt_ids, req.max_tokens, req.sampling, req.ignore_eos, n=req.n)
        except ValueError as e:
            self._call(self._settle, req, e)
            return
        self._owner[req.group] = req
        self._call(self._settle, req, None)

    def _abort(self, req: Request, index: int | None) -> None:
        if index is None:
            self.engine.abort_group(req.group)
        else:
            self.engine.abort(req.group.seqs[index])   # the group's members are in sample order
        self._ended(req, range(req.n) if index is None else [index])

    def _ended(self, req: Request, indices) -> None:
        req.ended.update(indices)
        if len(req.ended) == req.n:  # nothing more will come for it: forget it
            self._owner.pop(req.group, None)
            self.engine.forget(req.group)

    @staticmethod
    def _labels(reqs) -> list[str]:
        return sorted({r.label for r in reqs})

    def _fail_culprits(self, failure: StepFailed) -> None:
        """Tell the culprits' clients; log the failure with its traceback and who it touched."""
        culprits = [self._owner[g] for g in failure.failed if g in self._owner]
        retried = [self._owner[g] for g in failure.retried if g in self._owner]
        log.error("engine step %d failed: %s; failed: %s; rolled back to retry in narrower passes: %s",
                  self.engine.n_steps, failure, self._labels(culprits) or "none", self._labels(retried) or "none",
                  exc_info=(type(failure.error), failure.error, failure.error.__traceback__))
        for req in culprits:
            self._ended(req, range(req.n))
            self._call(self._deliver, {req: [EngineFailed(f"engine step failed on this request: {failure}")]})

    def _dispatch(self, outputs) -> None:
        batch: dict[Request, list[TokenEvent]] = defaultdict(list)
        for out in outputs:
            req = self._owner.get(self.engine.group_or_none(out.seq))
            if req is None:
                continue
            index = req.group.index(out.seq)   # the parent is sample 0
            batch[req].append(TokenEvent(index, out.token_id, out.finished,
                                         out.seq.finish_reason if out.finished else None))
            if out.finished:
                self._ended(req, [index])
        if batch:
            self._call(self._deliver, dict(batch))

    def _fail_all(self, error: EngineFailed) -> None:
        """Abort every request in the engine and tell its client (a step raised, or shutdown)."""
        for req in list(self._owner.values()):
            self.engine.abort_group(req.group)
            self.engine.forget(req.group)
            self._call(self._deliver, {req: [error]})
        self._owner.clear()
        # Sequences nobody owns any more (e.g. caught mid-step) must not hold blocks either.
        for seq in list(self.engine.waiting) + self.engine.running + self.engine.swapped_seqs:
            self.engine.abort(seq)
