"""Build the course as git history: a local branch `lessons`, one commit per phase, in reading order.

    make lessons                              # or: .venv/bin/python scripts/lessons.py
    git log --reverse --oneline lessons       # the course, one line per phase, then `tools`
    git diff lesson-p3_4 lesson-p3_5          # lesson 3.5: what phase 3.5 adds
    make lessons-check                        # ... and each lesson's own tests, on that lesson alone

Each phase folder under phases/ is one lesson, in the order of its number (p0, p1, p2_1 .. p5: the
README's phase table), tagged lesson-<phase>; a last lesson, lesson-tools, holds what no phase runs.
Lesson k adds phase k: its folder, its extras/ package, its measurements page, its tests, notebook and
results, and the shared tools its files run; lesson 0 also holds the ground floor (top-level files,
.ci/, common/). place() gives the rules. The build writes objects and refs only (a temporary index,
`git commit-tree`, `git update-ref`): the working tree, the index and the current branch are not
touched. Commit dates are HEAD's, so a rebuild gives the same hashes.

Checks, each lesson on its own commit:
  (a) `--check` (a build runs it too; seconds): every .py file a lesson adds imports only modules
      that lesson has (check_imports);
  (b) `--run-tests [PHASE ...]` (make lessons-check; minutes): the tests the lesson adds, run in a
      checkout of its commit alone (run_tests); with `--quick`, only the few that QUICK names.
`make test` runs (a) and (b) `--quick` on every lesson (tests/test_lessons.py).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import queue
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
PHASE_FOLDER = re.compile(r"^phases/(p(\d)(?:_(\d+))?)_[^/]+/")   # phases/p3_5_paged_attention/... -> p3_5
SHORT = re.compile(r"p\d(?:_\d+)?(?![\d])")           # p3_6 in test_p3_6_engine, p0 and p1 in test_p0_p1
PATH_MENTION = re.compile(r"(?<![\w.])(?:\.\./)*((?:phases|tests|measure|common|scripts|notebooks|docs|results)"
                          r"(?:/[\w.-]+)+)")
NOTEBOOK = re.compile(r"(?<![\w/])(\d\d_\w+)\.ipynb\b")            # pytest.mark.notebook("05_x.ipynb")
RESULTS_MARKER = re.compile(r"<!--\s*results:\s*([\w./-]+?)\s*-->")   # a table synced from results/<stem>.md
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


TOOLS = "tools"       # the last lesson: the shared tools no phase runs, and the checks of the whole course
# Lesson 0's ground floor: the top-level files other than .py, .ci/, common/ (its CLI, __main__.py, is a tool),
# the phases package and the root of the tests package.
GROUND_FLOOR = re.compile(r"^(?:[^/]+(?<!\.py)|\.ci/.*|common/(?!__main__\.py$).*|phases/__init__\.py"
                          r"|tests/(?:__init__|conftest)\.py)$")
# Tools: arrive with the first lesson that runs them (imports them), else in the tools lesson.
TOOL = re.compile(r"^(?:measure/.*|scripts/.*|[^/]+\.py|(?!phases/).*/__main__\.py|tests/(?:.*/)?(?!test_)[^/]+\.py"
                  r"|extras/[^/]+\.py)$")
EXTRAS = re.compile(r"^extras/([^/]+)/")                               # extras/<phase folder>/...: that phase's
MEASUREMENT_PAGE = re.compile(r"^docs/measurements/([^/]+)\.md$")     # docs/measurements/<phase folder>.md
DEMO_TABLE = ("measure/demos.py", "DEMO_MODULES")                     # the demo registry: demo name -> module


@dataclass
class Plan:
    order: list[str]                       # lesson names, reading order: the phases' short names, then TOOLS
    folders: dict[str, str]                # phase short name -> folder (TOOLS has none)
    lesson_of: dict[str, int]              # path -> lesson index
    unplaced: dict[str, str]               # path -> why (placed in the last lesson)
    tests_of: dict[str, int] = field(default_factory=dict)   # test -> the latest phase its name carries
    imports: dict[str, list[Import]] = field(default_factory=dict)   # .py file -> its imports of repo modules


def demo_registry(tree: Tree) -> dict[str, str]:
    """measure/demos.py's DEMO_MODULES (demo name -> dotted module), read with ast: nothing is imported."""
    path, name = DEMO_TABLE
    try:
        module = ast.parse(tree.texts.get(path, ""))
    except SyntaxError:
        return {}
    for node in module.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == name and isinstance(node.value, ast.Dict):
            return {k.value: v.value for k, v in zip(node.value.keys, node.value.values)
                    if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)}
    return {}


