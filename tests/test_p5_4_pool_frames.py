"""Phase 5.4 without a server: a frame reads the pool as the allocator holds it (samples sharing their prompt's
blocks, everything free once they finish), the prefix cache's changes come out as vLLM's KV events and decode
back, and the watched async engine runs its observers after each step and its calls between steps, dropping
an observer that raises. (Over HTTP and in a browser: tests/test_p5_pool_view.py.)
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from common.sampling import SamplingParams
from phases.p4_1_copy_on_write.engine import SharingEngine
from phases.p5_1_served_engine.engine import ServingEngine
from phases.p5_4_pool_view.demo import record
from phases.p5_4_pool_view.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, EventRecordingAllocator,
                                             KVEventBatch, reset_prefix_cache)
from phases.p5_4_pool_view.pool_stream import pool_frame
from phases.p5_4_pool_view.watched import WatchedAsyncEngine

BLOCK = 4
PROMPT = list(range(10, 21))          # 11 tokens: 2 full blocks of 4 and a partial third
N_SAMPLES, N_TOKENS = 3, 6
TIMEOUT_S = 60


def test_a_frame_shows_samples_sharing_their_prompt_blocks_until_they_finish(tiny32):
    engine = SharingEngine(tiny32, max_running=N_SAMPLES, block_size=BLOCK, n_blocks=32)
    engine.add_group(PROMPT, N_TOKENS, SamplingParams(temperature=1.0, seed=1), ignore_eos=True, n=N_SAMPLES)
    first = pool_frame(engine)
    assert first["refs"] == [0] * 32 and [r["queue"] for r in first["seqs"]] == ["waiting"]
    frames = record(engine)
    after_fork = frames[1]
    tables = [row["blocks"] for row in after_fork["seqs"]]
    assert len(tables) == N_SAMPLES and all(t[:2] == tables[0][:2] for t in tables)   # the full prompt blocks
    for b in tables[0][:2]:
        assert after_fork["refs"][b] == N_SAMPLES
    for frame in frames:   # each frame's ref counts are the tables that list each block
        listed = [sum(b in row["blocks"] for row in frame["seqs"]) for b in range(frame["n_blocks"])]
        assert listed == frame["refs"]
    assert sum(f["did"]["cow_copies"] for f in frames) == frames[-1]["totals"]["cow_copies"] > 0
    assert frames[-1]["refs"] == [0] * 32 and not frames[-1]["seqs"]
    assert sum(len(f["finished"]) for f in frames) == N_SAMPLES


def test_the_prefix_cache_speaks_vllms_kv_events(tiny32):
    allocator = EventRecordingAllocator.for_model(tiny32, block_size=BLOCK, n_blocks=8)
    engine = ServingEngine(tiny32, max_running=2, block_size=BLOCK, n_blocks=8, allocator=allocator)
    engine.add_group(PROMPT, 2, ignore_eos=True, n=1)
    engine.run()
    stored = allocator.take_events()
    assert stored and all(isinstance(e, BlockStored) for e in stored)
    assert stored[0].parent_block_hash is None and stored[0].token_ids == PROMPT[:BLOCK]
    assert [e.parent_block_hash for e in stored[1:]] == [e.block_hashes[0] for e in stored[:-1]]   # a chain
    assert all(e.block_size == BLOCK and e.medium == "CPU" and e.lora_id is None for e in stored)
    engine.add_group(list(range(40, 69)), 2, ignore_eos=True, n=1)   # 31 tokens: needs the cached blocks back
    engine.run()
    removed = [e for e in allocator.take_events() if isinstance(e, BlockRemoved)]
    assert removed and {h for e in removed for h in e.block_hashes} <= {e.block_hashes[0] for e in stored}
    assert reset_prefix_cache(allocator) and allocator.take_events() == [AllBlocksCleared()]
    batch = KVEventBatch(ts=time.time(), events=stored + removed + [AllBlocksCleared()])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=KVEventBatch) == batch     # vLLM's wire format, both ways


def test_the_watched_engine_runs_observers_after_steps_and_calls_between_them(tiny32):
    aengine = WatchedAsyncEngine(ServingEngine(tiny32, max_running=2, block_size=BLOCK, n_blocks=32))
    seen, called = [], []

    def broken(engine, outputs):
        raise RuntimeError("a broken watcher")

    async def serve() -> int:
        aengine.start()
        try:
            aengine.add_step_observer(lambda engine, outputs: seen.append((engine.n_steps, len(outputs))))
            aengine.add_step_observer(broken)
            aengine.call_on_engine(lambda: called.append(aengine.engine.n_steps))
            req = await aengine.submit(PROMPT, n=2, max_tokens=N_TOKENS, ignore_eos=True)
            return await asyncio.wait_for(_count(aengine, req), TIMEOUT_S)
        finally:
            await aengine.stop()

    n_tokens = asyncio.run(serve())
    assert n_tokens == 2 * N_TOKENS and called == [0]
    assert [n for _, n in seen] and sum(n for _, n in seen) == 2 * N_TOKENS
    assert [step for step, _ in seen] == sorted({step for step, _ in seen})     # once per step, in order
    assert aengine.step_observers == (aengine.step_observers[0],)              # the broken one is gone


async def _count(aengine, req) -> int:
    return sum([1 async for _ in aengine.tokens(req)])
