"""Build the course as git history: a local branch `lessons`, one commit per phase, in reading order.

    make lessons                              # or: .venv/bin/python scripts/lessons.py
    git log --reverse --oneline lessons       # the course, one line per phase
    git show lesson-p0 --stat                 # lesson 0: the ground floor and phase 0
    git diff lesson-p3_4 lesson-p3_5          # lesson 3.5: what phase 3.5 adds
    make lessons-check                        # ... and each lesson's own tests, on that lesson alone

The lessons are built from the tracked files of HEAD (`git ls-tree HEAD`: commit first; runs/,
.venv and other ignored files never go in). Each phase folder under phases/ is one lesson, in the
order of its number (p0, p1, p2_1 .. p2_3, p3_1 .. p3_8, p4_1 .. p4_5, p5: the README's phase
table). Lesson k's commit adds, on top of lesson k-1:

- its phase folder;
- every other file that first has what it needs at lesson k:
  - a .py file: every module it imports (`phases.*`, `common.*`, `measure.*`, `tests.*`, imports
    inside functions included) is in lesson k or before. A test (tests/**/test_*.py) also waits
    for the phase its name carries (test_p3_5_engine.py: p3_5) and for the phase modules and
    non-Python files its text names (`phases.p5_serving.demo`, `docs/architecture.md`, the
    notebook `05_paged_attention.ipynb`); a test that names no phase at all checks the whole
    course (the demo registry, every README, every notebook) and goes in the last lesson;
  - a notebook (notebooks/NN_x.ipynb) goes in with its text copy NN_x.py, which imports phases;
  - another text file outside phases/ (docs/*.md, scripts/*.sh) waits for the files it names;
  - results/: a file goes in with the first lesson whose text names it, its folder or a file of
    the same stem (a phase README's link to results/x.md brings x.json and x.png); the rest go
    in the last lesson;
- lesson 0 is also the ground floor: the top-level files other than .py (README.md, Makefile,
  requirements.txt, pytest.ini, ...), .ci/, common/ and the test helpers (tests/conftest.py,
  tests/oracles.py, ...). A file that such a file, or a phase file, imports at import time goes in
  no later than it, even if one of its functions imports a later phase (measure/cli.py's `serve`
  imports phase 5): the check below reports that import instead of failing it.

Its message: `<phase>: <the first line of the phase's __init__ docstring, shortened>`, then the
README's "Adds" paragraph (or, with no README, the rest of that docstring) and the files the
lesson adds outside its folder. Each lesson is tagged `lesson-<phase>`, the phase folder's short
name: lesson-p0, lesson-p2_1, lesson-p5. Commit dates are HEAD's, so re-building from the same
HEAD gives the same hashes; a re-build replaces the branch and every lesson-* tag.

The build writes objects and refs only: a temporary index (GIT_INDEX_FILE), `git commit-tree`,
`git update-ref`. The working tree, the index and the current branch are not touched.

Checks (`--check` checks the existing branch; a build runs it too; static, a few seconds):
  (a) every .py file a lesson adds imports only modules present in that lesson's tree. Imports at
      import time fail anywhere; imports inside functions fail in a phase folder (a phase never
      reaches forward) and are reported as notes elsewhere, like phase modules named in strings
      (measure/demos.py's table), which are looked up only when asked for.
`--run-tests [PHASE ...]` (make lessons-check) adds:
  (b) each lesson's own tests (the tests/test_*.py it adds), run with pytest on that lesson's tree
      alone (`git archive` into a temporary folder), gpu- and notebook-marked tests deselected.
What neither sees: a module looked up by a string built at run time, a file read by a path built
at run time, and tests of one lesson that another lesson's files would break (b runs each lesson's
own tests only; the tests placed in the last lesson run only there).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parent.parent
BRANCH = "lessons"
TAG_PREFIX = "lesson-"
SUBJECT_MAX = 80                                      # the repo's own subjects run to about this
PHASE_FOLDER = re.compile(r"^phases/(p(\d)(?:_(\d))?)_[^/]+/")   # phases/p3_5_paged_attention/... -> p3_5
SHORT = re.compile(r"p\d(?:_\d)?(?![\d])")           # p3_5 in test_p3_5_engine, p0 and p1 in test_p0_p1
PATH_MENTION = re.compile(r"(?<![\w.])(?:\.\./)*((?:phases|tests|measure|common|scripts|notebooks|docs|results)"
                          r"(?:/[\w.-]+)+)")
NOTEBOOK = re.compile(r"(?<![\w/])(\d\d_\w+)\.ipynb\b")            # pytest.mark.notebook("05_x.ipynb")
MODULE_MENTION = re.compile(r"\b((?:phases|measure|common|tests)(?:\.\w+)+)")
TEST_FILE = re.compile(r"^tests/(?:.*/)?test_[^/]*\.py$")
TEXT_SUFFIXES = (".py", ".md", ".sh", ".txt", ".ini", ".toml", ".cfg", ".yml", ".yaml")


def git(*args: str, repo: Path, env: dict | None = None, input: str | bytes | None = None) -> str:
    out = subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                         env=env, input=input.encode() if isinstance(input, str) else input)
    return out.stdout.decode()


@dataclass
class Tree:
    """A commit's tracked files: path -> (mode, blob), and the text of the ones we read."""
    entries: dict[str, tuple[str, str]]
    texts: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, rev: str, repo: Path) -> "Tree":
        entries = {}
        for line in git("ls-tree", "-r", "-z", rev, repo=repo).split("\0"):
            if line:
                meta, path = line.split("\t", 1)
                mode, kind, blob = meta.split()
                if kind == "blob":
                    entries[path] = (mode, blob)
        tree = cls(entries)
        wanted = [p for p in entries if p.endswith(TEXT_SUFFIXES)]
        batch = subprocess.run(["git", "-C", str(repo), "cat-file", "--batch"], check=True,
                               capture_output=True, input="".join(entries[p][1] + "\n" for p in wanted).encode())
        out, pos = batch.stdout, 0
        for path in wanted:                            # "<blob> blob <size>\n<bytes>\n" per request
            header_end = out.index(b"\n", pos)
            size = int(out[pos:header_end].split()[2])
            tree.texts[path] = out[header_end + 1:header_end + 1 + size].decode("utf-8", "replace")
            pos = header_end + 1 + size + 1
        return tree

    def dirs(self) -> set[str]:
        return {str(parent) for p in self.entries for parent in PurePosixPath(p).parents if str(parent) != "."}


