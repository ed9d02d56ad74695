"""Preemption stacked with the other phase-4 engines: beam search (p4_2) and prefix caching (p4_3).

Both compose through the hooks, with no change to their code:

- `PreemptingBeamEngine(PreemptingEngine, BeamSearchEngine)`: a beam request is
  a group of k beam slots whose tables share blocks, so it is preempted and
  brought back whole, like a group of samples. Swapping keeps every shared
  block shared (copied once). Recomputation re-prefills each beam's prompt +
  tokens (the full prompt blocks once, shared); the shared *history* of the
  beams is recomputed per beam, which still fits, because admission already
  counted k unshared tails (`worst_case_blocks`). The re-prefill's logits go to
  the beam search exactly as a decode pass's would: one step of the search.
- `PrefixCachingPreemptingEngine(PrefixCachingMixin, PreemptingEngine)`: the
  blocks a recomputed group gives back stay in the prefix cache (cached-free)
  until the pool needs them, so its re-prefill maps every full block that is
  still cached and computes only the rest - vLLM v1's way of making
  recomputation cheap. `_cacheable_ids` widens the lookup from the prompt to
  prompt + outputs; `_blocks_to_admit` stops a sample from counting the same
  shared prompt blocks twice (once as a cache hit, once as forked from its
  lead). Swapping works too: blocks come back as private copies, not
  re-published in the cache.
"""

from __future__ import annotations

from phases.p2_2_scheduler.sequence import Sequence
from phases.p4_2_beam_search.engine import BeamSearchEngine
from phases.p4_3_prefix_caching.engine import PrefixCachingMixin
from phases.p4_4_preemption.engine import PreemptingEngine


class PreemptingBeamEngine(PreemptingEngine, BeamSearchEngine):
    """Beam search, parallel samples and plain requests, with preemption (`add_beam_search` as in p4_2)."""


class PrefixCachingPreemptingEngine(PrefixCachingMixin, PreemptingEngine):
    """Prefix caching with preemption; a recomputed sequence maps its still-cached blocks back in."""

    def _cacheable_ids(self, seq: Sequence) -> list[int]:
        return seq.all_ids  # what `_prefill` feeds: the prompt, or prompt + outputs when recomputing

    def _blocks_to_admit(self, seq: Sequence) -> int:
        need = super()._blocks_to_admit(seq)  # the mixin took off cache hits already held by someone
        lead = self._lead(seq)
        if lead not in (None, seq):
            # PreemptingEngine also took off the full prompt blocks this sample forks from its lead:
            # a hit among them that is held by someone was subtracted twice.
            _, match = self._lookup(seq)
            n_prompt = len(seq.prompt_ids) // self.block_size
            need += sum(1 for e in match.entries[:n_prompt] if self.allocator.refcount(e.block_id) > 0)
        return need
