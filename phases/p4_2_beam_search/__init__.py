"""Phase 4.2 adds beam search to phase 4.1's engine: k beams fork from their parents every step and share
their common history, freed the moment no beam holds it."""
