"""`ContinuousScheduler`: the moment a sequence is DONE, its slot goes to the next WAITING one.

Static batching (phase 2.2) cannot admit anyone into a padded batch halfway,
because all rows share one cache whose length is the same for every row. So
here each sequence owns its own `DynamicCache` (`seq.kv`), and a step runs one
forward pass PER running sequence: a newcomer prefills its prompt while its
neighbours decode their 100th token. The price is the single batched
forward pass: caches of different lengths, one per sequence, do not stack
into one batch.

A step is made of parts, each in its own method:
- `can_admit(seq)`        may the head of the queue start now? (here: a slot is free)
- `new_kv(seq)`           the KV state a sequence gets when admitted
- `free_kv(seq)`          give it back when the sequence leaves the running set
- `kv_bytes(seq)`         bytes of KV the sequence holds right now
- `_prefill(seqs)`, `_decode(seqs)`  the forward passes of a step -> one StepOutput per sequence
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from common.clock import now
from phases.p2_1_naive_batching.batch import cache_bytes
from phases.p2_2_scheduler.scheduler import Scheduler
from phases.p2_2_scheduler.sequence import Sequence, Status, StepOutput
from phases.p2_2_scheduler.trace import DECODE, PREFILL


class ContinuousScheduler(Scheduler):
    """Continuous batching: admit, run one forward per running sequence, retire, refill; every step."""

    def __init__(self, lm, max_running: int = 4):
        super().__init__(lm, max_running)
        self.kv_bytes_at_finish: dict[int, int] = {}   # seq_id -> KV bytes it held when it left

    # -- admission --------------------------------------------------------------------------
    def can_admit(self, seq: Sequence) -> bool:
        """May `seq`, the head of the queue, start now? Here: if a slot is free."""
        return self.n_free_slots > 0

    def _fill_free_slots(self) -> None:
        # First come, first served: only the head of the queue is ever considered, so nobody
        # overtakes it (a long request cannot be starved by a stream of short ones).
        while self.waiting and self.can_admit(self.waiting[0]):
            seq = self._admit()
            seq.kv = self.new_kv(seq)

    # -- KV state: one cache per sequence -----------------------------------------------------
    def new_kv(self, seq: Sequence):
        return DynamicCache()

    def free_kv(self, seq: Sequence) -> None:
        self.kv_bytes_at_finish[seq.seq_id] = self.kv_bytes(seq)
        seq.kv = None

    def kv_bytes(self, seq: Sequence) -> int:
        return cache_bytes(seq.kv) if seq.kv is not None else 0

    # -- forward passes: one per sequence ------------------------------------------------------
    @torch.inference_mode()
    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, kv,
                 logits_to_keep: int = 1) -> torch.Tensor:
        """One forward pass of one sequence whose K/V live in `kv` (its cache).

        input_ids, position_ids: [1, T]. Returns logits [1, 1, V] (the last position).
        No attention mask: a lone sequence has no padding, and the causal mask is all it needs.
        """
        out = self.lm.model(input_ids.to(self.lm.device), position_ids=position_ids.to(self.lm.device),
                            past_key_values=kv, use_cache=True, logits_to_keep=logits_to_keep)
        return out.logits

    def _prefill(self, seqs: list[Sequence]) -> list[StepOutput]:
        """Each sequence's whole prompt, one forward pass each; each samples its first token."""
        outputs = []
        for seq in seqs:
            n = len(seq.prompt_ids)
            logits = self._forward(torch.tensor([seq.prompt_ids]), torch.arange(n).view(1, n), seq.kv)
            outputs += self._emit([seq], logits[:, -1])                         # [1, V]
        return outputs

    def _decode(self, seqs: list[Sequence]) -> list[StepOutput]:
        """Each sequence's last token, one forward pass each."""
        outputs = []
        for seq in seqs:
            # The last generated token is not in the cache yet; it sits at position n_tokens - 1.
            logits = self._forward(torch.tensor([[seq.output_ids[-1]]]), torch.tensor([[seq.n_tokens - 1]]), seq.kv)
            outputs += self._emit([seq], logits[:, -1])
        return outputs

    # -- the step ---------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Fill free slots, run one forward per running sequence, retire the finished ones
        and hand their slots to waiting sequences before returning. One StepOutput per token."""
        dev = self.lm.device
        self._fill_free_slots()
        work = [None if s is None else (PREFILL if s.status is Status.PREFILLING else DECODE) for s in self.slots]
        t_start = now(dev)
        outputs = self._passes(self.running)
        self._record(t_start, now(dev), work)
        for out in outputs:
            if out.finished:
                self._retire(out.seq)
        # A freed slot goes to the next waiting sequence in this same step: no step
        # ever runs with an empty slot while someone waits.
        self._fill_free_slots()
        return outputs

    def _passes(self, running: list[Sequence]) -> list[StepOutput]:
        """The forward passes of one step: here one per running sequence (each its own cache)."""
        outputs: list[StepOutput] = []
        for seq in running:
            outputs += (self._prefill if seq.status is Status.PREFILLING else self._decode)([seq])
        return outputs

    def _retire(self, seq: Sequence) -> None:
        """A DONE sequence leaves the running set: its KV goes back, its slot is free, its result is handed back."""
        self.free_kv(seq)
        self.slots[self.slots.index(seq)] = None          # its slot (a Sequence equals only itself)
        self.returned_at[seq.seq_id] = seq.timing.finish
