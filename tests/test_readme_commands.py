"""The READMEs are a promise: every command they show must name things that exist and parse as written.
(The notebooks' text is read too: their markdown quotes commands the same way. So are the commands
that scripts/*.sh run in their parts, which only a borrowed GPU runs.)

Nothing is run (the demos' own tests do that). Each command found in a README's code, fenced or inline,
is checked against what it names:

  python -m common <demo> ...     the demo is in the registry and its parser accepts every argument
  python -m common serve ...      the server's parser accepts them
  python -m <module> ...          the module exists, and each --flag appears in its source
  python -m pytest <paths>        each path exists (and each test named after ::)
  modal run modal_run.py::<fn>    modal_run.py defines that entrypoint; --opts is JSON of the demo's options
  modal serve modal_run.py        modal_run.py defines the served function
  make <target>                   the Makefile has the target
  bash scripts/<x>.sh [part]      the script exists and names the part

A command with a placeholder (`<demo>`, `...`) is a pattern, not a command, and is skipped.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import shlex
from pathlib import Path

import pytest

from measure import demos as registry
from measure.cli import build_parser

REPO_ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted([REPO_ROOT / "README.md", *(REPO_ROOT / "phases").glob("*/README.md"),
                  *(REPO_ROOT / "docs").glob("**/*.md"), *(REPO_ROOT / "notebooks").glob("*.py")])
STARTS = ("python -m ", "modal run ", "modal serve ", "make ", "bash scripts/")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")
PYTEST_VALUED = ("-m", "-k", "-p", "-o")     # pytest flags whose next word is a value, not a path
PYTHON = re.compile(r"^(\S*/)?python3?$")
PLACEHOLDER = re.compile(r"<[^>]*>|\.\.\.")
RUNNERS = ("common", "measure")     # `python -m common <demo>` and `python -m measure <demo>`: one runner


def commands_in(text: str) -> list[str]:
    """Every command in a README: each line of a fenced block, and each inline code span, that starts like one
    (after any VAR=value prefixes), with a trailing `# comment` cut off."""
    found = []
    for block in FENCE.findall(text):
        found += block.splitlines()[1:-1]
    found += INLINE.findall(FENCE.sub("", text))
    commands = []
    for line in found:
        line = re.sub(r"\s+#.*$", "", line.strip().removeprefix("$ ")).strip()
        for part in line.split("&&"):
            words = part.split()
            while words and ENV_ASSIGNMENT.match(words[0]):
                words.pop(0)
            if words and PYTHON.match(words[0]):
                words[0] = "python"        # .venv/bin/python, python3: the same command
            if words and words[0] == "pytest":
                words[:1] = ["python", "-m", "pytest"]
            part = " ".join(words)
            if part == "make" or part.startswith(STARTS):
                commands.append(part)
    return commands


def every_command() -> list[tuple[str, str]]:
    found = []
    for path in SOURCES:
        for command in dict.fromkeys(commands_in(path.read_text())):
            if not PLACEHOLDER.search(command):
                found.append((str(path.relative_to(REPO_ROOT)), command))
    return found


def parses(parser, args: list[str]) -> str | None:
    """None if the parser accepts args, else what it said."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(args)
    except SystemExit as e:
        return None if e.code == 0 else err.getvalue().strip().splitlines()[-1]
    return None


def check_common(args: list[str]) -> str | None:
    if not args or args[0] in ("--list", "--help", "-h"):
        return None
    name, rest = args[0], args[1:]
    if name == "serve":
        from phases.p5_6_http_server.launch import build_parser as serve_parser
        return parses(serve_parser(), rest)
    if name not in registry.names():
        return f"no demo named {name!r}"
    return parses(build_parser(registry.get(name)), rest)


def check_module(module: str, args: list[str]) -> str | None:
    if module == "pytest":
        for arg, before in zip(args, ["", *args]):
            if arg.startswith("-") or before in PYTEST_VALUED:
                continue
            file, _, test = arg.partition("::")
            if not (REPO_ROOT / file).exists():
                return f"no such test path {file}"
            if test and f"def {test.split('[')[0]}(" not in (REPO_ROOT / file).read_text():
                return f"{file} has no test {test}"
        return None
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return f"no module {module}"
    origin = Path(spec.origin)
    source = (origin.parent / "__main__.py" if origin.name == "__init__.py" else origin).read_text()
    missing = [a for a in args if a.startswith("--") and f'"{a}"' not in source and
               f'"{a[2:].replace("-", "_")}"' not in source]
    return f"{module} defines no {missing}" if missing else None


def check_modal(verb: str, args: list[str]) -> str | None:
    import modal
    import modal_run
    target, rest = args[0], args[1:]
    file, _, fn = target.partition("::")
    if file != "modal_run.py":
        return f"no Modal app file {file}"
    if verb == "serve":
        served = [v for v in vars(modal_run).values() if isinstance(v, modal.Function)]
        return None if modal_run.serve_api in served else "modal_run.py serves no function"
    if not isinstance(getattr(modal_run, fn, None), modal.app.LocalEntrypoint):
        return f"modal_run.py has no entrypoint {fn!r}"
    if "--opts" in rest:
        opts = json.loads(rest[rest.index("--opts") + 1])
        known = {o.name for o in registry.get(fn).options}
        if set(opts) - known:
            return f"{fn} has no options {sorted(set(opts) - known)}"
    return None


