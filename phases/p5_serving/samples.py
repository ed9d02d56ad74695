"""`n` samples of one prompt (the OpenAI `n` parameter), behind one small adapter.

The async engine asks five things of it: which engine class to build, queue
a request of `n` samples, say which request and which sample a
`StepOutput`'s sequence belongs to, drop one sample (a stop string) or all
of them (the client went away), and forget a request that is over.

- `IndependentSamples`: `n` unrelated sequences on the phase-3.5 engine;
  each prefills and stores its own copy of the prompt's K/V.
- `SharedSamples`: phase 4.1's `SharingEngine` prefills the prompt once and
  forks `n` samples over the same blocks (copy-on-write).

`SAMPLES` picks the adapter: switching is one line.
"""

from __future__ import annotations

from dataclasses import replace

from common.sampling import SamplingParams
from phases.p3_5_paged_attention.engine import BatchedPagedEngine
from phases.p4_1_copy_on_write.engine import SequenceGroup, SharingEngine


class IndependentSamples:
    """A request's samples are plain sequences; the request is the list of them."""
    engine_class = BatchedPagedEngine

    @staticmethod
    def sampling_for(sampling: SamplingParams, index: int) -> SamplingParams:
        # A seed makes a request reproducible; seed + i keeps its n samples distinct.
        return sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + index)

    def add(self, engine, prompt_ids: list[int], n: int, max_new_tokens: int,
            sampling: SamplingParams, ignore_eos: bool) -> list:
        """Queue `n` sequences; all or none (a refused one takes the others back out)."""
        seqs = []
        try:
            for i in range(n):
                seqs.append(engine.add(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens,
                                       sampling=self.sampling_for(sampling, i), ignore_eos=ignore_eos))
        except ValueError:
            for seq in seqs:
                engine.abort(seq)
            raise
        return seqs

    def keys(self, ticket: list) -> list[int]:
        """Every key `key_of` may report for this request's sequences."""
        return [seq.seq_id for seq in ticket]

    def key_of(self, engine, seq) -> int:
        return seq.seq_id

    def index_of(self, ticket: list, seq) -> int:
        """Which of the request's samples `seq` is (its `choices[i]` in the response)."""
        return ticket.index(seq)

    def abort(self, engine, ticket: list, index: int | None = None) -> None:
        """Drop sample `index`, or every sample; the engine frees their blocks at once."""
        for i, seq in enumerate(ticket):
            if index is None or i == index:
                engine.abort(seq)

    def forget(self, engine, ticket: list) -> None:
        """Nothing to do: the engine keeps no per-request records."""


class ServingSharingEngine(SharingEngine):
    """`SharingEngine` that drops a request's records once it is over: a server runs for days."""

    def group_or_none(self, seq) -> SequenceGroup | None:
        return self._group_of.get(seq.seq_id)

    def forget(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            self._group_of.pop(seq.seq_id, None)
        if group in self.groups:
            self.groups.remove(group)  # the groups still in flight: a short list
        self.usage.clear()             # per-pass sharing statistics, for demos


class SharedSamples:
    """A request is one `SequenceGroup`; its samples share the prompt's blocks until they write."""
    engine_class = ServingSharingEngine

    def add(self, engine, prompt_ids: list[int], n: int, max_new_tokens: int,
            sampling: SamplingParams, ignore_eos: bool) -> SequenceGroup:
        # Sample i draws with seed + i inside the engine, as IndependentSamples does.
        return engine.add(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling,
                          ignore_eos=ignore_eos, n=n)

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
