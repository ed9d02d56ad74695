"""Phase 4.5: speculative decoding on phase 4.4's engine: a proposer guesses k tokens per sequence, the target
checks them in one pass, and the KV of rejected guesses rolls back.

Files: engine.py (the plan, the verifying runner and sampler, `SpeculativeEngine`), proposers.py (n-gram, a
draft model, a self-draft), acceptance.py (greedy and rejection-sampling acceptance), demo.py (`spec_demo`).
"""

from phases.p4_5_speculative_decoding.acceptance import Proposal, accept
from phases.p4_5_speculative_decoding.engine import SpecStats, SpeculativeEngine, Verify
from phases.p4_5_speculative_decoding.proposers import DraftProposer, NgramProposer, self_draft, truncate

__all__ = ["Proposal", "accept", "SpecStats", "SpeculativeEngine", "Verify", "DraftProposer",
           "NgramProposer", "self_draft", "truncate"]
