"""Each phase's own tests need only its lesson: no test reaches forward to a later phase (static, seconds).

A phase's own tests are the tests/**/test_*.py files whose name carries the phase (test_p3_6_engine.py:
p3_6; test_p0_p1.py: p1; test_p4_x.py names a group, no phase). From each, follow every import of a repo module
(`phases.*`, `common.*`, `measure.*`, `tests.*`, ...), relative ones made absolute, through the modules
they import, and check that every one is a file that lesson k or an earlier one carries (scripts/lessons.py's
place(), run on HEAD's tracked files; nothing is built or run). Imports inside a function count in tests,
test helpers and phase files (a test calls them; a phase never reaches forward); inside a function of a
tool (measure/cli.py's `serve`), they run only when asked for and are not followed.

KNOWN lists the tests that reach forward today, each with the import that does it: fixing one makes the
test fail until it is taken out of KNOWN, and a new one fails it at once.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("lessons", ROOT / "scripts" / "lessons.py")
lessons = importlib.util.module_from_spec(spec)
sys.modules.setdefault("lessons", lessons)     # dataclasses look their module up by name
spec.loader.exec_module(lessons)

# test file -> the module it imports that only a later lesson carries (to be fixed in the test, not here).
KNOWN = {
    "tests/test_p3_4_pad_stack.py": "tests.test_p3_8_engine",
}


def reaches_forward(tree, plan) -> dict[str, list[str]]:
    """test -> the imports in its closure that its phase's lesson lacks, as `file:line imports module (lesson)`."""
    modules = lessons.module_index(tree.entries)
    found: dict[str, list[str]] = {}
    for test, k in sorted(plan.tests_of.items()):
        seen, todo, problems = {test}, [test], []
        while todo:
            path = todo.pop()
            follow_lazy = path.startswith(("tests/", "phases/", "extras/"))
            for imp in plan.imports.get(path, []):
                if imp.lazy and not follow_lazy:
                    continue
                files = lessons.resolve(imp, modules) or set()
                late = sorted(f for f in files if plan.lesson_of[f] > k)
                if not files or late:
                    where = plan.order[plan.lesson_of[late[0]]] if late else "no lesson"
                    problems.append(f"{path}:{imp.line} imports {imp.module} ({where})")
                for f in files:
                    if f not in seen and plan.lesson_of[f] <= k:
                        seen.add(f)
                        todo.append(f)
        if problems:
            found[test] = problems
    return found


def test_each_phase_s_tests_import_only_what_its_lesson_holds():
    tree = lessons.Tree.of("HEAD", ROOT)
    plan = lessons.place(tree)
    assert plan.tests_of, "no test carries a phase in its name"
    found = reaches_forward(tree, plan)
    new = {t: p for t, p in found.items() if t not in KNOWN}
    assert not new, "a phase's test needs a later lesson:\n" + "\n".join(
        f"  {t} (lesson {plan.order[plan.tests_of[t]]}): {'; '.join(p)}" for t, p in new.items())
    fixed = sorted(t for t in KNOWN if t not in found)
    assert not fixed, f"these tests no longer reach forward: take them out of KNOWN: {fixed}"
    for test, module in KNOWN.items():
        assert any(f" imports {module} " in p for p in found[test]), (test, found[test])


def test_the_check_catches_a_test_that_reaches_forward():
    """A p1 test that imports phase 3.1's allocator, directly or through a helper, is caught; an import of a
    later phase inside a tool's function is not followed."""
    tree = lessons.Tree.of("HEAD", ROOT)
    blob = ("100644", "0" * 40)
    fake = {
        "tests/test_p1_fake_direct.py": "from phases.p3_1_block_allocator.allocator import BlockAllocator\n",
        "tests/test_p1_fake_helper.py": "from tests.fake_helper import helper\n",
        "tests/fake_helper.py": "def helper():\n    from phases.p3_1_block_allocator import allocator\n",
        "tests/test_p1_fake_tool.py": "from measure.cli import build_parser\n",
    }
    tree.entries.update({p: blob for p in fake})
    tree.texts.update(fake)
    plan = lessons.place(tree)
    p1 = plan.order.index("p1")
    for test in ("tests/test_p1_fake_direct.py", "tests/test_p1_fake_helper.py", "tests/test_p1_fake_tool.py"):
        plan.lesson_of[test] = plan.tests_of[test]          # as if placed by its name alone
    assert plan.tests_of["tests/test_p1_fake_direct.py"] == p1
    found = reaches_forward(tree, plan)
    assert found["tests/test_p1_fake_direct.py"] == [
        "tests/test_p1_fake_direct.py:1 imports phases.p3_1_block_allocator.allocator (p3_1)"]
    assert any("phases.p3_1_block_allocator (p3_1)" in p for p in found["tests/test_p1_fake_helper.py"])
    assert "tests/test_p1_fake_tool.py" not in found      # measure/cli.py's late import of phase 5 is lazy
