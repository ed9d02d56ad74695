"""Phase 4.5 adds speculative decoding to phase 4.4's engine: a proposer guesses k tokens per sequence, the target checks them in one pass, and the KV of rejected guesses rolls back.

engine.py       three parts: `SpeculativePlan` (phase 3.8's token budget, what is left turning proposals into
                `Verify` chunks of the step's mixed pass), `VerifyingRunner` (the pass, then the check) and
                `VerifyingSampler` (a checked row gets its token); `SpeculativeEngine` is phase 4.4's
                engine, picking them when asked to speculate
proposers.py    `NgramProposer` (prompt lookup), `DraftProposer` on its own paged pool, `NoProposer`, `self_draft`,
                `truncate`
acceptance.py   greedy acceptance and the rejection-sampling rule that keeps the target's distribution
demo.py         `spec_demo`: acceptance and speed by workload and batch size
"""

from phases.p4_5_speculative_decoding.acceptance import Proposal, accept
from phases.p4_5_speculative_decoding.engine import SpecStats, SpeculativeEngine, Verify
from phases.p4_5_speculative_decoding.proposers import DraftProposer, NgramProposer, self_draft, truncate

__all__ = ["Proposal", "accept", "SpecStats", "SpeculativeEngine", "Verify", "DraftProposer",
           "NgramProposer", "self_draft", "truncate"]
