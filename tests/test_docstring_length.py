"""A module docstring is the file's map: what it holds, the one idea, the key shapes. At most 25 lines.

Detail that belongs to one class or function goes into that docstring, or into a comment where the code
does it. A docstring's lines are the source lines it spans, its opening and closing quotes included.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ["phases", "common", "measure"]
MAX_DOCSTRING_LINES = 25


def docstring_lines(source: str) -> int:
    """Lines of the module docstring of `source` (0 without one)."""
    doc = ast.get_docstring(ast.parse(source), clean=False)
    return len(doc.split("\n")) if doc else 0


def test_module_docstrings_are_at_most_25_lines():
    long = {str(p.relative_to(ROOT)): n for folder in CHECKED for p in sorted((ROOT / folder).rglob("*.py"))
            if (n := docstring_lines(p.read_text())) > MAX_DOCSTRING_LINES}
    assert not long, (f"module docstrings over {MAX_DOCSTRING_LINES} lines (move detail into the class or function "
                      f"it describes): {long}")


def test_the_check_flags_a_26_line_docstring():
    lines = [f"line {i}" for i in range(1, 25)]             # 24 lines of text, then the closing quotes: 25
    assert docstring_lines('"""' + "\n".join(lines) + '\n"""\n') == MAX_DOCSTRING_LINES
    assert docstring_lines('"""' + "\n".join(lines + ["one more"]) + '\n"""\n') == MAX_DOCSTRING_LINES + 1
    assert docstring_lines("x = 1\n") == 0
