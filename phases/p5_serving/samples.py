"""`n` samples of one prompt (the OpenAI `n` parameter), behind one small adapter.

The server asks four things of it: which engine class to build, queue a
request of `n` samples, say which request and which sample a `StepOutput`'s
sequence belongs to, and drop one sample (a stop string) or all of them (the
client went away).

`IndependentSamples` runs the samples as `n` unrelated sequences on the
phase-3.5 engine: each prefills and stores its own copy of the prompt's K/V.
Phase 4.1's copy-on-write engine shares those blocks instead; `SAMPLES`
picks the adapter (one line to switch).
"""

from __future__ import annotations

from dataclasses import replace

from common.sampling import SamplingParams
from phases.p3_5_paged_attention.engine import BatchedPagedEngine


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


SAMPLES = IndependentSamples()
