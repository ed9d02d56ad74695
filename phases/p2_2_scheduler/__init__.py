"""Phase 2.2 adds a scheduler to phase 2.1: sequences with a status, a waiting queue and a capped running set (still static batches).

Phase 2.1 took a fixed list of prompts. Here requests are queued one by one
as `Sequence`s that move WAITING -> PREFILLING -> DECODING -> DONE, and a
`Scheduler` admits up to `max_running` of them at a time. It still runs each
admitted group as one static padded batch to its end (phase 2.1's
`PaddedBatch`): a slot freed early stays empty until the whole batch is done.

Files:
- sequence.py   `Status`, `Sequence` (one request's state machine) and `StepOutput` (one token of one step)
- trace.py      `StepRecord` / `Trace`: per-step slot occupancy, the data behind the timelines
- scheduler.py  `Scheduler(lm, max_running)`: add() -> Sequence, step() -> [StepOutput], run()
- README.md     the idea, its files, how to run it; its tables: docs/measurements/p2_2_scheduler.md
"""
