"""Phase 2.2 adds a scheduler to phase 2.1: sequences with a status, a waiting queue and a capped running set (still static batches).

Requests are queued one by one as `Sequence`s (WAITING -> PREFILLING -> DECODING -> DONE), and a
`Scheduler` admits up to `max_running` at a time, each group run to its end as one phase-2.1
`PaddedBatch`. The files, in reading order: README.md.
"""
