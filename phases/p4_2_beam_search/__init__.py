"""Phase 4.2 adds beam search to phase 4.1's engine: k beams fork from their parents every step and share their common history, freed the moment no beam holds it.

Files:
- beam.py    `BeamSearch`: scores, finished hypotheses and the stopping rule, as transformers'
             generate(num_beams=k)
- engine.py  `BeamSearchEngine(SharingEngine)`: `add_beam_search(...)` -> `BeamGroup`, the beams run in the
             engine's batched decode, re-forking their tables every step (phase 4.1's fork)
- demo.py    `share_demo`: memory saved by sharing, parallel sampling and beam search, next to the vLLM
             paper's numbers
- README.md  the idea, its files, how to run it; its tables: docs/measurements/p4_2_beam_search.md
"""
