"""The served engine, and `n` samples of one prompt (the OpenAI `n` parameter) behind one small adapter.

`ServingEngine` (isolation.py) is the last engine of the line: phase 4.4's
(samples over shared blocks, prefix caching, preemption) with phase 4.5's
speculative decoding when asked for, plus two things a server needs: a
failing step fails only the request that caused it, and it forgets a request
once it is over.

The async engine asks five things of `SharedSamples`: queue a request of `n`
samples (one `SequenceGroup`: the prompt is prefilled once and its samples
share its blocks), say which request and which sample a `StepOutput`'s
sequence belongs to, drop one sample (a stop string) or all of them (the
client went away), and forget a request that is over.
"""

from __future__ import annotations

from common.sampling import SamplingParams
from phases.p4_1_copy_on_write.engine import SequenceGroup
from phases.p5_serving.isolation import ServingEngine


class SharedSamples:
    """A request is one `SequenceGroup`; its samples share the prompt's blocks until they write."""
    engine_class = ServingEngine

    def add(self, engine, prompt_ids: list[int], n: int, max_new_tokens: int,
            sampling: SamplingParams, ignore_eos: bool) -> SequenceGroup:
        # Sample i draws with seed + i inside the engine: a seed makes the request reproducible.
        return engine.add_group(prompt_ids, max_new_tokens, sampling, ignore_eos, n=n)

    def keys(self, group: SequenceGroup) -> list[SequenceGroup]:
        return [group]  # groups hash by identity (eq=False)

    def key_of(self, engine, seq) -> SequenceGroup | None:
        return engine.group_or_none(seq)

    def index_of(self, group: SequenceGroup, seq) -> int:
        return group.index(seq)  # members are in sample order: the parent is sample 0

    def abort(self, engine, group: SequenceGroup, index: int | None = None) -> None:
        if index is None:
            engine.abort_group(group)
        else:
            engine.abort(group.seqs[index])  # a sample that made tokens has been forked

    def forget(self, engine, group: SequenceGroup) -> None:
        engine.forget(group)


SAMPLES = SharedSamples()
