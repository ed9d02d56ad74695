"""The pool, step by step: one frame of the engine's KV state per step, for the /pool page and replays.

`pool_frame(engine, ...)` reads, after a step, what the paper's figures draw:

    blocks   refs[b]   how many block tables list block b (0: free or cached-free)     [n_blocks]
             cached    the blocks whose contents the prefix cache names (owned or not)
             evictable the cached-free blocks, first to be evicted first
    seqs     every sequence in a queue: its request, sample, status, block table, progress
    queues   waiting, running, swapped (sequence ids, in queue order)
    step     what this step did: preemptions, copy-on-write copies, prefix-hit blocks, who finished

Any engine of phases 3.6-5 gives a frame (what it lacks, a prefix cache or a swap space, is empty).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from phases.p2_2_scheduler.sequence import Status

POOL_PAGE = Path(__file__).resolve().parent / "pool_page"   # index.html, pool.css, pool.js: draws the frames
PAGE_QUEUE_FRAMES = 64   # frames a slow page may fall behind before it loses the oldest
GONE_CHECK_S = 0.5       # how often a stream checks that its page is still there (idle, it sends a comment)


def counters(engine) -> dict[str, int]:
    """The running totals a frame reports the step's share of."""
    return {"preemptions": getattr(getattr(engine, "stats", None), "n_preemptions", 0),
            "cow_copies": engine.kv.copies.n_copied if hasattr(engine.kv, "copies") else 0,
            "prefix_hit_blocks": engine.cache_stats.blocks_hit if hasattr(engine, "cache_stats") else 0}


def pool_frame(engine, finished=(), before: dict[str, int] | None = None, label_of=None) -> dict:
    """The pool and queues now, between steps on the thread that steps the engine. `finished`: the sequences
    this step finished; `before`: `counters(engine)` before it; `label_of(seq)`: a sequence's request's name."""
    allocator = engine.allocator
    n = allocator.n_blocks
    cached_entry = getattr(allocator, "cached_entry", None)
    evictor = getattr(allocator, "evictor", None)
    group_of = getattr(engine, "group_or_none", None) or getattr(engine, "group_of", None)
    queues = {"running": engine.running, "waiting": list(engine.waiting),
              "swapped": list(getattr(engine, "swapped_seqs", []))}

    def seq_row(seq, where: str) -> dict:
        group = group_of(seq) if group_of else None
        request = group.request_id if group is not None else seq.seq_id
        table = list(seq.kv.block_ids) if seq.kv is not None else []   # a swapped one's are CPU blocks
        return {"id": seq.seq_id, "req": request, "label": label_of(seq) if label_of else f"req {request}",
                "sample": group.index(seq) if group is not None and seq in group.seqs else 0,
                "status": seq.status.name, "queue": where,
                "blocks": table if where != "swapped" else [], "cpu_blocks": table if where == "swapped" else [],
                "prompt": len(seq.prompt_ids), "out": len(seq.output_ids), "max": seq.max_new_tokens}

    now = counters(engine)
    before = before or now
    cpu = getattr(getattr(engine, "swap_space", None), "cpu", None)
    return {
        "step": engine.n_steps, "t": time.time(), "block_size": allocator.block_size, "n_blocks": n,
        "refs": [allocator.refcount(b) for b in range(n)],
        "cached": [b for b in range(n) if cached_entry(b) is not None] if cached_entry else [],
        "evictable": evictor.eviction_order() if evictor is not None else [],
        "cpu_blocks": cpu.n_blocks if cpu is not None else 0,
        "seqs": [seq_row(s, where) for where, seqs in queues.items() for s in seqs],
        "queues": {where: [s.seq_id for s in seqs] for where, seqs in queues.items()},
        "did": {k: now[k] - before[k] for k in now}, "totals": now,
        "finished": [{"id": s.seq_id, "label": label_of(s) if label_of else f"req {s.seq_id}",
                      "reason": s.finish_reason, "out": len(s.output_ids)}
                     for s in finished if s.status is Status.DONE],
    }


class PoolWatch:
    """Frames of the engine's steps to every /pool page watching (`frames()`), observing only while one does."""

    def __init__(self, aengine):
        self.aengine = aengine
        self._pages: set[asyncio.Queue] = set()
        self._before: dict[str, int] | None = None   # engine thread: counters after the last frame
        self._labels: dict[int, str] = {}             # engine thread: seq_id -> label, of the last frame's sequences

    def _label_of(self, seq) -> str:
        """The request's API id; the last frame's are kept, since a request is forgotten before its frame."""
        label = self.aengine.label_of(seq) or self._labels.get(seq.seq_id) or f"seq {seq.seq_id}"
        self._labels[seq.seq_id] = label
        return label

    # --- engine thread ----------------------------------------------------------------
    def observe(self, engine, outputs) -> None:
        """After a step: one frame, handed to the loop (never waits for a page)."""
        finished = [o.seq for o in outputs if o.finished]
        self._send(pool_frame(engine, finished, self._before, self._label_of))

    def _first_frame(self) -> None:
        self._before = counters(self.aengine.engine)
        self._send(pool_frame(self.aengine.engine, (), self._before, self._label_of))

    def _send(self, frame: dict) -> None:
        self._before = frame["totals"]
        self._labels = {row["id"]: row["label"] for row in frame["seqs"]}
        try:
            self.aengine._loop.call_soon_threadsafe(self._fan_out, frame)
        except RuntimeError:
            pass   # the loop is closed: nobody is watching

    # --- event loop -------------------------------------------------------------------
    def _fan_out(self, frame: dict) -> None:
        text = f"data: {json.dumps(frame, separators=(',', ':'))}\n\n"
        for page in self._pages:
            if page.full():
                page.get_nowait()     # this page is behind: it loses its oldest frame
            page.put_nowait(text)

    async def frames(self, gone):
        """Server-sent events for one page until it leaves (`await gone()`: a closed connection raises nothing)."""
        page: asyncio.Queue[str] = asyncio.Queue(maxsize=PAGE_QUEUE_FRAMES)
        self._pages.add(page)
        if len(self._pages) == 1:
            self.aengine.add_step_observer(self.observe)
        self.aengine.call_on_engine(self._first_frame)   # a frame now, even while the engine is idle
        checked = time.monotonic()
        try:
            while True:
                try:
                    yield await asyncio.wait_for(page.get(), GONE_CHECK_S)
                except asyncio.TimeoutError:
                    yield ": idle\n\n"
                if time.monotonic() - checked >= GONE_CHECK_S:
                    if await gone():
                        return
                    checked = time.monotonic()
        finally:
            self._pages.discard(page)
            if not self._pages:
                self.aengine.remove_step_observer(self.observe)
