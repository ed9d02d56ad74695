"""No phase names a later one: each phase's files read on their own, with what this phase does and why.

A file in phase k (its folder `pN_M_*` is phase N.M, `pN_*` is phase N) may name phase k and those
before it, never one after. The scan reads the raw text of every .py file under a phase folder
(docstrings, comments and code alike: an import of a later phase is a mention too) with two patterns:

- PHASE_WORDS: the word "phase" or "phases" followed by a list of numbers, e.g. "phase 4.4",
  "Phase 4", "phase-4.4", "phases 3.6 and 3.7", "phases 3.5, 3.6, and 3.7", "phase 3.5/3.6",
  "phases 3.5-3.7" (or 3.5–3.7, or "3.5 to 3.7"). A range counts every phase in it: its two ends
  and each phase folder between them. Every number of the list counts, so "phase 2.3 and 4 rows"
  reads as phases 2.3 and 4: reword such a sentence.
- MODULE_NAMES: a phase folder's name or its short form, in any case, e.g. `p4_3`,
  `p4_3_prefix_caching`, `p5_serving`, `P3_5_ENGINES`.

A phase named by its major number alone ("phase 4") is phase 4.0: later than every 3.x, not later than 4.2.
The scan does not look for a bare number after the word in an earlier clause ("phase 3.5 ... 4.1's").

`python -m tests.test_layering` prints the per-file counts.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

Phase = tuple[int, int]   # (3, 5) is phase 3.5; (5, 0) is phase 5

NUMBER = r"\d(?:\.\d{1,2})?(?!\d|\.\d)"              # 4, 4.4, 3.10; not 4.456 or 44
JOIN = r"\s*(?:,\s*(?:and|or)\b|,|/|-|–|\bto\b|\band\b|\bor\b)\s*"   # between two numbers of one list
PHASE_WORDS = re.compile(rf"\bphases?(?:\s+|-)({NUMBER}(?:{JOIN}{NUMBER})*)", re.IGNORECASE)
LIST_PART = re.compile(rf"({NUMBER})(\s*(?:-|–|\bto\b)\s*)?", re.IGNORECASE)
MODULE_NAMES = re.compile(r"\bp(\d)(?:_(\d+))?(?=_[a-z]|\b)", re.IGNORECASE)
FOLDER = re.compile(r"^p(\d)(?:_(\d+))?_")


def phase_of(number: str) -> Phase:
    major, _, minor = number.partition(".")
    return int(major), int(minor or 0)


def folder_phase(folder: str) -> Phase | None:
    """The phase of a folder under phases/: p2_2_scheduler -> (2, 2), p5_serving -> (5, 0); else None."""
    m = FOLDER.match(folder)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def known_phases(root: Path = ROOT) -> list[Phase]:
    return sorted(p for d in (root / "phases").iterdir() if d.is_dir() and (p := folder_phase(d.name)))


def phases_in(numbers: str, known: list[Phase]) -> list[Phase]:
    """Every phase a list names: '3.6 and 3.7' -> two; '3.5-3.7' -> 3.5, the known phases between, 3.7."""
    named, range_from = [], None
    for m in LIST_PART.finditer(numbers):
        phase = phase_of(m.group(1))
        if range_from is not None:
            named += [p for p in known if range_from < p < phase]
        named.append(phase)
        range_from = phase if m.group(2) else None
    return named


def mentions(text: str, known: list[Phase]):
    """(line, matched text, phase) for every phase that `text` names."""
    for m in PHASE_WORDS.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        for phase in phases_in(m.group(1), known):
            yield line, m.group(0), phase
    for m in MODULE_NAMES.finditer(text):
        yield text.count("\n", 0, m.start()) + 1, m.group(0), (int(m.group(1)), int(m.group(2) or 0))


def later_mentions(text: str, own: Phase, known: list[Phase]) -> list[tuple[int, str, Phase]]:
    return [found for found in mentions(text, known) if found[2] > own]


def phase_files(root: Path = ROOT):
    """(path relative to root, its phase) for every .py file under a phase folder."""
    for folder in sorted((root / "phases").iterdir()):
        own = folder_phase(folder.name) if folder.is_dir() else None
        if own is not None:
            for path in sorted(folder.rglob("*.py")):
                yield path.relative_to(root).as_posix(), own


def later_mentions_by_file(root: Path = ROOT) -> dict[str, list[tuple[int, str, Phase]]]:
    known = known_phases(root)
    return {rel: found for rel, own in phase_files(root)
            if (found := later_mentions((root / rel).read_text(), own, known))}


def count_later_mentions(root: Path | str = ROOT) -> dict[str, int]:
    """{file: how many times it names a later phase}, for every phase file that does (excluded ones too)."""
    return {rel: len(found) for rel, found in later_mentions_by_file(Path(root)).items()}


def test_no_phase_names_a_later_one():
    found = later_mentions_by_file()
    report = "\n".join(f"{rel}: {len(f)}  (first: line {f[0][0]} {f[0][1]!r})" for rel, f in found.items())
    assert not found, f"mentions of later phases, per file:\n{report}"


def test_the_scan_catches_later_phases_and_passes_earlier_ones():
    known = [(3, 1), (3, 5), (3, 6), (3, 7), (4, 1), (4, 3), (4, 4), (5, 0)]
    planted = ('"""Phase 4.4 needs this; see phases 3.6 and 3.7."""\n'
               "# phases 3.5-3.7 agree, as do phases 3.5–3.7; Phase 4 swaps; PHASE 5 serves\n"
               "from phases.p4_3_prefix_caching.engine import X  # p4_3 and p5 too\n"
               "# phases 3.1, 3.6, and 4.1 To 4.3; the phase-4.4 engine; P3_7_ENGINES\n")
    later = [(line, phase) for line, _, phase in later_mentions(planted, (3, 5), known)]
    assert later == [(1, (4, 4)), (1, (3, 6)), (1, (3, 7)), (2, (3, 6)), (2, (3, 7)), (2, (3, 6)), (2, (3, 7)),
                     (2, (4, 0)), (2, (5, 0)), (4, (3, 6)), (4, (4, 1)), (4, (4, 3)), (4, (4, 4)),
                     (3, (4, 3)), (3, (4, 3)), (3, (5, 0)), (4, (3, 7))]
    earlier = ('"""Phase 3.5 adds this to phase 3.1\'s pool (phases 2.3 and 3.3; phases 2.1-3.5).\n'
               'Phase 3 as a whole; p3_1, p2_2_scheduler, p0; phase 44, phase 4.456; a p50 latency."""\n')
    assert later_mentions(earlier, (3, 5), known) == []
    assert folder_phase("p2_2_scheduler") == (2, 2) and folder_phase("p5_serving") == (5, 0)
    assert folder_phase("__pycache__") is None


if __name__ == "__main__":
    counts = count_later_mentions()
    for rel, n in counts.items():
        print(f"{n:4d}  {rel}")
    print(f"{sum(counts.values()):4d}  in {len(counts)} files")
