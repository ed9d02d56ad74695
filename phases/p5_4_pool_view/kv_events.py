"""KV events in vLLM's format: what entered and left the prefix cache, msgpack over ZMQ.

A KV-aware router sends a request to the replica that already holds its prompt's blocks, and learns
which blocks each replica holds from its event stream. The messages are vLLM's
(`vllm/distributed/kv_events.py`), field for field, so a tool that decodes vLLM's decodes ours:

    KVEventBatch  [ts, events, data_parallel_rank]               one per engine step that changed the cache
    BlockStored   ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    BlockRemoved  ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared ["AllBlocksCleared"]

(msgspec structs as arrays, the tag first.) A ZMQ message is [topic, sequence number (8 bytes, big-endian),
payload], as vLLM's; a gap in the numbers is a lost batch. One BlockStored names one block (vLLM's may name
a run: a consumer reads both along `block_hashes`).
"""

from __future__ import annotations

import time

import msgspec
import zmq

from phases.p4_3_prefix_caching.evictor import Evictor
from phases.p4_3_prefix_caching.prefix_cache import CachedBlock, PrefixCachingAllocator

DEFAULT_KV_EVENTS_TOPIC = ""      # vLLM's default: subscribers take every message
SEND_HWM = 100_000                # messages queued for a slow subscriber before ZMQ drops (vLLM's default)


# --- the messages (vLLM's field names and order) ------------------------------------------------
class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the events; `tag=True` puts the class name first in the array."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None     # None: the first block of a prompt
    token_ids: list[int]              # the tokens of every block in `block_hashes`, in order
    block_size: int
    lora_id: int | None               # we serve no adapters: always None
    medium: str | None                # where the block lives: "GPU" or "CPU" (the pool's device)


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# --- where they come from -----------------------------------------------------------------------
class EventRecordingAllocator(PrefixCachingAllocator):
    """Phase 4.3's allocator, noting each change of its hash table as a vLLM event (`take_events`): `register`
    of a new entry (BlockStored), `_forget` of an evicted one (BlockRemoved)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.medium = "GPU" if self.kv_store.device.type == "cuda" else "CPU"   # vLLM's name for the pool's place
        self._events: list[KVCacheEvent] = []

    def register(self, block_id: int, block_hash: int, tokens: tuple[int, ...],
                 parent: CachedBlock | None) -> CachedBlock | None:
        was_cached = self.cached_entry(block_id) is not None
        entry = super().register(block_id, block_hash, tokens, parent)
        if entry is not None and not was_cached and entry.block_id == block_id:   # a new entry, not a twin's
            self._events.append(BlockStored([block_hash], None if parent is None else parent.block_hash,
                                            list(tokens), self.block_size, None, self.medium))
        return entry

    def _forget(self, block_id: int) -> None:
        block_hash = self.cached_entry(block_id).block_hash
        super()._forget(block_id)
        self._events.append(BlockRemoved([block_hash], self.medium))

    def take_events(self) -> list[KVCacheEvent]:
        """The events since the last call, oldest first."""
        events, self._events = self._events, []
        return events


def reset_prefix_cache(allocator: PrefixCachingAllocator) -> bool:
    """vLLM's `reset_prefix_cache`, on the engine thread: every cached block forgotten and truly free, only when
    no block is in use (a table holding one would lose its name). Returns whether it cleared."""
    if allocator.n_used:
        return False
    for block_id in allocator.evictor.eviction_order():
        allocator._entry[block_id] = None
        allocator._free_list.append(block_id)
    allocator._table.clear()
    allocator.evictor = Evictor()
    if isinstance(allocator, EventRecordingAllocator):
        allocator._events.append(AllBlocksCleared())
    return True


class ZmqEventPublisher:
    """A step observer: sends the allocator's new events as one `KVEventBatch` on a ZMQ PUB socket, which never
    blocks the engine thread (no subscriber: dropped; a slow one: queued up to `SEND_HWM`)."""

    def __init__(self, allocator: EventRecordingAllocator, endpoint: str, topic: str = DEFAULT_KV_EVENTS_TOPIC):
        self.allocator = allocator
        self._pub = zmq.Context.instance().socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)   # the real port when bound to :0
        self._topic = topic.encode()
        self._encoder = msgspec.msgpack.Encoder()
        self.seq = 0                  # the sequence number of the next batch

    def __call__(self, engine, outputs) -> None:
        events = self.allocator.take_events()
        if not events:
            return
        payload = self._encoder.encode(KVEventBatch(ts=time.time(), events=events))
        self._pub.send_multipart((self._topic, self.seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        self.seq += 1

    def close(self) -> None:
        self._pub.close(linger=0)