def place(tree: Tree) -> Plan:
    """Which lesson each tracked file goes in: lesson k holds phase k and what phase k runs, nothing else.

    Fixed by the path:
    - phases/<phase>/..., extras/<phase>/... and docs/measurements/<phase>.md: that phase;
    - the ground floor: lesson 0 (GROUND_FLOOR: top-level files other than .py, .ci/, common/).
    Placed by what uses them:
    - a tool (TOOL: measure/, scripts/, top-level .py, __main__.py, test helpers) arrives in the first
      lesson whose files import it (a tool imported by a tool: that one's first lesson), and not before
      what it imports at import time; the demo runners (__main__.py) arrive with the first demo of the
      registry (measure/demos.py). A tool nothing imports goes in the tools lesson, after the last phase.
    Placed by what they need:
    - a test (tests/**/test_*.py) goes in at the latest lesson among the phases its name carries
      (test_p3_6_engine.py: p3_6), the tool its name names (test_harness.py: measure/harness.py), what it
      imports (inside functions too) and the phase files, notebooks and docs its text names. A test that
      names no phase and no tool, imports no phase and names no notebook checks the whole course
      (every README, the registry): the tools lesson;
    - a notebook (notebooks/NN_x.ipynb) goes in with its text copy NN_x.py, placed by its imports;
    - results/: by the demo or tool that made the file, from its name or its folders' names read up from
      the file (prefix-demo_cpu_x.json: the registry's prefix_demo, defined in phase 4.3; results/p3_3/...:
      p3_3; gpu-headline_x/...: measure/gpu_headline.py); else the first phase whose own files name it;
      else the tools lesson;
    - docs/*.md: the first phase whose own files link it (architecture.md: 3.6's README); else the last
      phase; test data: with the first test that names it; other text files: the latest lesson among
      the files they name.
    A file that a fixed file imports at import time, directly or through other such imports, goes in
    no later than that file (caps): check_imports then reports its later imports instead of failing them."""
    paths = sorted(tree.entries)
    folders = phase_folders(paths)
    phases = list(folders)
    index_of = {short: k for k, short in enumerate(phases)}
    by_folder = {folder.split("/")[1]: k for k, folder in enumerate(folders.values())}
    modules = module_index(paths)
    tops = local_tops_of(paths)
    dirs = tree.dirs()
    last, tools = len(phases) - 1, len(phases)
    unplaced: dict[str, str] = {}
    imports = {p: local_imports(p, tree.texts[p], tops) for p in paths if p.endswith(".py")}
    registry = {demo: modules[m] for demo, m in demo_registry(tree).items() if m in modules}
    tool_stems = {PurePosixPath(p).stem: p for p in paths if TOOL.match(p) and p.endswith(".py")
                  and not p.startswith("tests/") and not p.endswith("/__init__.py")}

    def phase_named(name: str) -> int | None:
        """The phase a folder name or short name means: p3_6_batched_engine or p3_6; p5 or p5_serving,
        once phase 5 is split into p5_1 .. p5_5, means the last of them."""
        if name in by_folder:
            return by_folder[name]
        if not (m := SHORT.match(name)):
            return None
        if m.group(0) in index_of:
            return index_of[m.group(0)]
        split = [index_of[s] for s in phases if s.startswith(m.group(0) + "_")]
        return split[-1] if split else None

    fixed: dict[str, int] = {}
    for p in paths:
        if m := PHASE_FOLDER.match(p):
            fixed[p] = index_of[m.group(1)]
        elif (m := EXTRAS.match(p) or MEASUREMENT_PAGE.match(p)) and phase_named(m.group(1)) is not None:
            fixed[p] = phase_named(m.group(1))
        elif GROUND_FLOOR.match(p):
            fixed[p] = 0
    own = {p for p in fixed if not GROUND_FLOOR.match(p)}          # a phase's own files
    cap: dict[str, int] = {}
    for p in sorted(fixed, key=fixed.get):
        todo = [p]
        while todo:
            for imp in imports.get(todo.pop(), []):
                for f in (resolve(imp, modules) or ()) if not imp.lazy else ():
                    if f not in fixed and cap.get(f, tools + 1) > fixed[p]:
                        cap[f] = fixed[p]
                        todo.append(f)

    named: dict[str, set[str]] = {}                   # text file -> the paths and folders it names
    for p in paths:
        if p in tree.texts:
            named[p] = {m.group(1).rstrip(".").rstrip("/") for m in PATH_MENTION.finditer(tree.texts[p])}
            named[p] |= {f"notebooks/{m.group(1)}.ipynb" for m in NOTEBOOK.finditer(tree.texts[p])}
            named[p] |= {f"results/{m.group(1)}" for m in RESULTS_MARKER.finditer(tree.texts[p])}
    named_by: dict[str, list[str]] = {}               # a path or folder -> the text files naming it
    for p, targets in named.items():
        for t in targets:
            named_by.setdefault(t, []).append(p)
    under: dict[str, list[str]] = {}                  # folder -> the files under it
    for p in paths:
        for parent in PurePosixPath(p).parents:
            under.setdefault(str(parent), []).append(p)
    users: dict[str, set[str]] = {}                   # file -> the files that import it (inside functions too)
    for p, found in imports.items():
        for imp in found:
            for f in resolve(imp, modules) or ():
                users.setdefault(f, set()).add(p)
    for p in paths:                                   # a package's __init__.py: every module in it uses it
        for parent in list(PurePosixPath(p).parents)[:-1]:
            if f"{parent}/__init__.py" in tree.entries and f"{parent}/__init__.py" != p:
                users.setdefault(f"{parent}/__init__.py", set()).add(p)
    for p in paths:                                   # a tests folder's conftest.py and package: its tests use them
        if TEST_FILE.match(p):
            folder = str(PurePosixPath(p).parent)
            for helper in (f"{folder}/conftest.py", f"{folder}/__init__.py"):
                if helper in tree.entries:
                    users.setdefault(helper, set()).add(p)
    first_demo = min((fixed.get(f, tools) for f in registry.values()), default=0)

    def tool_named(test: str) -> str | None:
        """The tool or package a test's name names: test_harness.py -> measure/harness.py, test_common.py ->
        common/__init__.py, test_vllm_cpu_peer.py -> the registry's vllm_cpu_peer (measure/vllm_cpu.py)."""
        stem = PurePosixPath(test).stem.removeprefix("test_")
        return tool_stems.get(stem) or registry.get(stem) or modules.get(stem)

    def phases_named(test: str) -> list[int]:
        """The phases a test's name carries: test_p0_p1.py -> p0 and p1. A group (test_p4_x.py, or test_p5_x.py
        once phase 5 is split) names none: such a test is placed by what it imports."""
        return [index_of[s] for s in SHORT.findall(PurePosixPath(test).stem) if s in index_of]

    def of_phases(test: str) -> bool:
        """Whether a test's name carries a phase or a group of phases (test_p4_x.py: phases 4.1 .. 4.6)."""
        return any(s in index_of or any(p.startswith(s + "_") for p in phases)
                   for s in SHORT.findall(PurePosixPath(test).stem))

    def repo_wide(test: str) -> bool:
        """A test that names no phase and no tool, imports no phase and names no notebook: it checks the course."""
        return not (of_phases(test) or tool_named(test)
                    or any(imp.module.split(".")[0] in ("phases", "extras") for imp in imports[test])
                    or any(t.startswith("notebooks/") for t in named.get(test, ())))

    lesson_of: dict[str, int] = {}
    visiting: set[str] = set()

    def mentioned(path: str, anchor: bool) -> int:
        """The latest lesson among the phase folders and tracked files the text names: data it reads.
        In a test, Python files (another test named in a comment) do not count; results/ never does; with
        `anchor`, tools do not count (see first_use)."""
        k, is_test = 0, TEST_FILE.match(path)
        for target in named.get(path, ()):
            if target.startswith("results/") or (is_test and target.endswith(".py")) or target == path:
                continue
            files = [f for f in (target, target + ".ipynb") if f in tree.entries]   # notebooks/05_x: the notebook
            if not files and target in dirs:
                files = [p for p in under[target] if not p.endswith(".py") or p.startswith("phases/")]
            k = max([k, *((anchor_of if anchor else lesson)(f) for f in files)])
        for m in MODULE_MENTION.finditer(tree.texts.get(path, "")):
            if m.group(1).startswith("phases.") and (short := SHORT.match(m.group(1).split(".")[1])):
                k = max(k, index_of.get(short.group(0), 0))
        return k

    def needs(path: str, anchor: bool = False) -> int:
        """The latest lesson among what a test, a notebook or another text file imports and names; with
        `anchor`, not counting tools (which are placed by their first user, see first_use)."""
        k = 0
        if path.endswith(".ipynb") and path[:-6] + ".py" in tree.entries:
            return needs(path[:-6] + ".py", anchor)
        for imp in imports.get(path, []):
            found = resolve(imp, modules)
            if found is None:
                unplaced[path] = f"line {imp.line} imports {imp.module}, which no tracked file provides"
                k = max(k, last)
            else:
                k = max([k, *((anchor_of if anchor else lesson)(f) for f in found)])
        if TEST_FILE.match(path):
            k = max([k, *phases_named(path)])
            if (tool := tool_named(path)) and not anchor:
                k = max(k, lesson(tool))
        if path in tree.texts:
            k = max(k, mentioned(path, anchor))
        return k

    anchors: dict[str, int] = {}

    def anchor_of(path: str) -> int:
        """A file's lesson with tools left out (they follow their users): what a user needs before any tool."""
        if path in fixed:
            return fixed[path]
        if TOOL.match(path) or path.startswith("results/"):
            return 0
        if path.startswith(("docs/", "extras/")):
            return doc_lesson(path)
        if path not in anchors:
            anchors[path] = 0                         # an import cycle: the others decide
            anchors[path] = needs(path, anchor=True)
        return anchors[path]

    first_seen: set[str] = set()

    def first_use(path: str) -> int:
        """The first lesson that runs a tool: the earliest of its users' lessons, a user being a file that
        imports it (a phase's file, a notebook, a test whose name carries a phase or a group of phases; other
        tests follow the tools they import, except a test helper's), or a test of a phase that names its
        path; a tool's user counts by its own first use. The demo runners (__main__.py) are used by the
        first demo of the registry."""
        if path in first_seen:                       # an import cycle among tools: the others decide
            return tools
        first_seen.add(path)
        who = set(users.get(path, ())) | {t for t in named_by.get(path, ()) if TEST_FILE.match(t)}
        who = {u for u in who if not TEST_FILE.match(u) or of_phases(u)       # a test helper: any test of a part
               or (path.startswith("tests/") and not tool_named(u) and not repo_wide(u))}
        k = first_demo if path.endswith("/__main__.py") else tools
        for u in who:
            if u in fixed:
                k = min(k, fixed[u])
            elif TOOL.match(u):
                k = min(k, first_use(u))
            elif u.endswith(".py"):
                k = min(k, needs(u, anchor=True))
        first_seen.discard(path)
        return k

    def lesson(path: str) -> int:
        if path in fixed:
            return fixed[path]
        if path in lesson_of:
            return lesson_of[path]
        if path in visiting:                          # an import cycle: the others decide
            return 0
        visiting.add(path)
        if path.startswith("results/"):
            k = results_lesson(path)
        elif TOOL.match(path):                        # its first use, not before what it imports at import time
            k = max([first_use(path), *(lesson(f) for imp in imports.get(path, []) if not imp.lazy
                                        for f in resolve(imp, modules) or ())])
        elif TEST_FILE.match(path) and repo_wide(path):
            k = tools
        elif path.startswith("tests/") and not path.endswith(".py"):     # test data: with the first test naming it
            k = min((lesson(t) for t in named_by.get(path, []) if TEST_FILE.match(t)), default=tools)
        elif path.startswith("docs/") or path.startswith("extras/"):
            k = doc_lesson(path)
        else:
            k = needs(path)
        visiting.discard(path)
        lesson_of[path] = min(k, cap.get(path, k))
        return lesson_of[path]

    def doc_lesson(path: str) -> int:
        """A doc: the first phase whose own files name it; else, under extras/, the first phase with extras;
        else the last phase (docs/where_to_go_next.md closes the course)."""
        namers = [fixed[p] for p in named_by.get(path, []) if p in own]
        if path.startswith("extras/"):
            namers += [fixed[p] for p in own if p.startswith("extras/")]
        return min(namers, default=last)

    def made_by(name: str) -> str | None:
        """The file whose demo or tool made a results file or folder of this name: the registry's demos first,
        longest name first (bench-serve-fewshot_cpu: bench_serve), then the tools' module names."""
        name = name.replace("-", "_")
        for table in (registry, tool_stems):
            hits = [d for d in table if name == d or name.startswith(d + "_")]
            if hits:
                return table[max(hits, key=len)]
        return None

    def results_lesson(path: str) -> int:
        """The phase whose demo made the file: read its name, then its folders' up to results/; a folder named
        for a phase (results/p3_3/) is that phase's. Else the first phase whose own files name it (or a file
        of its stem, or a folder above it); else the tools lesson."""
        for part in reversed(PurePosixPath(path).parts[1:]):
            if SHORT.fullmatch(part) or part in by_folder:
                if (k := phase_named(part)) is not None:
                    return k
            if maker := made_by(part):
                return lesson(maker)
        stem = path.rsplit(".", 1)[0]
        same = [p for p in under[str(PurePosixPath(path).parent)] if p.rsplit(".", 1)[0] == stem]
        targets = {stem, *same, *(str(f) for f in PurePosixPath(path).parents if str(f) not in (".", "results"))}
        return min((fixed[p] for t in targets for p in named_by.get(t, []) if p in own), default=tools)

    for p in paths:
        if not p.startswith("results/"):
            lesson(p)
    for p in paths:
        lesson(p)
    lesson_of.update(fixed)
    order = phases + ([TOOLS] if tools in lesson_of.values() else [])
    tests_of = {p: max(ks) for p in paths if TEST_FILE.match(p) and (ks := phases_named(p))}
    return Plan(order, folders, lesson_of, unplaced, tests_of, imports)


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
        if not folder or not p.startswith(folder + "/"):
            d, _, name = p.rpartition("/")
            by_dir.setdefault(d or ".", []).append(name)
    lines = []
    for d, names in sorted(by_dir.items()):
        shown = ", ".join(names) if len(names) <= 6 else f"{len(names)} files"
        lines.append(f"  {d}/: {shown}")
    return "\n".join(lines)


