"""The lazy demo registry and `python -m common`: a demo imports only its own module, a missing
optional package breaks only the demos that need it, and bad input ends in one line and exit 2.
And the floors: common/ imports neither a phase nor measure/, and the phases' engine code nothing
from measure/.

Each command runs in a fresh interpreter in which some packages are made unimportable
(`sys.modules[name] = None`, which makes `import name` raise ModuleNotFoundError exactly as
on a machine without it)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from measure import demos as registry
from measure.cli import build_parser

REPO_ROOT = Path(__file__).resolve().parent.parent
SERVER_PACKAGES = ["fastapi", "uvicorn", "starlette", "httpx", "openai"]
TINY_SWEEP = ["sweep", "--model", "tiny", "--device", "cpu", "--dtype", "fp32", "--quick"]


def run_common(args: list[str], hide: list[str] = (), results_dir: Path | None = None):
    """`python -m common <args>` with the packages in `hide` unimportable; returns the CompletedProcess."""
    if results_dir is not None:
        args = [*args, "--results-dir", str(results_dir)]
    code = ("import sys\n"
            f"for name in {list(hide)!r}: sys.modules[name] = None\n"
            "from measure.cli import main\n"
            f"sys.exit(main({args!r}))\n")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


def one_error_line(done) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got:\n{done.stderr}"
    assert lines[0].startswith("error: ")
    return lines[0]


def test_the_table_names_every_demo_and_each_module_defines_its_demos():
    loaded, missing = registry.load_all()
    assert not missing, "every optional package is installed in the test venv"
    assert list(loaded) == registry.names() == list(registry.DEMO_MODULES)
    for name, demo in loaded.items():
        assert demo.run.__module__ == registry.DEMO_MODULES[name]
    # p3_3's `tput` was taken over by p3_6 and is kept as an earlier version
    assert [d.phase for d in registry.EARLIER["tput"]] == ["p3_3"]


# The ground floor: every module of common/ but its __main__, which hands `python -m common` to measure/.
GROUND_FLOOR = sorted(f"common.{p.stem}" for p in (REPO_ROOT / "common").glob("*.py") if p.stem != "__main__")
# Phase files that measure rather than build: the demo modules the registry names, and the checks and
# compile or tuning scripts beside them.
NOT_CONCEPT = {"checks.py", "aot_check.py", "tuning.py", "bench.py"}   # measurement, beside the concept
DEMO_FILES = {REPO_ROOT / (module.replace(".", "/") + ".py") for module in registry.DEMO_MODULES.values()}


def test_common_imports_no_phase_and_no_measurement():
    assert {"common.model", "common.sampling", "common.clock"} <= set(GROUND_FLOOR)
    code = (f"import sys\nfor m in {GROUND_FLOOR!r}:\n    __import__(m)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('phases', 'measure'))\n"
            "print(bad)\nsys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_the_phases_engine_code_imports_nothing_from_measure():
    """The engines stand on common/ alone; only a phase's demo and its checks reach up to the measurement lab."""
    concept = [p for p in sorted((REPO_ROOT / "phases").rglob("*.py"))
               if p.name not in NOT_CONCEPT and p not in DEMO_FILES]
    assert len(concept) > 50
    bad = {str(p.relative_to(REPO_ROOT)): sorted(m for m in imported_modules(p) if m.split(".")[0] == "measure")
           for p in concept}
    assert not {k: v for k, v in bad.items() if v}


