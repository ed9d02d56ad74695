"""The Modal app: defined without credentials and without importing any phase; one entrypoint
per demo; function bodies run locally."""

import json
import subprocess
import sys

import pytest

import modal_run
from common import demos as registry


def test_every_demo_has_an_entrypoint():
    names = set(registry.names())
    assert names == set(registry.DEMO_MODULES) == set(modal_run.ENTRYPOINTS)
    for name in names:
        assert getattr(modal_run, name) is modal_run.ENTRYPOINTS[name]


def test_defining_the_app_imports_no_phase():
    code = ("import sys, modal_run; bad = sorted(m for m in sys.modules if m.startswith('phases')); "
            "print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=modal_run.REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_image_uses_the_pinned_requirements():
    reqs = (modal_run.REPO / "requirements.txt").read_text()
    assert "torch==2.13.0" in reqs and "triton==3.7.1" in reqs


@pytest.mark.parametrize("demo", ["decode_sweep"])
def test_remote_body_runs_locally_and_report_round_trips(demo, tmp_path):
    if demo not in registry.names():
        pytest.skip(f"{demo} not registered yet")
    report = modal_run.run_remote.local(demo, model="tiny", device="cpu", dtype="fp32", quick=True)
    json.dumps(report)  # what crosses the wire must be plain JSON
    modal_run.show_and_save(demo, report, results_dir=tmp_path)
    assert list(tmp_path.glob("*.json")) and list(tmp_path.glob("*.md"))
