"""`ContinuousScheduler`: the moment a sequence is DONE, its slot goes to the next WAITING one.

Static batching (phase 2.2) cannot admit anyone into a padded batch halfway,
because all rows share one cache whose length is the same for every row. So
here each sequence owns its own `DynamicCache` (`seq.kv`), and a step runs one
forward pass PER running sequence: a newcomer prefills its prompt while its
neighbours decode their 100th token. The price is that we lost the single
batched forward pass (phase 3 gets it back with paged KV and a kernel that
reads many block tables at once).

Override points (phase 3.3 swaps the cache for a `PagedCache`):
- `new_kv(seq)`           the KV state a sequence gets when admitted
- `free_kv(seq)`          give it back when the sequence is DONE
- `kv_bytes(seq)`         bytes of KV the sequence holds right now
- `_forward(seq, ids, positions)` one forward pass of one sequence -> logits [V]
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from common.bench import now
from phases.p2_1_naive_batching.batch import cache_bytes
from phases.p2_2_scheduler.scheduler import Scheduler
from phases.p2_2_scheduler.sequence import Sequence, Status
from phases.p2_2_scheduler.trace import DECODE, PREFILL


class ContinuousScheduler(Scheduler):
    """Continuous batching: admit, run one forward per running sequence, retire, refill; every step."""

    def __init__(self, lm, max_running: int = 4):
        super().__init__(lm, max_running)
        self.kv_bytes_at_finish: dict[int, int] = {}   # seq_id -> KV bytes it held when DONE

    # -- KV state: one cache per sequence (the override points for phase 3) ----------------
    def new_kv(self, seq: Sequence):
        return DynamicCache()

    def free_kv(self, seq: Sequence) -> None:
        self.kv_bytes_at_finish[seq.seq_id] = self.kv_bytes(seq)
        seq.kv = None

    def kv_bytes(self, seq: Sequence) -> int:
        return cache_bytes(seq.kv) if seq.kv is not None else 0

    # -- one sequence's forward pass ---------------------------------------------------------
    @torch.inference_mode()
    def _forward(self, seq: Sequence, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """input_ids, position_ids: [1, T]. Returns the last position's logits [V].

        No attention mask: a lone sequence has no padding, and the causal mask
        is all it needs.
        """
        out = self.lm.model(input_ids.to(self.lm.device), position_ids=position_ids.to(self.lm.device),
                            past_key_values=seq.kv, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1, :]

    def _prefill(self, seq: Sequence) -> torch.Tensor:
        n = len(seq.prompt_ids)
        return self._forward(seq, torch.tensor([seq.prompt_ids]), torch.arange(n).view(1, n))

    def _decode(self, seq: Sequence) -> torch.Tensor:
        # The last generated token is not in the cache yet; it sits at position n_tokens - 1.
        return self._forward(seq, torch.tensor([[seq.output_ids[-1]]]), torch.tensor([[seq.n_tokens - 1]]))

    # -- the step ---------------------------------------------------------------------------------
    def _fill_free_slots(self) -> None:
        for slot in range(self.max_running):
            if self.slots[slot] is None and self.waiting:
                seq = self._admit(slot)
                seq.kv = self.new_kv(seq)

    def step(self) -> list[Sequence]:
        """Fill free slots, run one forward per running sequence, retire the finished ones
        and hand their slots to waiting sequences before returning.

        Returns the sequences that finished during this step.
        """
        dev = self.lm.device
        self._fill_free_slots()
        work = [None if s is None else (PREFILL if s.status is Status.PREFILLING else DECODE) for s in self.slots]
        t_start = now(dev)
        finished: list[Sequence] = []
        for slot, seq in enumerate(self.slots):
            if seq is None:
                continue
            logits = self._prefill(seq) if seq.status is Status.PREFILLING else self._decode(seq)
            t = now(dev)
            if self._emit(seq, logits, t):
                finished.append(seq)
        t_end = now(dev)
        self._record(t_start, t_end, work)
        for seq in finished:
            slot = self.slots.index(seq)
            self.free_kv(seq)
            self.slots[slot] = None
            self.returned_at[seq.seq_id] = seq.timing.finish
        # A freed slot goes to the next waiting sequence in this same step: no step
        # ever runs with an empty slot while someone waits.
        self._fill_free_slots()
        return finished