@pytest.mark.parametrize("package", ["common", "measure"])
def test_python_dash_m_common_and_measure_are_one_runner(package):
    done = subprocess.run([sys.executable, "-m", package, "--help"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "python -m common <demo>" in done.stdout and "sweep" in done.stdout


def test_a_demo_imports_only_its_own_phase_modules():
    code = ("import sys\nfrom measure import demos\ndemos.get('decode_sweep')\n"
            "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('phases.')}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['p0_generate', 'p1_kv_cache']"


def test_sweep_runs_without_the_server_packages(tmp_path):
    done = run_common(TINY_SWEEP, hide=SERVER_PACKAGES, results_dir=tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "sweep_cpu_tiny.json").read_text())
    assert report["tables"][0]["rows"]
    assert (tmp_path / "sweep_cpu_tiny.png").exists()


def git_state() -> tuple[str, str]:
    """(tracked files that differ from HEAD, untracked files git does not ignore), as `git status` lists them."""
    def status(*args: str) -> str:
        return subprocess.run(["git", "status", "--porcelain", *args], cwd=REPO_ROOT, capture_output=True,
                              text=True, check=True).stdout
    return status("--untracked-files=no"), status("--untracked-files=all")


def test_a_demo_with_its_default_output_leaves_every_tracked_file_alone():
    """A reader's own run goes to runs/ (git-ignored), named in the last line printed; results/,
    the reference runs the READMEs quote, changes only with --reference."""
    before = git_state()
    reference = {p: p.stat().st_mtime_ns for p in (REPO_ROOT / "results").rglob("*")}
    done = run_common(TINY_SWEEP)
    assert done.returncode == 0, done.stderr
    assert git_state() == before
    assert {p: p.stat().st_mtime_ns for p in (REPO_ROOT / "results").rglob("*")} == reference
    assert (REPO_ROOT / "runs" / "sweep_cpu_tiny.json").exists()
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("reports saved in runs/") and "ignored by git" in last


def test_reference_runs_go_to_results(tmp_path, monkeypatch):
    from measure import cli
    assert cli.output_dir(None, reference=True) == cli.RESULTS_DIR
    assert cli.output_dir(None) == cli.RUNS_DIR
    assert cli.output_dir(str(tmp_path), reference=True) == tmp_path      # a named folder wins
    assert "reference runs the READMEs quote" in cli.where_saved(cli.RESULTS_DIR)
    ignored = subprocess.run(["git", "check-ignore", "-q", "runs/x.json"], cwd=REPO_ROOT)
    assert ignored.returncode == 0, "runs/ must be git-ignored"


def test_a_demo_that_needs_a_missing_package_says_which_and_how_to_install_it(tmp_path):
    done = run_common(["bench_serve", "--model", "tiny", "--device", "cpu", "--quick"], hide=["fastapi"],
                      results_dir=tmp_path)
    assert done.returncode == 2
    line = one_error_line(done)
    assert "demo 'bench_serve' needs the Python package 'fastapi'" in line
    assert "pip install fastapi==" in line
    assert not list(tmp_path.iterdir())


def test_serve_without_uvicorn_says_so_in_one_line():
    done = run_common(["serve", "--model", "tiny"], hide=["uvicorn"])
    assert done.returncode == 2
    assert "'uvicorn'" in one_error_line(done) and "pip install uvicorn==" in done.stderr


def test_list_marks_the_demos_whose_package_is_missing():
    done = run_common(["--list"], hide=["fastapi"])
    assert done.returncode == 0, done.stderr
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if line.strip()}
    assert set(lines) == set(registry.names())
    assert "unavailable" in lines["bench_serve"] and "fastapi" in lines["bench_serve"]
    assert "[p2_1]" in lines["sweep"]


def test_without_matplotlib_the_tables_are_saved_and_the_plot_is_skipped_in_one_line(tmp_path):
    done = run_common(TINY_SWEEP, hide=["matplotlib"], results_dir=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "sweep_cpu_tiny.json").exists() and (tmp_path / "sweep_cpu_tiny.md").exists()
    assert not (tmp_path / "sweep_cpu_tiny.png").exists()
    assert "needs the Python package 'matplotlib'" in done.stderr


@pytest.mark.parametrize("args, words", [
    (["sweep", "--device", "cuda", "--model", "tiny"], "no CUDA GPU"),
    (["sweep", "--dtype", "fp8", "--model", "tiny", "--device", "cpu"], "unknown dtype 'fp8'"),
    (["sweep", "--model", "no-such-model", "--device", "cpu"], "unknown model 'no-such-model'"),
    (["no_such_demo"], "unknown demo 'no_such_demo'"),
])
def test_bad_input_is_one_line_and_exit_status_2(args, words):
    if "cuda" in args:
        import torch
        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    done = run_common(args)
    assert done.returncode == 2
    assert words in one_error_line(done)


def test_a_demo_outside_the_table_is_refused_at_definition():
    with pytest.raises(ValueError, match="DEMO_MODULES"):
        registry.demo("not_in_the_table", phase="p9", help="")


def test_an_option_with_choices_refuses_any_other_value_before_a_model_loads():
    loaded, _ = registry.load_all()
    with_choices = [(d, o) for d in loaded.values() for o in d.options if o.choices]
    assert {d.name for d, _ in with_choices} >= {"graph_bench", "fused_bench", "prefill_bench", "workload_bench",
                                                 "graph_workload", "fused_workload", "bench_serve"}
    for d, o in with_choices:      # the defaults themselves are choices, on either device
        assert o.refusal(o.default(on_gpu=False)) is None and o.refusal(o.default(on_gpu=True)) is None, (d.name, o)
    graph_bench = registry.get("graph_bench")
    with pytest.raises(SystemExit) as parsed:
        build_parser(graph_bench).parse_args(["--sections", "step", "kernal"])
    assert parsed.value.code == 2
    # The same check where options come as a dict (run_demo, Modal's --opts): one message naming the choices.
    with pytest.raises(ValueError, match=r"option 'sections' takes \['kernel', 'step', 'host', 'tune'\], not \['kernal'\]"):
        graph_bench.resolve(False, {"sections": ["step", "kernal"]})
    assert graph_bench.resolve(False, {"sections": ["tune"]})["sections"] == ["tune"]
