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
FOLDERS = lessons.phase_folders(p.relative_to(ROOT).as_posix() for p in ROOT.glob("phases/*/__init__.py"))
PHASES = list(FOLDERS)
LESSONS = [*PHASES, lessons.TOOLS]


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
    assert plan.order == [*plan.folders, lessons.TOOLS], "the phases in reading order, then the tools lesson"
    folders = [plan.folders[short].split("/")[1] for short in plan.folders]
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
        own = {plan.folders[short].split("/")[1]} if short in plan.folders else set()    # the tools lesson: none
        assert {p.split("/")[1] for p in added if p.startswith("phases/p")} == own
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
    later = FOLDERS[PHASES[-1]].replace("/", ".")                                # the last phase's package
    early = repo / "phases" / "p1_kv_cache" / "__init__.py"
    early.write_text(early.read_text() + f"\n\ndef _later():\n    import {later}\n")
    (repo / "tests" / "test_p1_reaches.py").write_text("from phases.p3_1_block_allocator import BlockAllocator\n")
    (repo / "tests" / "test_p1_later.py").write_text("from phases.p1_kv_cache import _later\n\n\n"
                                                     "def test_later():\n    _later()\n")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "--quiet", "-m", "p1 reaches forward")
    plan, commits = lessons.build(repo, "HEAD")
    assert plan.order[plan.lesson_of["tests/test_p1_reaches.py"]] == "p3_1"     # placed by what it imports
    failures, _ = lessons.check_imports(repo)
    assert len(failures) == 1 and failures[0].startswith("p1: phases/p1_kv_cache/__init__.py:")
    assert f"{later} (inside a function)" in failures[0]
    p1 = plan.order.index("p1")                                                  # (b) fails too, and says where
    run = lessons.run_lesson(server, repo, "p1", plan.folders["p1"], commits[p1], ["tests/test_p1_later.py"], True)
    assert not run.ok
    report = run.report()
    assert report.startswith(f"lesson p1 (lesson-p1, {commits[p1][:12]}) fails on its own files:\nFAILED ")
    assert "tests/test_p1_later.py::test_later" in report and f"No module named '{later}'" in report


def test_every_lesson_names_quick_tests_from_the_files_it_adds(built):
    repo, _, plan, commits = built
    assert list(lessons.QUICK) == plan.order, "QUICK (scripts/lessons.py) lists other lessons than the build"
    problems = [lessons.quick_problem(short, own) for short, _, own in lessons.lessons_of(repo)]
    assert [p for p in problems if p] == []


def test_each_lesson_holds_its_phase_and_the_tools_it_runs(built):
    """p0 carries no measurement tool, script or result; a result made by a phase's demo (the registry's
    name starts the file's name) is in that phase's lesson; docs/architecture.md comes with the first phase
    whose README links it; a tool no phase imports waits for the tools lesson."""
    repo, head, plan, commits = built
    tree = lessons.Tree.of(head, repo)
    in_p0 = [p for p, k in plan.lesson_of.items() if k == 0]
    assert not [p for p in in_p0 if p.startswith(("measure/", "scripts/", "results/")) or p == "modal_run.py"]
    made_in = {demo.replace("_", "-"): module.split(".")[1] for demo, module in lessons.demo_registry(tree).items()
               if module.startswith("phases.")}
    checked = 0
    for p, k in plan.lesson_of.items():
        name = p.removeprefix("results/")
        demos = [d for d in made_in if p.startswith("results/") and "/" not in name
                 and (name.startswith(d + "_") or name.startswith(d + "-"))]
        if demos:
            folder = made_in[max(demos, key=len)]
            assert plan.folders.get(plan.order[k], "").endswith("/" + folder), f"{p} is in lesson {plan.order[k]}"
            checked += 1
    assert checked > 20
    readers = [short for short, folder in plan.folders.items() if "architecture.md" in tree.texts[f"{folder}/README.md"]]
    assert plan.order[plan.lesson_of["docs/architecture.md"]] == readers[0]
    tools = plan.order.index(lessons.TOOLS)
    assert plan.lesson_of["scripts/lessons.py"] == tools and plan.lesson_of["tests/test_lessons.py"] == tools


def test_new_phases_extras_and_tools_are_placed_by_the_rules(built):
    """Files of shapes the repo may grow (a phase 5.8 folder, its extras/ package, its measurement page,
    a bench it runs, its demo's results, its test's data, a script nothing runs) go where the rules say,
    though no list in scripts/lessons.py names them."""
    repo, head, plan, commits = built
    tree = lessons.Tree.of(head, repo)
    registry = tree.texts["measure/demos.py"]
    package = ".".join(("phases", "p5_8_fake_view"))     # spelt apart: the lessons' check would note the name
    fake = {
        "phases/p5_8_fake_view/__init__.py": '"""Phase 5.8: a fake view."""\n',
        "phases/p5_8_fake_view/demo.py": "from measure.fake_bench import run\n",
        "measure/fake_bench.py": "from measure.report import Report\n\n\ndef run():\n    return Report\n",
        "extras/__init__.py": '"""Off the reading path."""\n',
        "extras/README.md": "Off the reading path.\n",
        "extras/p5_8_fake_view/__init__.py": f"from {package} import demo\n",
        "docs/measurements/p5_8_fake_view.md": "<!-- results: fake-view_cpu_tiny -->\n",
        "results/fake-view_cpu_tiny.json": "{}\n",
        "results/fake-view-wide_cpu_tiny.md": "x\n",
        "results/gpu-headline_x/demos/fake_view/output.log": "x\n",
        "tests/test_p5_8_fake_view.py": f"from {package}.demo import run\n\nDATA = 'tests/data/view.json'\n",
        "tests/data/view.json": "{}\n",
        "scripts/fake_tool.py": "import measure.fake_bench\n",
        "measure/demos.py": registry.replace("DEMO_MODULES: dict[str, str] = {\n",
                                             f'DEMO_MODULES: dict[str, str] = {{\n    "fake_view": "{package}.demo",\n'),
    }
    assert fake["measure/demos.py"] != registry
    tree.entries.update({p: ("100644", "0" * 40) for p in fake})
    tree.texts.update(fake)
    new = lessons.place(tree)
    k = new.order.index("p5_8")
    assert k == len(new.folders) - 1 and new.order[-1] == lessons.TOOLS
    for p in fake:
        if p.startswith(("phases/", "extras/p5_8", "docs/", "results/", "tests/", "measure/fake")):
            assert new.order[new.lesson_of[p]] == "p5_8", p
    assert new.lesson_of["extras/__init__.py"] <= k and new.lesson_of["extras/README.md"] <= k
    assert new.lesson_of["scripts/fake_tool.py"] == new.order.index(lessons.TOOLS)


@pytest.mark.parametrize("short", LESSONS)
def test_each_lesson_passes_its_quick_tests_on_its_files_alone(built, server, short):
    """(b) for one lesson: QUICK's tests for it, run at its commit in a checkout that holds its files alone."""
    repo, _, plan, commits = built
    if short not in plan.order:
        pytest.skip(f"phases/{short}_* is not committed: the lessons are built from HEAD")
    k = plan.order.index(short)
    own = lessons.own_tests(repo, commits[k], commits[k - 1] if k else None)
    problem = lessons.quick_problem(short, own)
    assert problem is None, problem
    run = lessons.run_lesson(server, repo, short, plan.folders.get(short, ""), commits[k], lessons.QUICK[short], True)
    print(f"lesson {short}: {len(run.tests)} named tests in {run.seconds:.1f} s")
    assert run.ok, run.report()
