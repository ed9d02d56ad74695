"""Phase 5.4 adds a view of the KV pool to phase 5.3's engine: one frame of every block's owners per step, streamed to a page while one watches, and the prefix cache's changes as vLLM's KV events.

Files, in reading order:
- watched.py      `WatchedAsyncEngine`: phase 5.3's async engine with step observers (run after each step
                  on the engine thread) and `call_on_engine`
- pool_stream.py  `pool_frame(engine)`: the pool and queues after a step; `PoolWatch` streams frames to the
                  pages that watch (pool_page/ draws them), and costs nothing while none does
- kv_events.py    KV events in vLLM's format (BlockStored, BlockRemoved, AllBlocksCleared; msgpack over ZMQ)
                  from phase 4.3's prefix cache, off by default
- demo.py         `pool_replay <demo>`: a demo's run as one HTML file that draws its pool step by step
- README.md       the idea, its files, how to run it; its tables: docs/measurements/p5_4_pool_view.md
"""
