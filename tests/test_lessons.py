"""`make lessons` (scripts/lessons.py): the course as history, one commit per phase, each standing on the ones before.

Every test builds in a clone of this repository under tmp_path (`git clone --quiet`), from this
repository's HEAD, so the `lessons` branch and `lesson-*` tags are written there: this
repository's refs, index and working tree are never touched.

`make test` runs, on every lesson, the static check (a) and that lesson's quick tests (b, QUICK in
scripts/lessons.py) in a checkout of its commit alone: one test per lesson, so a failure names it.
`make lessons-check` runs all of each lesson's own tests.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("lessons", ROOT / "scripts" / "lessons.py")
lessons = importlib.util.module_from_spec(spec)
sys.modules["lessons"] = lessons              # dataclasses look their module up by name
spec.loader.exec_module(lessons)

pytestmark = pytest.mark.xdist_group("lessons")   # one worker builds once, and starts one lesson server
PHASES = list(lessons.phase_folders(p.relative_to(ROOT).as_posix() for p in ROOT.glob("phases/*/__init__.py")))


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def clone(into: Path) -> tuple[Path, str]:
    head = git(ROOT, "rev-parse", "HEAD")
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(into)], check=True)
    git(into, "checkout", "--quiet", "--detach", head)
    return into, head


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    repo, head = clone(tmp_path_factory.mktemp("lessons") / "repo")
    start = time.perf_counter()
    plan, commits = lessons.build(repo, head)
    print(f"built {len(commits)} lessons in {time.perf_counter() - start:.1f} s")
    return repo, head, plan, commits


@pytest.fixture(scope="module")
def server():
    with lessons.LessonServer() as s:
        yield s


def table_order() -> list[str]:
    """The phase folders in the order the top README's phase table lists them."""
    return re.findall(r"^\|[^|]*\|\s*`(p\d\w*)`\s*\|", (ROOT / "README.md").read_text(), re.M)


def test_the_lessons_are_the_phases_in_the_readmes_order(built):
    repo, head, plan, commits = built
    folders = [plan.folders[short].split("/")[1] for short in plan.order]
    listed = table_order()
    assert listed and [f for f in folders if f in listed] == listed, "the README's phase table has another order"
    assert git(repo, "rev-list", "--reverse", "lessons").split() == commits
    for short, commit in zip(plan.order, commits):
        assert git(repo, "rev-parse", f"lesson-{short}") == commit
        assert git(repo, "log", "-1", "--format=%s", commit).startswith(f"{short}: ")
        assert len(git(repo, "log", "-1", "--format=%s", commit)) <= lessons.SUBJECT_MAX
        assert git(repo, "log", "-1", "--format=%b", commit).strip(), f"lesson {short} has no body"


def test_each_lesson_adds_its_phase_and_the_last_is_the_whole_tree(built):
    repo, head, plan, commits = built
    parent = None
    for short, commit in zip(plan.order, commits):
        if parent:
            added = git(repo, "diff", "--name-only", "--diff-filter=A", parent, commit).split()
            assert git(repo, "diff", "--name-only", "--diff-filter=MDR", parent, commit) == "", \
                f"lesson {short} changes an earlier lesson's file"
        else:
            added = git(repo, "ls-tree", "-r", "--name-only", commit).split()
        assert {p.split("/")[1] for p in added if p.startswith("phases/p")} == {plan.folders[short].split("/")[1]}
        parent = commit
    assert git(repo, "rev-parse", "lessons^{tree}") == git(repo, "rev-parse", f"{head}^{{tree}}")
    assert plan.unplaced == {}, f"files whose imports nothing provides: {plan.unplaced}"


def test_building_leaves_the_checkout_alone_and_rebuilds_the_same(built):
    repo, head, plan, commits = built
    assert git(repo, "status", "--porcelain") == ""
    assert git(repo, "rev-parse", "HEAD") == head
    assert git(repo, "for-each-ref", "--format=%(refname)", "refs/heads/lessons") == "refs/heads/lessons"
    git(repo, "tag", "lesson-p9_stale", commits[0])                   # a phase that no longer exists
    _, again = lessons.build(repo, head)
    assert again == commits                                          # the dates are HEAD's: same hashes
    assert "lesson-p9_stale" not in git(repo, "tag", "--list", "lesson-*").split()
    assert git(repo, "status", "--porcelain") == ""


def test_each_lesson_imports_only_what_it_has(built):
    repo, _, _, _ = built
    failures, notes = lessons.check_imports(repo)
    assert failures == []
    print("\n".join(notes))


def test_the_check_catches_a_phase_that_imports_a_later_one(tmp_path, server):
    repo, _ = clone(tmp_path / "repo")
    early = repo / "phases" / "p1_kv_cache" / "__init__.py"
    early.write_text(early.read_text() + "\n\ndef _later():\n    from phases.p5_serving.server import create_app\n")
    (repo / "tests" / "test_p1_reaches.py").write_text("from phases.p3_1_block_allocator import BlockAllocator\n")
    (repo / "tests" / "test_p1_later.py").write_text("from phases.p1_kv_cache import _later\n\n\n"
                                                     "def test_later():\n    _later()\n")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "--quiet", "-m", "p1 reaches forward")
    plan, commits = lessons.build(repo, "HEAD")
    assert plan.order[plan.lesson_of["tests/test_p1_reaches.py"]] == "p3_1"     # placed by what it imports
    failures, _ = lessons.check_imports(repo)
    assert len(failures) == 1 and failures[0].startswith("p1: phases/p1_kv_cache/__init__.py:")
    assert "phases.p5_serving.server (inside a function)" in failures[0]
    p1 = plan.order.index("p1")                                                  # (b) fails too, and says where
    run = lessons.run_lesson(server, repo, "p1", plan.folders["p1"], commits[p1], ["tests/test_p1_later.py"], True)
    assert not run.ok
    report = run.report()
    assert report.startswith(f"lesson p1 (lesson-p1, {commits[p1][:12]}) fails on its own files:\nFAILED ")
    assert "tests/test_p1_later.py::test_later" in report and "No module named 'phases.p5_serving'" in report


def test_every_lesson_names_quick_tests_from_the_files_it_adds(built):
    repo, _, plan, commits = built
    assert list(lessons.QUICK) == plan.order, "QUICK (scripts/lessons.py) lists other lessons than the build"
    problems = [lessons.quick_problem(short, own) for short, _, own in lessons.lessons_of(repo)]
    assert [p for p in problems if p] == []


@pytest.mark.parametrize("short", PHASES)
def test_each_lesson_passes_its_quick_tests_on_its_files_alone(built, server, short):
    """(b) for one lesson: QUICK's tests for it, run at its commit in a checkout that holds its files alone."""
    repo, _, plan, commits = built
    if short not in plan.order:
        pytest.skip(f"phases/{short}_* is not committed: the lessons are built from HEAD")
    k = plan.order.index(short)
    own = lessons.own_tests(repo, commits[k], commits[k - 1] if k else None)
    problem = lessons.quick_problem(short, own)
    assert problem is None, problem
    run = lessons.run_lesson(server, repo, short, plan.folders[short], commits[k], lessons.QUICK[short], True)
    print(f"lesson {short}: {len(run.tests)} named tests in {run.seconds:.1f} s")
    assert run.ok, run.report()
