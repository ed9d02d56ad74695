"""`BeamSearch`: the bookkeeping of one beam-search request, step for step as Hugging Face does it.

Given the logits of the live beams, one `step()` picks which beams live on (and from which parent beam each
one continues), and which hypotheses are finished. It knows nothing about KV blocks: the engine (engine.py)
turns "beam i continues from beam j" into block-table forks.

The rules follow transformers 5.23's `GenerationMixin._beam_search` (generation/utils.py), so
`generate(num_beams=k, do_sample=False)` is the oracle for the best sequence:

- score of a beam = sum of the log-probs of its tokens (fp32, log_softmax of the logits); the first step
  starts from the single prompt beam.
- each step keeps the top `2k` (more precisely `max(2, 1 + n_eos) * k`) continuations over all beams x
  vocabulary, so that k of them are still alive even if the best ones all end here;
- a continuation "hits a stop" when its token is an EOS or it reaches max_new_tokens. The k best
  continuations that do NOT hit a stop are the next beams. Among the *top k* continuations, those that hit
  a stop become finished hypotheses, scored `sum_logprob / n_generated ** length_penalty` (the EOS token
  counts in n_generated); the k best hypotheses are kept.
- the request stops as HF's `early_stopping` says (`_update_done`).

Masked entries use HF's -1e9 arithmetic (not -inf), so the scores and the ties break exactly as in HF.
The vocabulary-wide work runs on the logits' device; only the C best candidates come to the host, once per
step (`_top_candidates`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

MASKED = -1.0e9  # HF's "impossible" score; kept as a finite number so the arithmetic matches HF exactly


@dataclass
class Hypothesis:
    token_ids: list[int]
    score: float          # sum of log-probs / n_generated ** length_penalty
    finish_reason: str    # "eos" or "length"


class BeamSearch:
    def __init__(self, width: int, max_new_tokens: int, eos_token_ids: set[int] | list[int],
                 length_penalty: float = 1.0, early_stopping: bool | str = False):
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"beam width must be an integer >= 1, got {width!r}")
        if early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
        self.width = width
        self.max_new_tokens = max_new_tokens
        self.eos = torch.tensor(sorted(eos_token_ids), dtype=torch.int64)
        self.length_penalty = float(length_penalty)
        self.early_stopping = early_stopping
        # HF keeps this many continuations per step: enough that `width` survive even if
        # every beam's best continuation is an EOS.
        self.n_candidates = max(2, 1 + len(self.eos)) * width
        # Live beams, best first. Before the first step: the prompt alone, score 0.
        self.running_scores = torch.zeros(1)               # [n_live] fp32 sums of log-probs
        self.running_tokens: list[list[int]] = [[]]
        self.n_generated = 0                               # tokens in every live beam (all equal)
        # The k best finished hypotheses, best first; empty places score MASKED.
        self.finished_scores = torch.full((width,), MASKED)  # [k]
        self.finished: list[Hypothesis | None] = [None] * width
        self.improvable = True   # HF's is_early_stop_heuristic_unsatisfied
        self.done = False

    def step(self, logits: torch.Tensor) -> list[int]:
        """logits [n_live, V] of the live beams, in their current order.

        Returns, for each of the `width` new live beams (best first), the row of
        the beam it continues. Its new token is `running_tokens[i][-1]`.
        """
        if self.done:
            raise RuntimeError("beam search already finished")
        n_live, vocab = logits.shape
        if n_live != len(self.running_tokens):
            raise ValueError(f"expected logits for {len(self.running_tokens)} beams, got {n_live}")
        top_scores, top_index = self._top_candidates(logits)                   # [C] best first, on the CPU
        parents, tokens = top_index // vocab, top_index % vocab                # [C], [C]
        length = self.n_generated + 1                                          # tokens after this step
        hits_stop = torch.isin(tokens, self.eos) | (length >= self.max_new_tokens)  # [C] bool
        candidates = [self.running_tokens[p] + [t] for p, t in zip(parents.tolist(), tokens.tolist())]

        # 1. the next live beams: the best `width` continuations that did not stop
        alive_scores = top_scores + hits_stop.float() * MASKED                  # [C]
        keep = torch.topk(alive_scores, self.width).indices                     # [k]

        # 2. finished hypotheses: only the top `width` continuations may finish here
        top_mask = torch.arange(self.n_candidates) < self.width                 # [C]
        just_finished = hits_stop & top_mask
        scores = top_scores / (length ** self.length_penalty)
        full = bool(self.finished_flags().all()) and self.early_stopping is True
        scores += float(full) * MASKED
        scores += float(not self.improvable) * MASKED
        scores += (~just_finished) * MASKED
        merged_scores = torch.cat([self.finished_scores, scores])              # [k + C]
        merged = self.finished + [Hypothesis(c, float(s), self._reason(c)) if f else None
                                  for c, s, f in zip(candidates, scores, just_finished.tolist())]
        best = torch.topk(merged_scores, self.width).indices                    # [k]
        self.finished_scores = merged_scores[best]
        self.finished = [merged[i] for i in best.tolist()]

        self.running_scores = alive_scores[keep]
        self.running_tokens = [candidates[i] for i in keep.tolist()]
        self.n_generated = length
        self._update_done(hits_stop)
        return parents[keep].tolist()

    def _top_candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The C best (score, flat index into [n_live * V]) continuations, brought to the host.

        The vocabulary-wide work (log-softmax, adding each beam's score, the top-C over all beams x vocabulary)
        runs on the logits' device, a GPU in a real run. Everything the search keeps between steps (scores,
        token lists, finished hypotheses) is a handful of numbers on the CPU. HF runs the vocabulary-wide ops
        on the same device, and the few float32 adds, divides and comparisons done on the host round exactly
        as they would on a GPU, so the search still matches `generate(num_beams=k)` run on the logits' device.
        """
        log_probs = F.log_softmax(logits.float(), dim=-1)                      # [n_live, V] on logits' device
        running = self.running_scores.to(logits.device)                       # [n_live]: a few floats across
        totals = (log_probs + running.unsqueeze(1)).reshape(-1)                # [n_live * V]
        top_scores, top_index = torch.topk(totals, self.n_candidates)          # [C] each, best first
        # One trip to the host per step (the first copy waits for the GPU, the second is ready):
        # the bookkeeping is on C numbers and Python lists, cheaper there than as tiny GPU kernels.
        return top_scores.cpu(), top_index.cpu()

    def finished_flags(self) -> torch.Tensor:
        return torch.tensor([h is not None for h in self.finished])

    def _reason(self, token_ids: list[int]) -> str:
        return "eos" if token_ids[-1] in self.eos.tolist() else "length"

    def _update_done(self, hits_stop: torch.Tensor) -> None:
        """HF's stopping rule for the whole request, evaluated after each step.

        `early_stopping=True` stops as soon as k hypotheses are finished; `False` (the default) stops when the
        best live beam, scored as if it ended now, `score / n_generated ** length_penalty`, can no longer beat
        the worst kept hypothesis; `"never"` with length_penalty > 0 uses max_new_tokens in that estimate
        instead. Also stops when every continuation hits a stop (max_new_tokens reached). Once improvement is
        judged impossible, no further hypothesis is accepted (`improvable` masks them in `step`)."""
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_new_tokens   # a longer beam may still score better
        else:
            best_length = self.n_generated
        best_possible = self.running_scores[0] / (best_length ** self.length_penalty)
        flags = self.finished_flags()
        worst_kept = torch.where(flags, self.finished_scores.min(), torch.tensor(MASKED))
        self.improvable = self.improvable and bool((best_possible > worst_kept).any())
        all_full = bool(flags.all()) and self.early_stopping is True
        self.done = not self.improvable or all_full or bool(hits_stop.all())

    @property
    def hypotheses(self) -> list[Hypothesis]:
        """The finished hypotheses, best first."""
        return [h for h in self.finished if h is not None]