def phase_folders(paths) -> dict[str, str]:
    """short name -> folder, in reading order: p0 -> phases/p0_generate, ..., p5 -> phases/p5_serving."""
    found = {}
    for p in paths:
        if m := PHASE_FOLDER.match(p):
            found[m.group(1)] = (int(m.group(2)), int(m.group(3) or 0), p[:m.end() - 1])
    return {short: folder for short, (_, _, folder) in sorted(found.items(), key=lambda kv: kv[1])}


def module_index(paths) -> dict[str, str]:
    """dotted module -> file, for every tracked .py file (a package is its __init__.py)."""
    index = {}
    for p in paths:
        if p.endswith(".py"):
            parts = p[:-3].split("/")
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if parts and all(part.isidentifier() for part in parts):
                index[".".join(parts)] = p
    return index


@dataclass
class Import:
    module: str          # dotted, absolute: `from a.b import c` is a.b with names ("c",)
    line: int
    lazy: bool           # inside a function: runs only when it is called
    names: tuple[str, ...] = ()


def imports_of(path: str, source: str) -> list[Import]:
    """Every import statement in the file (inside functions too), relative ones made absolute."""
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError:
        return []
    package = path.split("/")[:-1]
    found: list[Import] = []

    def visit(node, lazy: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend(Import(a.name, child.lineno, lazy) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package[:len(package) - (child.level - 1)]
                    base = ".".join([*up, *([base] if base else [])])
                found.append(Import(base, child.lineno, lazy, tuple(a.name for a in child.names if a.name != "*")))
            visit(child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


def resolve(imp: Import, modules: dict[str, str]) -> set[str] | None:
    """The files an import runs (the module, its parent packages, submodules it names); None if one is missing."""
    if imp.module not in modules:
        return None
    parts = imp.module.split(".")
    files = {modules[".".join(parts[:n])] for n in range(1, len(parts) + 1) if ".".join(parts[:n]) in modules}
    files |= {modules[f"{imp.module}.{n}"] for n in imp.names if f"{imp.module}.{n}" in modules}
    return files


def local_imports(path: str, source: str, tops: set[str]) -> list[Import]:
    return [imp for imp in imports_of(path, source) if imp.module.split(".")[0] in tops]


def local_tops_of(paths) -> set[str]:
    return {p.split("/")[0] for p in paths if p.count("/") == 1 and p.endswith("/__init__.py")} | \
           {p[:-3] for p in paths if "/" not in p and p.endswith(".py")}


GROUND_FLOOR = re.compile(r"^(?:[^/]+(?<!\.py)|\.ci/.*|common/.*|phases/__init__\.py|tests/(?!test_)[^/]*\.py)$")


@dataclass
class Plan:
    order: list[str]                       # phase short names, reading order
    folders: dict[str, str]                # short -> folder
    lesson_of: dict[str, int]              # path -> lesson index
    unplaced: dict[str, str]               # path -> why (placed in the last lesson)


def place(tree: Tree) -> Plan:
    """Which lesson each tracked file goes in (see the module docstring for the rule).

    Three passes. Fixed: a phase folder's files go in their phase, the ground floor in lesson 0.
    Caps: a file that a fixed file imports at import time (not inside a function), directly or
    through other such imports, goes in no later than that fixed file. Wants: every other file goes
    in at the latest lesson among what it imports (inside functions too) and, for tests and text
    files, what it names; capped files take the smaller of the two (their late imports inside
    functions are then reported by the check, not failed)."""
    paths = sorted(tree.entries)
    folders = phase_folders(paths)
    order = list(folders)
    index_of = {short: k for k, short in enumerate(order)}
    modules = module_index(paths)
    tops = local_tops_of(paths)
    dirs = tree.dirs()
    last = len(order) - 1
    unplaced: dict[str, str] = {}
    imports = {p: local_imports(p, tree.texts[p], tops) for p in paths if p.endswith(".py")}

    fixed: dict[str, int] = {}
    for p in paths:
        if m := PHASE_FOLDER.match(p):
            fixed[p] = index_of[m.group(1)]
        elif GROUND_FLOOR.match(p):
            fixed[p] = 0
    cap: dict[str, int] = {}
    for p in sorted(fixed, key=fixed.get):
        todo = [p]
        while todo:
            for imp in imports.get(todo.pop(), []):
                for f in (resolve(imp, modules) or ()) if not imp.lazy else ():
                    if f not in fixed and cap.get(f, last + 1) > fixed[p]:
                        cap[f] = fixed[p]
                        todo.append(f)

    lesson_of: dict[str, int] = dict(fixed)
    visiting: set[str] = set()

    named: dict[str, set[str]] = {}                   # text file -> the paths and folders it names
    for p in paths:
        if p in tree.texts:
            named[p] = {m.group(1).rstrip(".").rstrip("/") for m in PATH_MENTION.finditer(tree.texts[p])}
            named[p] |= {f"notebooks/{m.group(1)}.ipynb" for m in NOTEBOOK.finditer(tree.texts[p])}
    named_by: dict[str, list[str]] = {}               # a path or folder -> the text files naming it
    for p, targets in named.items():
        for t in targets:
            named_by.setdefault(t, []).append(p)
    under: dict[str, list[str]] = {}                  # folder -> the files under it
    for p in paths:
        for parent in PurePosixPath(p).parents:
            under.setdefault(str(parent), []).append(p)

    def mentioned(path: str) -> int:
        """The latest lesson among the phase folders and tracked files the text names: data it reads.
        In a test, Python files (another test named in a comment) do not count; results/ never does."""
        k, is_test = 0, TEST_FILE.match(path)
        for target in named.get(path, ()):
            if target.startswith("results/") or (is_test and target.endswith(".py")) or target == path:
                continue
            files = [f for f in (target, target + ".ipynb") if f in tree.entries]   # notebooks/05_x: the notebook
            if files:
                k = max(k, *(lesson(f) for f in files))
            elif target in dirs:
                k = max(k, max((lesson(p) for p in under[target] if not p.endswith(".py") or p.startswith("phases/")),
                               default=0))
        for m in MODULE_MENTION.finditer(tree.texts.get(path, "")):
            if m.group(1).startswith("phases.") and (short := SHORT.match(m.group(1).split(".")[1])):
                k = max(k, index_of.get(short.group(0), 0))
        return k

    def lesson(path: str) -> int:
        if path in lesson_of:
            return lesson_of[path]
        if path in visiting:                          # an import cycle: the others decide
            return 0
        visiting.add(path)
        k = 0
        if path.startswith("results/"):
            k = results_lesson(path)
        elif path.endswith(".ipynb") and path[:-6] + ".py" in tree.entries:
            k = lesson(path[:-6] + ".py")
        elif path.endswith(".py"):
            for imp in imports[path]:
                found = resolve(imp, modules)
                if found is None:
                    unplaced[path] = f"line {imp.line} imports {imp.module}, which no tracked file provides"
                    k = last
                else:
                    k = max([k, *(lesson(f) for f in found)])
            if TEST_FILE.match(path):
                named = [index_of[s] for s in SHORT.findall(PurePosixPath(path).stem) if s in index_of]
                k = max(k, *named, mentioned(path))
                if k == 0:                            # names no phase: it checks the whole course
                    k = last
        elif path in tree.texts:
            k = mentioned(path)
        visiting.discard(path)
        lesson_of[path] = min(k, cap.get(path, k))
        return lesson_of[path]

    def results_lesson(path: str) -> int:
        """The first lesson whose text names this file, its folder, or a file of the same stem (x.md for x.png)."""
        stem = path.rsplit(".", 1)[0]
        same = [p for p in under[str(PurePosixPath(path).parent)] if p.rsplit(".", 1)[0] == stem]
        targets = {*same, *(str(f) for f in PurePosixPath(path).parents if str(f) not in (".", "results"))}
        lessons = [lesson(p) for t in targets for p in named_by.get(t, []) if not p.startswith("results/")]
        return min(lessons, default=last)

    for p in paths:
        if not p.startswith("results/"):
            lesson(p)
    for p in paths:
        lesson(p)
    return Plan(order, folders, lesson_of, unplaced)


def docstring_of(tree: Tree, folder: str) -> str:
    try:
        return ast.get_docstring(ast.parse(tree.texts.get(f"{folder}/__init__.py", ""))) or ""
    except SyntaxError:
        return ""


def subject(short: str, first_line: str) -> str:
    """`p3_5: adds paged attention to phase 3.3's scheduler`: the docstring's first line without
    "Phase 3.5", cut where it fits SUBJECT_MAX: at its first colon if that leaves a clause of
    20 characters or more, else at the last comma, colon, dash or parenthesis outside parentheses."""
    text = re.sub(r"^Phase [\d.]+\s*[:,]?\s*", "", first_line.strip()).rstrip(".")
    room = SUBJECT_MAX - len(short) - 2
    if len(text) > room:
        cuts, depth = [], 0
        for i, ch in enumerate(text):
            if text.startswith((": ", ", ", "; ", " - ", " ("), i) and depth == 0 and 12 <= i <= room:
                cuts.append(i)
            depth += (ch == "(") - (ch == ")")
        colon = text.find(": ")
        text = (text[:colon] if 20 <= colon <= room else text[:cuts[-1]] if cuts
                else text[:room].rsplit(" ", 1)[0])
    return f"{short}: {text}"


def adds_paragraph(tree: Tree, folder: str) -> str:
    """The README's paragraph that opens with **Adds:** (the first after its title, tests/test_readme_adds.py);
    else the docstring's rest."""
    readme = tree.texts.get(f"{folder}/README.md", "")
    for para in re.split(r"\n\s*\n", readme):
        if para.strip().startswith("**Adds:**"):
            return para.strip()
    return docstring_of(tree, folder).split("\n", 1)[-1].strip()


def added_elsewhere(paths: list[str], folder: str) -> str:
    """The files a lesson adds outside its phase folder, by folder: a long folder is counted, not listed."""
    by_dir: dict[str, list[str]] = {}
    for p in paths:
        if not p.startswith(folder + "/"):
            d, _, name = p.rpartition("/")
            by_dir.setdefault(d or ".", []).append(name)
    lines = []
    for d, names in sorted(by_dir.items()):
        shown = ", ".join(names) if len(names) <= 6 else f"{len(names)} files"
        lines.append(f"  {d}/: {shown}")
    return "\n".join(lines)


def message(tree: Tree, short: str, folder: str, paths: list[str], source: str) -> str:
    first = docstring_of(tree, folder).split("\n", 1)[0] or folder
    body = adds_paragraph(tree, folder)
    others = added_elsewhere(paths, folder)
    parts = [subject(short, first), body]
    if others:
        parts.append(f"Besides {folder}/, this lesson adds:\n{others}")
    parts.append(f"Built by scripts/lessons.py from {source}.")
    return "\n\n".join(p for p in parts if p) + "\n"


def build(repo: Path = ROOT, rev: str = "HEAD") -> tuple[Plan, list[str]]:
    """Write the lesson commits and point `lessons` and the lesson-* tags at them; return the plan and commits."""
    current = subprocess.run(["git", "-C", str(repo), "symbolic-ref", "-q", "--short", "HEAD"],
                             capture_output=True, text=True).stdout.strip()
    if current == BRANCH:
        sys.exit(f"lessons: HEAD is on branch {BRANCH}; check out another branch first (the build replaces it)")
    commit = git("rev-parse", rev + "^{commit}", repo=repo).strip()
    tree = Tree.of(commit, repo)
    plan = place(tree)
    date = git("log", "-1", "--format=%cI", commit, repo=repo).strip()
    env_base = {**os.environ, "GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date}
    commits: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        env = {**env_base, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        parent = None
        for k, short in enumerate(plan.order):
            paths = sorted(p for p, lesson in plan.lesson_of.items() if lesson == k)
            info = "".join(f"{tree.entries[p][0]} {tree.entries[p][1]}\t{p}\n" for p in paths)
            git("update-index", "--add", "--index-info", repo=repo, env=env, input=info)
            tree_id = git("write-tree", repo=repo, env=env).strip()
            msg = message(tree, short, plan.folders[short], paths, f"commit {commit[:12]}")
            parent = git("commit-tree", tree_id, *(["-p", parent] if parent else []), "-F", "-",
                         repo=repo, env=env, input=msg).strip()
            commits.append(parent)
    old_tags = git("for-each-ref", "--format=%(refname)", f"refs/tags/{TAG_PREFIX}*", repo=repo).split()
    wanted = {f"refs/tags/{TAG_PREFIX}{short}": c for short, c in zip(plan.order, commits)}
    updates = [f"update refs/heads/{BRANCH} {commits[-1]}"] + [f"update {r} {c}" for r, c in wanted.items()]
    updates += [f"delete {r}" for r in old_tags if r not in wanted]
    git("update-ref", "--stdin", repo=repo, input="\n".join(updates) + "\n")
    return plan, commits


def check_imports(repo: Path = ROOT, branch: str = BRANCH) -> tuple[list[str], list[str]]:
    """(a): (failures, notes), for each lesson and each .py file it adds.

    A failure: an import at import time of a local module the lesson's tree lacks, or any such
    import (inside a function too) in a phase folder: a phase never reaches forward. A note: the
    same inside a function elsewhere (measure/cli.py's `serve` imports phase 5 when asked for), or
    a phase module named in a string (a lookup table) that the lesson's tree lacks."""
    failures, notes = [], []
    before: set[str] = set()
    for c in git("rev-list", "--reverse", branch, repo=repo).split():
        tree = Tree.of(c, repo)
        name = git("log", "-1", "--format=%s", c, repo=repo).split(":")[0]
        modules, tops = module_index(tree.entries), local_tops_of(tree.entries)
        for path in sorted(p for p in set(tree.entries) - before if p.endswith(".py")):
            source = tree.texts[path]
            imported = set()
            for imp in local_imports(path, source, tops):
                imported.add(imp.module)
                if resolve(imp, modules) is None:
                    where = "inside a function" if imp.lazy else "at import time"
                    line = f"{name}: {path}:{imp.line} imports {imp.module} ({where}), which this lesson lacks"
                    (failures if not imp.lazy or path.startswith("phases/") else notes).append(line)
            later = sorted({m.group(1) for m in MODULE_MENTION.finditer(source)
                            if m.group(1).startswith("phases.") and m.group(1) not in imported
                            and ".".join(m.group(1).split(".")[:2]) not in modules})
            if later:
                notes.append(f"{name}: {path} names {len(later)} later modules in text ({', '.join(later[:2])}, ...)"
                             if len(later) > 2 else f"{name}: {path} names {', '.join(later)} in text")
        before = set(tree.entries)
    return failures, notes


def own_tests(repo: Path, commit: str, parent: str | None) -> list[str]:
    """The tests/test_*.py files a lesson adds (not those under tests/gpu/)."""
    new = git("diff", "--name-only", "--diff-filter=A", parent, commit, repo=repo) if parent \
        else git("ls-tree", "-r", "--name-only", commit, repo=repo)
    return [p for p in new.split() if re.match(r"^tests/test_[^/]*\.py$", p)]


@dataclass
class TestRun:
    tests: list[str]
    seconds: float
    ok: bool
    output: str


def run_tests(repo: Path = ROOT, only: list[str] | None = None, branch: str = BRANCH) -> dict[str, TestRun]:
    """(b): each lesson's own tests (the tests/test_*.py it adds) on that lesson's tree alone, with
    gpu- and notebook-marked tests deselected; `only` names the lessons to run (default: all)."""
    runs: dict[str, TestRun] = {}
    parent = None
    for c in git("rev-list", "--reverse", branch, repo=repo).split():
        short = git("log", "-1", "--format=%s", c, repo=repo).split(":")[0]
        tests = own_tests(repo, c, parent)
        parent = c
        if (only and short not in only) or not tests:
            continue
        with tempfile.TemporaryDirectory(prefix=f"lesson-{short}-") as tmp:
            archive = subprocess.run(["git", "-C", str(repo), "archive", c], check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            start = time.perf_counter()
            cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=",
                   "-m", "not gpu and not notebook", *tests]
            run = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
            runs[short] = TestRun(tests, time.perf_counter() - start, run.returncode in (0, 5),  # 5: all deselected
                                  run.stdout[-4000:] + run.stderr[-2000:])
        last = (runs[short].output.strip().splitlines() or ["(no output)"])[-1]
        print(f"  {short:5} {runs[short].seconds:6.1f} s  {' '.join(t[6:] for t in tests)}: {last}", flush=True)
    return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--repo", type=Path, default=ROOT, help="the repository to build in (default: this one)")
    ap.add_argument("--rev", default="HEAD", help="the commit whose tracked files make the lessons")
    ap.add_argument("--check", action="store_true", help="only check the existing lessons branch (a), no build")
    ap.add_argument("--run-tests", nargs="*", metavar="PHASE",
                    help="(b): run each lesson's own tests on its tree alone (all lessons, or the phases named)")
    ap.add_argument("--plan", action="store_true", help="print where each file outside phases/ goes")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    if not args.check:
        plan, commits = build(args.repo, args.rev)
        for short, c in zip(plan.order, commits):
            print(git("log", "-1", "--format=%h %s", c, repo=args.repo).strip())
        if args.plan:
            for p, k in sorted(plan.lesson_of.items(), key=lambda kv: (kv[1], kv[0])):
                if not p.startswith("phases/"):
                    print(f"  {plan.order[k]:5} {p}")
        for p, why in plan.unplaced.items():
            print(f"could not place {p} ({why}); put in the last lesson", file=sys.stderr)
        print(f"built {BRANCH} ({len(commits)} lessons) and tags {TAG_PREFIX}<phase> "
              f"in {time.perf_counter() - start:.1f} s")
    failures, notes = check_imports(args.repo)
    for n in notes:
        print("note:", n)
    for f in failures:
        print("FAIL (a):", f, file=sys.stderr)
    print(f"(a) imports: {'ok' if not failures else f'{len(failures)} failures'} "
          f"({len(notes)} string notes) in {time.perf_counter() - start:.1f} s")
    if args.run_tests is not None:
        t0 = time.perf_counter()
        runs = run_tests(args.repo, args.run_tests or None)
        test_failures = [f"{short}: {r.output}" for short, r in runs.items() if not r.ok]
        for f in test_failures:
            print("FAIL (b):", f, file=sys.stderr)
        print(f"(b) own tests: {'ok' if not test_failures else f'{len(test_failures)} lessons failed'} "
              f"in {time.perf_counter() - t0:.0f} s")
        failures += test_failures
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
