"""Every file of this repo whose code runs during one step of the served engine, counted honestly.

docs/architecture.md traces a step by the methods that define each stage. A
reader following a step in a debugger meets more: every helper, part and
property on the way. This script runs the served engine on the tiny test
model, brings it to a step that decodes some sequences and prefills another,
and records every Python call made during that one step (`sys.setprofile`).
A repo file counts if any of its code ran; torch and transformers do not.

    python scripts/step_files.py        the files, the calls into each, and how often the step changes file
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OWN = ("phases", "common", "measure", "extras")   # the repo's code; tests and scripts do not run in a step


def served_engine(lm):
    from phases.p5_1_served_engine.engine import ServingEngine
    return ServingEngine(lm, max_running=4, block_size=4, n_blocks=32)


def mixed_step_engine():
    """A served engine whose next step decodes two sequences and prefills a third (the doc's traced step)."""
    import torch

    from common.model import load_model
    lm = load_model("tiny", device="cpu", dtype=torch.float32)
    engine = served_engine(lm)
    for prompt in ([1, 2, 3, 4, 5], [6, 7, 8]):
        engine.add(prompt, max_new_tokens=8)
    engine.step()                  # both prompts prefill
    engine.step()                  # both decode
    engine.add([9, 10, 11, 12], max_new_tokens=8)
    return engine


def trace_step(engine) -> list[str]:
    """The repo file of every Python call during one `engine.step()`, in call order."""
    calls: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            path = Path(frame.f_code.co_filename)
            if path.is_relative_to(ROOT) and path.relative_to(ROOT).parts[0] in OWN:
                calls.append(path.relative_to(ROOT).as_posix())

    sys.setprofile(profile)
    try:
        engine.step()
    finally:
        sys.setprofile(None)
    return calls


def step_files() -> tuple[Counter, int]:
    """(calls per file, times the step moved from one file to another) for one mixed step."""
    calls = trace_step(mixed_step_engine())
    switches = sum(a != b for a, b in zip(calls, calls[1:]))
    return Counter(calls), switches


def main() -> int:
    files, switches = step_files()
    for path, n in sorted(files.items()):
        print(f"{n:6d}  {path}")
    print(f"\n{len(files)} files run in one served step; the step changes file {switches} times")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