def make_targets() -> set[str]:
    text = (REPO_ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z0-9_-]*):", text, re.M))
    demos = re.search(r"^DEMOS\s*:=(.*)$", text, re.M)
    return targets | set(demos.group(1).split() if demos else ())


def check(command: str) -> str | None:
    words = shlex.split(command)
    if words[:2] == ["python", "-m"]:
        module, args = words[2], words[3:]
        return check_common(args) if module in RUNNERS else check_module(module, args)
    if words[0] == "modal":
        return check_modal(words[1], words[2:])
    if words[0] == "make":
        unknown = [w for w in words[1:] if "=" not in w and w not in make_targets()]
        return f"the Makefile has no target {unknown}" if unknown else None
    if words[0] == "bash" and not (REPO_ROOT / words[1]).exists():
        return f"no script {words[1]}"
    return None


def test_the_readmes_show_commands_of_every_kind():
    commands = [c for _, c in every_command()]
    for start in STARTS:
        assert any(c.startswith(start) for c in commands), f"no README command starts with {start!r}"
    assert len(commands) > 50


def test_the_gpu_headline_commands_parse_as_a_gpu_runs_them():
    """Each step of `make gpu-headline` (and of its `--run demos` and `--run paper`) with its GPU settings: a
    command that cannot parse would cost a GPU window."""
    from measure.headline_parts import RUNS, STEP_DIR, Setup
    setup = Setup("cuda", "dummy:qwen3-0.6b", "bf16", dry=False)
    steps = [step for parts in RUNS.values() for part in parts for step in part.steps(setup)]
    broken = []
    for step in steps:
        assert step.argv[0] == "-m", step.argv
        module, args = step.argv[1], [a.replace(STEP_DIR, "/tmp/step") for a in step.argv[2:]]
        why = check_common(args) if module in RUNNERS else check_module(module, args)
        broken += [f"{step.name}: {why}"] if why else []
    assert len(steps) >= 10 and not broken, broken


def test_every_readme_command_names_what_exists_and_parses():
    broken = [f"{path}: `{command}`: {why}" for path, command in every_command() if (why := check(command))]
    assert not broken, "README commands that would not run as written:\n" + "\n".join(broken)


@pytest.mark.parametrize("command, words", [
    ("python -m common no_such_demo", "no demo named"),
    ("python -m common sweep --no-such-flag 3", "unrecognized arguments"),
    ("python -m common sweep --batch-sizes one", "invalid int value"),
    ("python -m common graph_workload --engines graps", "invalid choice"),
    ("python -m measure.decode_tuning --no-such-flag", "defines no"),
    ("python -m pytest tests/test_no_such_file.py", "no such test path"),
    ("python -m pytest tests/test_registry.py::test_no_such_test", "has no test"),
    ("modal run modal_run.py::no_such_demo", "no entrypoint"),
    ("modal run modal_run.py::tput --opts '{\"no_such_option\": 1}'", "has no options"),
    ("modal run other_app.py::sweep", "no Modal app file"),
    ("make no-such-target", "no target"),
    ("bash scripts/no_such_script.sh", "no script"),
])
def test_the_check_catches_a_broken_command(command, words):
    assert words in (check(command) or "")


BARE_INTERPRETERS = ("python", "python3", "pytest")


def bare_interpreter_lines(text: str) -> list[str]:
    """Lines of a fenced block that start with `python` or `pytest` off the PATH: on a fresh clone, after
    `make install`, only .venv/bin/python has torch, so a block to copy and paste must name it. (Inline spans
    such as `python -m common <demo>` name a command in prose and are left alone.)"""
    found = []
    for block in FENCE.findall(text):
        for line in block.splitlines()[1:-1]:
            words = line.split()
            while words and ENV_ASSIGNMENT.match(words[0]):
                words.pop(0)
            if words and words[0] in BARE_INTERPRETERS:
                found.append(line.strip())
    return found


def test_command_blocks_run_the_venvs_python():
    bare = [f"{path.relative_to(REPO_ROOT)}: {line}" for path in SOURCES if path.suffix == ".md"
            for line in bare_interpreter_lines(path.read_text())]
    assert not bare, "command blocks that need .venv/bin/python:\n" + "\n".join(bare)


def test_the_interpreter_check_catches_a_bare_python():
    text = "```bash\n.venv/bin/python -m common sweep\nOMP_NUM_THREADS=1 python -m common tput\npytest -q tests\n```\n" \
           "and `python -m common sweep` inline"
    assert bare_interpreter_lines(text) == ["OMP_NUM_THREADS=1 python -m common tput", "pytest -q tests"]
