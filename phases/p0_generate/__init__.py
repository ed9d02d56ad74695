"""Phase 0, the baseline: a decode loop that re-reads the whole sequence every step (no KV cache).

`generate(lm, prompt)` runs the model on prompt + everything generated so far,
takes the last position's logits, picks a token, appends it, and repeats. Each
step therefore costs more than the one before it: step i processes
len(prompt) + i tokens, so a whole generation costs O(n^2) token-passes: the
keys and values of every past token are computed again at every step.

Files:
- generate.py  `generate` / `generate_ids` (the loop), `GenerationResult`, `check_request`, `prompt_to_ids`
- README.md    the idea, its files, how to run it; its tables: docs/measurements/p0_generate.md
"""

from phases.p0_generate.generate import GenerationResult, check_request, generate, generate_ids, prompt_to_ids

__all__ = ["GenerationResult", "check_request", "generate", "generate_ids", "prompt_to_ids"]
