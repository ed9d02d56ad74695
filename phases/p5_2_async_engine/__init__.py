"""Phase 5.2 adds the async engine to phase 5.1's: one thread steps the served engine for many clients at once, and each client reads its own stream of tokens and text on an asyncio loop.

Files, in reading order:
- detokenize.py    token ids -> text deltas (incremental detokenization, unfinished UTF-8 held back) and stop
                   strings, for one sample
- async_engine.py  `AsyncEngine`: the engine thread, `submit()` (or `QueueFull`), `abort()`, `tokens()` and
                   `texts()`; a failed step fails only its culprit's client
- README.md        the idea, its files, how to run it; its tables: docs/measurements/p5_2_async_engine.md
"""