TOOLS_MESSAGE = ("tools: the shared tools no phase runs, and the checks of the whole course",
                 "Nothing here is needed to read or run a phase: the measurement runs that span phases (the GPU\n"
                 "headline, the peers), the scripts behind make (this one included), the Modal app's checks and the\n"
                 "tests that check every README, docstring and link of the course at once. Each phase's lesson\n"
                 "already holds the tools its demo and tests run.")


def message(tree: Tree, short: str, folder: str, paths: list[str], source: str) -> str:
    """`<phase>: <the first line of the phase's __init__ docstring, shortened>`, then the README's
    "Adds" paragraph (or, with no README, the rest of that docstring) and the files the lesson adds
    outside its folder. The tools lesson (no folder) says what it holds."""
    if not folder:
        first, body = TOOLS_MESSAGE
        return f"{first}\n\n{body}\n\nIt adds:\n{added_elsewhere(paths, folder)}\n\nBuilt by scripts/lessons.py from {source}.\n"
    first = docstring_of(tree, folder).split("\n", 1)[0] or folder
    body = adds_paragraph(tree, folder)
    others = added_elsewhere(paths, folder)
    parts = [subject(short, first), body]
    if others:
        parts.append(f"Besides {folder}/, this lesson adds:\n{others}")
    parts.append(f"Built by scripts/lessons.py from {source}.")
    return "\n\n".join(p for p in parts if p) + "\n"


