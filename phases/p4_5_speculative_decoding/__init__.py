"""Phase 4.5: speculative decoding on phase 4.4's engine (engine.py, proposers.py, acceptance.py)."""

from phases.p4_5_speculative_decoding.acceptance import Proposal, accept
from phases.p4_5_speculative_decoding.engine import SpecStats, SpeculativeEngine, Verify
from phases.p4_5_speculative_decoding.proposers import DraftProposer, NgramProposer, self_draft, truncate

__all__ = ["Proposal", "accept", "SpecStats", "SpeculativeEngine", "Verify", "DraftProposer",
           "NgramProposer", "self_draft", "truncate"]
