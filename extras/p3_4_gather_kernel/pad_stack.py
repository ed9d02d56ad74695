"""The blog's road not taken: gather every sequence's K/V into one padded stack and run ONE forward pass.

Phase 3.3 runs a decode step as N forward passes of batch 1, each sequence
attending its own gathered K/V. The blog asks why not gather every sequence
into a padded tensor, stack them, and run one batched pass, and answers that
this is slower than N calls "in the common case", from the extra padding and
copying. `PadStackScheduler` does exactly that, so `stack_bench` can measure it.
A decode step of N sequences:

  1. gather   for every layer, all N sequences' K/V from the pool into
              [N, n_kv_heads, L, head_dim], right-padded to the longest (L) (this
              phase's gather: the Triton kernel on a GPU, the reference on CPU);
  2. stack    those tensors become one DynamicCache, and an attention mask
              [N, L + 1] hides the padding;
  3. one pass input_ids [N, 1], each sequence at its own position;
  4. scatter  each layer's new K/V (the cache's last column) goes into each
              sequence's next slot in the pool.

Every step copies every sequence's whole context out of the pool, padded to the
longest: the one pass is bought with that copy, and the padding is copied and
attended too. Prefill stays phase 3.3's, one prompt per pass.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from phases.p2_2_scheduler.sequence import Sequence, Status, StepOutput
from phases.p3_3_paged_cache.scheduler import PagedScheduler
from phases.p3_4_gather_kernel.dispatch import gather_kv

K_INDEX, V_INDEX = 0, 1


class PadStackScheduler(PagedScheduler):
    """Phase 3.3's scheduler whose decode step is ONE pass over a padded stack of every sequence's K/V."""

    def _passes(self, running: list[Sequence]) -> list[StepOutput]:
        """Prompts one per pass, as phase 3.3; then every decoding sequence in ONE pass over a padded stack."""
        outputs: list[StepOutput] = []
        decoding = [s for s in running if s.status is Status.DECODING]
        for seq in running:
            if seq.status is Status.PREFILLING:
                outputs += self._prefill([seq])
        if decoding:
            outputs += self._decode_stacked(decoding)
        return outputs

    @torch.inference_mode()
    def _decode_stacked(self, seqs: list[Sequence]) -> list[StepOutput]:
        dev, pool = self.lm.device, self.allocator.kv_store
        tables = [self.block_table(s) for s in seqs]
        lens = [t.n_filled for t in tables]
        longest, width = max(lens), max(t.n_blocks for t in tables)
        block_tables = torch.tensor([t.block_ids + [0] * (width - t.n_blocks) for t in tables], dtype=torch.int32,
                                    device=dev)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        cache = DynamicCache(config=self.lm.model.config)
        for layer in range(pool.shape[1]):                                          # 1. gather, 2. stack
            k, v = gather_kv(pool, layer, block_tables, seq_lens, max_len=longest)  # [N, H_kv, L, D] each
            cache.update(k, v, layer)
        columns = torch.arange(longest + 1, device=dev)
        mask = (columns[None, :] < seq_lens[:, None].long()) | (columns[None, :] == longest)   # [N, L + 1]
        ids = torch.tensor([[s.output_ids[-1]] for s in seqs], device=dev)
        positions = seq_lens[:, None].long()                                        # the new token sits at len
        out = self.lm.model(input_ids=ids, position_ids=positions, attention_mask=mask.long(),
                            past_key_values=cache, use_cache=True)                  # 3. one pass
        slots = torch.tensor([t.append_slots(self.allocator, 1)[0] for t in tables], device=dev)
        blocks, offsets = slots // self.block_size, slots % self.block_size
        for layer, cached in enumerate(cache.layers):                               # 4. scatter
            pool[blocks, layer, K_INDEX, :, offsets] = cached.keys[:, :, -1]
            pool[blocks, layer, V_INDEX, :, offsets] = cached.values[:, :, -1]
        return self._emit(seqs, out.logits[:, -1])