def build(repo: Path = ROOT, rev: str = "HEAD") -> tuple[Plan, list[str]]:
    """Write the lesson commits and point `lessons` and the lesson-* tags at them; return the plan and commits.

    Built from `rev`'s tracked files (`git ls-tree`: commit first; runs/, .venv and other ignored files
    never go in), through a temporary index (GIT_INDEX_FILE), `git commit-tree` and one `git update-ref`
    transaction: the working tree, the index and the current branch are not touched. Commit dates are
    the commit's, so re-building from the same commit gives the same hashes; a re-build replaces the
    branch and every lesson-* tag. Where git has no identity configured, the commits name this script."""
    current = subprocess.run(["git", "-C", str(repo), "symbolic-ref", "-q", "--short", "HEAD"],
                             capture_output=True, text=True).stdout.strip()
    if current == BRANCH:
        sys.exit(f"lessons: HEAD is on branch {BRANCH}; check out another branch first (the build replaces it)")
    commit = git("rev-parse", rev + "^{commit}", repo=repo).strip()
    tree = Tree.of(commit, repo)
    plan = place(tree)
    date = git("log", "-1", "--format=%cI", commit, repo=repo).strip()
    env_base = {**os.environ, "GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date}
    if subprocess.run(["git", "-C", str(repo), "var", "GIT_COMMITTER_IDENT"], capture_output=True).returncode:
        env_base |= {f"GIT_{who}_{what}": value for who in ("AUTHOR", "COMMITTER")     # a bare CI box
                     for what, value in (("NAME", "scripts/lessons.py"), ("EMAIL", "lessons@localhost"))}
    commits: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        env = {**env_base, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        parent = None
        for k, short in enumerate(plan.order):
            paths = sorted(p for p, lesson in plan.lesson_of.items() if lesson == k)
            info = "".join(f"{tree.entries[p][0]} {tree.entries[p][1]}\t{p}\n" for p in paths)
            git("update-index", "--add", "--index-info", repo=repo, env=env, input=info)
            tree_id = git("write-tree", repo=repo, env=env).strip()
            msg = message(tree, short, plan.folders.get(short, ""), paths, f"commit {commit[:12]}")
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
    """(a): (failures, notes), for each lesson and each .py file it adds; static, a few seconds.

    A failure: an import at import time of a local module the lesson's tree lacks, or any such
    import (inside a function too) in a phase folder: a phase never reaches forward. A note: the
    same inside a function elsewhere (measure/cli.py's `serve` imports phase 5 when asked for), or
    a phase module named in a string (a lookup table) that the lesson's tree lacks. What it cannot
    see: a module looked up by a string built at run time, a file read by a path built at run time;
    (b), run_tests, runs the code."""
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


# (b) --quick, which `make test` runs on every lesson: a few of the tests each lesson adds, about a second
# of work each on the tiny random model (no packaged model, no demo, no compile-for-H100), chosen to touch
# what the phase adds: 1 to 5 s a lesson, through the fork server below (a fresh Python would add 7 s each).
# A test named here must be in a file its lesson adds (tests/test_lessons.py checks it); every lesson
# that adds tests names some. p0 adds none (tests/test_p0_p1.py needs p1): its check imports its package.
QUICK: dict[str, list[str]] = {
    "p0": [],
    "p1": ["tests/test_p0_p1.py::test_both_loops_equal_hf_generate_on_tiny_model",
           "tests/test_p0_p1.py::test_stop_at_eos_and_ignore_eos_on_tiny_model"],
    "p2_1": ["tests/test_p2_1_naive_batching.py::test_left_pad_mask_and_positions",
             "tests/test_p2_1_naive_batching.py::test_ignore_eos_gives_every_row_the_same_work",
             "tests/test_p2_1_naive_batching.py::test_too_long_prompt_is_rejected_before_any_work"],
    "p2_2": ["tests/test_p2_2_scheduler.py::test_step_by_step_states",
             "tests/test_p2_2_scheduler.py::test_bad_requests_are_rejected_at_add"],
    "p2_3": ["tests/test_p2_3_continuous_batching.py::test_many_prompts_one_slot_equals_per_prompt_generate",
             "tests/test_p2_3_continuous_batching.py::"
             "test_freed_slot_goes_to_the_next_waiting_sequence_in_the_same_step"],
    "p3_1": ["tests/test_p3_1_block_allocator.py::test_refcounts_share_a_block_until_the_last_owner_frees_it",
             "tests/test_p3_1_block_allocator.py::test_double_free_names_the_block",
             "tests/test_p3_1_block_allocator.py::test_random_ops_keep_refcounts_exact_and_never_leak"],
    "p3_2": ["tests/test_p3_2_block_table.py::test_prefill_takes_every_block_at_once_and_slots_follow_the_table",
             "tests/test_p3_2_block_table.py::test_a_write_through_the_slot_mapping_reads_back_through_physical_pos",
             "tests/test_p3_2_block_table.py::test_release_returns_every_block_and_a_second_release_is_harmless"],
    "p3_3": ["tests/test_p3_3_paged_cache.py::test_logits_and_kv_equal_dynamic_cache_bit_for_bit",
             "tests/test_p3_3_paged_cache.py::test_paged_scheduler_equals_continuous_scheduler_and_hf"],
    "p3_4": ["tests/test_p3_4_gather_kernel.py::test_gather_reads_the_right_layer_and_k_v",
             "tests/test_p3_4_gather_kernel.py::test_padding_in_tables_is_never_read",
             "tests/test_p3_4_gather_kernel.py::test_gather_kv_dispatch"],
    "p3_5": ["tests/test_p3_5_kernels.py::test_kernel_equals_reference_equals_sdpa"],
    "p3_6": ["tests/test_p3_6_engine.py::test_greedy_equals_hf_generate_tiny_model_block_boundaries",
             "tests/test_p3_6_engine.py::test_one_forward_pass_per_phase_of_a_step"],
    "p3_7": ["tests/test_p3_7_prefill_kernel.py::"
             "test_kernel_and_cpu_path_take_empty_segments_a_strided_query_and_an_empty_pack"],
    "p3_8": ["tests/test_p3_8_engine.py::test_chunked_prompts_with_decodes_alongside_equal_hf_generate"],
    "p3_9": ["tests/test_p3_9_decode_kernel.py::test_padding_rows_of_length_zero_read_nothing_and_give_zeros",
             "tests/test_p3_9_merge_kernel.py::test_merge_kernel_equals_merge_splits",
             "tests/test_p3_9_decode_kernel.py::test_split_rule"],
    "p3_10": ["tests/test_p3_10_engine.py::test_rows_left_behind_are_inert_padding",
              "tests/test_p3_10_engine.py::test_seeded_samples_do_not_depend_on_the_batch_or_its_padding"],
    "p3_11": ["tests/test_p3_11_fused_ops.py::test_rms_norm_equals_the_models_norm",
              "tests/test_p3_11_fused_ops.py::test_silu_and_mul_equals_the_swiglu_gate",
              "tests/test_p3_11_fused_ops.py::test_outside_the_step_the_model_is_its_own"],
    "p4_1": ["tests/test_p4_1_copy_on_write.py::test_fork_shares_every_block_and_copy_happens_once_per_writer",
             "tests/test_p4_1_copy_on_write.py::"
             "test_n_samples_hold_one_copy_of_the_prompt_then_copy_the_partial_block_on_first_write",
             "tests/test_p4_1_copy_on_write.py::test_plain_requests_run_exactly_as_on_phase_3_10"],
    "p4_2": ["tests/test_p4_2_beam_search.py::test_best_beam_equals_hf_tiny_model_small_blocks",
             "tests/test_p4_2_beam_search.py::test_beams_share_history_and_free_pruned_blocks_every_step"],
    "p4_3": ["tests/test_p4_3_prefix_caching.py::test_a_block_hash_covers_every_token_before_it",
             "tests/test_p4_3_prefix_caching.py::test_second_request_hits_k_blocks_and_prefills_only_the_rest",
             "tests/test_p4_3_prefix_caching.py::test_caching_on_equals_caching_off_tiny_many_shared_prefixes"],
    "p4_4": ["tests/test_p4_4_preemption.py::test_greedy_outputs_equal_unlimited_pool_and_hf_under_many_preemptions",
             "tests/test_p4_4_preemption.py::test_latest_group_is_preempted_and_goes_back_to_the_front_of_the_queue",
             "tests/test_p4_4_reservation.py::test_a_request_never_writes_past_its_reservation"],
    "p4_5": ["tests/test_p4_5_speculative.py::test_greedy_outputs_equal_hf_at_any_acceptance",
             "tests/test_p4_5_speculative.py::test_seeded_acceptance_draws_are_reproducible"],
    "p4_6": ["tests/test_p4_6_model_sharding.py::test_split_cuts_contiguous_ranges_that_cover_everything",
             "tests/test_p4_6_model_sharding.py::test_bad_sizes_are_refused_before_any_worker_starts"],
    "p4_7": ["tests/test_p4_7_tensor_parallel.py::test_a_pass_message_decodes_to_the_batch_it_encoded"],
    "p5_1": ["tests/test_p5_1_served_engine.py::test_a_fork_that_fails_half_way_rolls_back",
             "tests/test_p5_1_served_engine.py::test_the_served_engine_fails_only_the_group_whose_fork_failed"],
    "p5_2": ["tests/test_p5_2_async_engine.py::"
             "test_the_async_engine_streams_each_client_its_text_and_a_client_that_leaves_is_aborted",
             "tests/test_p5_2_async_engine.py::test_stop_strings_cut_before_the_stop_and_hold_back_its_prefix"],
    "p5_3": ["tests/test_p5_3_metrics.py::test_the_metered_engine_counts_what_it_served_and_vllms_names_equal_ours"],
    "p5_4": ["tests/test_p5_4_pool_frames.py::test_a_frame_shows_samples_sharing_their_prompt_blocks_until_they_finish",
             "tests/test_p5_4_pool_frames.py::test_the_watched_engine_runs_observers_after_steps_and_calls_between_them"],
    "p5_5": ["tests/test_p5_5_openai_api.py::test_defaults_and_vllms_extensions",
             "tests/test_p5_5_openai_api.py::test_the_two_endpoints_shape_the_same_deltas"],
    "p5_6": ["tests/test_p5_serving.py::test_completion_equals_hf_greedy_and_streamed_text_equals_plain",
             "tests/test_p5_serving.py::test_invalid_requests_get_openai_error_bodies",
             "tests/test_p5_isolation.py::test_a_poisoned_request_fails_alone_beside_a_valid_stream"],
    TOOLS: ["tests/test_layering.py::test_no_phase_names_a_later_one"],
}
QUICK_TIMEOUT_S, TIMEOUT_S = 120, 900     # a lesson's quick tests take seconds; all its own tests, minutes
SELF_TEST = "tests/test_lessons.py"      # the check itself: never run inside a lesson (it would build again)

# Run in a lesson's checkout (its working directory): pytest on the tests named, if any, then import the
# phase's package, then make sure every local module loaded came from this checkout (not from an installed
# copy, PYTHONPATH or the fork server).
RUNNER = r"""
import importlib, os, sys
package, quick, args = sys.argv[1], sys.argv[2] == "quick", sys.argv[3:]
here = os.path.realpath(os.getcwd())
sys.path.insert(0, here)
status = 0
if args:
    import pytest
    status = int(pytest.main(args))
    if status == 5 and not quick:
        status = 0                                     # all deselected (gpu or notebook tests only)
try:
    if package:                                        # the tools lesson has no package of its own
        importlib.import_module(package)
except Exception as e:
    print(f"importing {package} fails at this lesson: {type(e).__name__}: {e}")
    status = status or 1
tops = {d for d in os.listdir(here) if os.path.isfile(os.path.join(here, d, "__init__.py"))}
outside = sorted(n for n, m in list(sys.modules.items()) if n.split(".")[0] in tops
                 and getattr(m, "__file__", None) and not os.path.realpath(m.__file__).startswith(here + os.sep))
if outside:
    print("local modules loaded from outside this lesson's checkout:", ", ".join(outside[:5]))
    status = status or 1
sys.exit(status)
"""


# The fork server: one process that imports the third-party modules every lesson needs (torch, transformers,
# pytest and its plugins: about 7 s of a lesson's 9), then forks one child per lesson, which changes into the
# lesson's checkout and runs RUNNER there. It imports no local module (it runs in an empty folder; RUNNER
# checks), so each lesson's own files are all the child can import of the project. One lesson at a time.
PRELOAD = ("torch", "transformers", "transformers.models.llama.modeling_llama", "pytest", "hypothesis")
SERVER = r"""
import importlib, importlib.metadata, json, os, signal, sys, time
runner, preload = sys.argv[1], sys.argv[2:]
for name in preload:
    importlib.import_module(name)
for plugin in importlib.metadata.entry_points(group="pytest11"):    # what each pytest run would load
    try:
        plugin.load()
    except Exception:
        pass
print("ready", flush=True)
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(job["cwd"])
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            out = os.open(job["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, 1)
            os.dup2(out, 2)
            sys.argv = ["-c", *job["argv"]]
            exec(compile(runner, "<lesson runner>", "exec"), {"__name__": "__main__"})
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + job["timeout"]
    while not (done := os.waitpid(pid, os.WNOHANG))[0]:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            done = os.waitpid(pid, 0)
            with open(job["out"], "a") as f:
                f.write(f"\nkilled after {job['timeout']} s\n")
            break
        time.sleep(0.02)
    print(json.dumps(os.waitstatus_to_exitcode(done[1])), flush=True)
"""


class LessonServer:
    """The fork server, started at once (its imports take seconds): `run(cwd, argv, timeout)` runs RUNNER with
    `argv` in a child forked into `cwd` and gives (exit status, output). Close it (or use `with`) to end it."""

    def __init__(self):
        self.home = tempfile.TemporaryDirectory(prefix="lesson-server-")
        self.started = time.perf_counter()
        self.start_s: float | None = None               # seconds from start to ready
        with open(Path(self.home.name) / "server.log", "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", SERVER, RUNNER, *PRELOAD], cwd=self.home.name,
                                         env=lesson_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, text=True)

    def ready(self) -> None:
        while self.start_s is None:                     # a module may print as it is imported: skip to "ready"
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the lesson server did not start:\n{self.log()}")
            if line.strip() == "ready":
                self.start_s = time.perf_counter() - self.started

    def log(self) -> str:
        return (Path(self.home.name) / "server.log").read_text()[-3000:]

    def run(self, cwd: Path, argv: list[str], timeout: float) -> tuple[int, str]:
        self.ready()
        out = Path(self.home.name) / "lesson.out"
        self.proc.stdin.write(json.dumps({"cwd": str(cwd), "argv": argv, "out": str(out), "timeout": timeout}) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"the lesson server stopped:\n{self.log()}")
        return json.loads(answer), out.read_text(errors="replace")

    def close(self) -> None:
        """End the server (it stops at the end of its input) and remove its folder."""
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.home.cleanup()

    def __enter__(self) -> "LessonServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def own_tests(repo: Path, commit: str, parent: str | None) -> list[str]:
    """The tests/test_*.py files a lesson adds (not those under tests/gpu/)."""
    new = git("diff", "--name-only", "--diff-filter=A", parent, commit, repo=repo) if parent \
        else git("ls-tree", "-r", "--name-only", commit, repo=repo)
    return [p for p in new.split() if re.match(r"^tests/test_[^/]*\.py$", p)]


@dataclass
class LessonRun:
    lesson: str
    commit: str
    tests: list[str]          # what was run: files, or QUICK's node ids
    seconds: float
    ok: bool
    output: str

    def report(self) -> str:
        """One paragraph that names the lesson, its commit and what failed (pytest's FAILED/ERROR lines)."""
        if self.ok:
            return f"lesson {self.lesson} ok"
        if not self.tests and self.seconds == 0:         # QUICK is wrong for it: nothing ran
            return f"lesson {self.lesson}: {self.output}"
        lines = self.output.strip().splitlines()
        named = [ln for ln in lines if ln.startswith(("FAILED ", "ERROR ", "ERROR:"))]
        tail = "\n".join(named or lines[-15:])
        return (f"lesson {self.lesson} (lesson-{self.lesson}, {self.commit[:12]}) fails on its own files:\n{tail}\n"
                f"--- output of `python -m pytest {' '.join(self.tests)}` in a checkout of lesson-{self.lesson} ---\n"
                f"{self.output}")


def checkout(repo: Path, commit: str, into: Path) -> None:
    """A clone of `repo` at `commit`, detached, its objects shared with `repo`: that lesson's files alone."""
    subprocess.run(["git", "clone", "--quiet", "--shared", "--no-checkout", str(repo), str(into)], check=True,
                   capture_output=True)
    git("checkout", "--quiet", "--detach", commit, repo=into)


def lesson_env() -> dict[str, str]:
    """The environment a lesson's tests run in: this one without pytest's own variables (an outer pytest-xdist
    worker's would pass for the inner run's) or PYTHONPATH (it could hold a later lesson's files), and one
    OpenMP thread (lessons run side by side, beside other tests)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_lesson(server: LessonServer, repo: Path, lesson: str, folder: str, commit: str, tests: list[str],
               quick: bool) -> LessonRun:
    """Run `tests` (files or node ids) at `commit`, in a fresh checkout of it, through `server`, gpu- and
    notebook-marked tests deselected, then import the phase's package there."""
    with tempfile.TemporaryDirectory(prefix=f"lesson-{lesson}-") as tmp:
        where = Path(tmp) / "repo"
        checkout(repo, commit, where)
        argv = [folder.replace("/", "."), "quick" if quick else "all"]
        if tests:
            argv += ["-q", "-p", "no:cacheprovider", "-o", "addopts=", "--tb=short", "-rfE",
                     "-W", "ignore::pytest.PytestAssertRewriteWarning",    # the server imported the plugins
                     "-m", "not gpu and not notebook", *tests]
        server.ready()
        start = time.perf_counter()
        status, output = server.run(where, argv, QUICK_TIMEOUT_S if quick else TIMEOUT_S)
        return LessonRun(lesson, commit, tests, time.perf_counter() - start, status == 0, output[-9000:])


def lessons_of(repo: Path, branch: str = BRANCH) -> list[tuple[str, str, list[str]]]:
    """(short name, commit, the test files it adds) for each lesson of `branch`, in order."""
    found, parent = [], None
    for c in git("rev-list", "--reverse", branch, repo=repo).split():
        found.append((git("log", "-1", "--format=%s", c, repo=repo).split(":")[0], c, own_tests(repo, c, parent)))
        parent = c
    return found


def quick_problem(lesson: str, own: list[str]) -> str | None:
    """Why QUICK's entry for a lesson is not a subset of the tests it adds, if it is not."""
    if lesson not in QUICK:
        return f"lesson {lesson} has no entry in QUICK (scripts/lessons.py): name a few of its quick tests there"
    if own and not QUICK[lesson]:
        return f"lesson {lesson} adds {', '.join(own)} but QUICK (scripts/lessons.py) names none of its tests"
    stray = [t for t in QUICK[lesson] if t.split("::")[0] not in own]
    if stray:
        return (f"QUICK (scripts/lessons.py) names for lesson {lesson} tests in files it does not add: "
                f"{', '.join(stray)} (it adds: {', '.join(own) or 'no tests'})")
    return None


def run_tests(repo: Path = ROOT, only: list[str] | None = None, branch: str = BRANCH, quick: bool = False,
              jobs: int = 1) -> dict[str, LessonRun]:
    """(b): each lesson's own tests, run at its commit on its files alone: a checkout of that commit, in
    which pytest runs the tests/test_*.py files the lesson adds (with `quick`, only QUICK's named tests),
    gpu- and notebook-marked tests deselected, then the phase's package is imported and every local module
    loaded must come from that checkout. `only` names the lessons to run (default: all); `jobs` lessons run
    side by side. What it cannot see: tests of one lesson that another lesson's files would break (each
    lesson runs its own tests only; the tests placed in the last lesson, which check the whole course, run
    only there, and tests/test_lessons.py, this check, never runs inside a lesson)."""
    from concurrent.futures import ThreadPoolExecutor

    folders = phase_folders(git("ls-tree", "-r", "--name-only", branch, repo=repo).split())
    todo = []
    for short, commit, own in lessons_of(repo, branch):
        if only and short not in only:
            continue
        if quick and (problem := quick_problem(short, own)):
            todo.append((short, commit, problem))
        else:
            todo.append((short, commit, QUICK[short] if quick else [t for t in own if t != SELF_TEST]))

    servers: queue.SimpleQueue[LessonServer] = queue.SimpleQueue()
    for _ in range(max(1, min(jobs, len(todo)))):
        servers.put(LessonServer())

    def one(item) -> LessonRun:
        short, commit, tests = item
        if isinstance(tests, str):                    # QUICK is wrong for this lesson: nothing to run
            return LessonRun(short, commit, [], 0.0, False, tests)
        server = servers.get()
        try:
            return run_lesson(server, repo, short, folders.get(short, ""), commit, tests, quick)
        finally:
            servers.put(server)

    runs: dict[str, LessonRun] = {}
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        for run in pool.map(one, todo):
            runs[run.lesson] = run
            last = (run.output.strip().splitlines() or ["(no output)"])[-1]
            print(f"  {run.lesson:5} {run.seconds:6.1f} s  {'ok  ' if run.ok else 'FAIL'} {len(run.tests)} "
                  f"{'named tests' if quick else 'files'}: {last[:100]}", flush=True)
    while not servers.empty():
        server = servers.get()
        if server.start_s is not None:
            print(f"  (a lesson server started in {server.start_s:.1f} s)")
        server.close()
    return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--repo", type=Path, default=ROOT, help="the repository to build in (default: this one)")
    ap.add_argument("--rev", default="HEAD", help="the commit whose tracked files make the lessons")
    ap.add_argument("--check", action="store_true", help="only check the existing lessons branch (a), no build")
    ap.add_argument("--run-tests", nargs="*", metavar="PHASE",
                    help="(b): run each lesson's own tests on its tree alone (all lessons, or the phases named)")
    ap.add_argument("--quick", action="store_true", help="with --run-tests: only the tests QUICK names (make test)")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1,
                    help="with --run-tests: how many lessons run side by side (default: one per core)")
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
        runs = run_tests(args.repo, args.run_tests or None, quick=args.quick, jobs=args.jobs)
        test_failures = [r.report() for r in runs.values() if not r.ok]
        for f in test_failures:
            print("FAIL (b):", f, file=sys.stderr)
        print(f"(b) own tests{' (quick)' if args.quick else ''}: "
              f"{'ok' if not test_failures else f'{len(test_failures)} lessons failed'} "
              f"in {time.perf_counter() - t0:.0f} s ({args.jobs} side by side)")
        failures += test_failures
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
