"""Phase 4.2: beam search over shared blocks: k beams fork from their parents every step and share their common history, freed the moment no beam holds it.

- beam.py    `BeamSearch`: scores, finished hypotheses and the stopping rule, as transformers' generate(num_beams=k)
- engine.py  `BeamSearchEngine(SharingEngine)`: `add_beam_search(...)` runs the beams in the engine's batched decode,
             re-forking their tables every step (phase 4.1's fork)
- demo.py    `share_demo`: memory saved by sharing, parallel sampling and beam search, next to the vLLM paper's numbers
"""
