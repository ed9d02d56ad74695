"""The Modal app: defined without credentials and without importing any phase; one entrypoint
per demo, plus the gpu tier and the fan-out; function bodies run locally."""

import json
import multiprocessing
import subprocess
import sys

import modal_run
from measure import demos as registry


def test_every_demo_has_an_entrypoint():
    names = set(registry.names())
    assert names == set(registry.DEMO_MODULES)
    assert names <= set(modal_run.ENTRYPOINTS) and set(modal_run.ENTRYPOINTS) == names
    for name in names:
        assert getattr(modal_run, name) is modal_run.ENTRYPOINTS[name]
    assert modal_run.gpu_check is not None and modal_run.all_demos is not None


def test_defining_the_app_imports_no_phase():
    code = ("import sys, modal_run; bad = sorted(m for m in sys.modules if m.startswith('phases')); "
            "print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=modal_run.REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_image_uses_the_pinned_requirements():
    reqs = (modal_run.REPO / "requirements.txt").read_text()
    assert "torch==2.13.0" in reqs and "triton==3.7.1" in reqs


def test_remote_body_runs_locally_and_report_round_trips(tmp_path):
    report = modal_run.run_remote.local("decode_sweep", model="tiny", device="cpu", dtype="fp32", quick=True)
    json.dumps(report)  # what crosses the wire must be plain JSON
    modal_run.show_and_save("decode_sweep", report, results_dir=tmp_path)
    assert list(tmp_path.glob("decode-sweep_cpu_tiny.json")) and list(tmp_path.glob("decode-sweep_cpu_tiny.md"))


def test_fan_out_saves_every_report_and_names_the_failures(tmp_path, capsys):
    ok = modal_run.run_remote.local("decode_sweep", model="tiny", device="cpu", dtype="fp32", quick=True)
    failed = modal_run.save_each(["decode_sweep", "sweep"], [ok, RuntimeError("CUDA error: out of memory")],
                                 results_dir=tmp_path)
    assert failed == ["sweep"]
    assert (tmp_path / "decode-sweep_cpu_tiny.json").exists()
    assert "sweep failed: RuntimeError: CUDA error: out of memory" in capsys.readouterr().out


def test_the_tensor_parallel_entrypoint_runs_the_tests_then_the_demo_here():
    from phases.p4_7_tensor_parallel.demo import QUICK as TP_QUICK

    assert "tp_demo" in modal_run.MULTI_GPU_DEMOS and modal_run.remote_for("tp_demo") is modal_run.run_remote_multi
    out = modal_run.tensor_parallel_remote.local(
        model="tiny", device="cpu", dtype="fp32", quick=True,
        tests=["tests/test_p4_6_model_sharding.py::test_split_cuts_contiguous_ranges_that_cover_everything"])
    assert out["tests"]["returncode"] == 0 and "1 passed" in out["tests"]["tail"]
    report = out["report"]
    assert report["data"]["tp"] == 2 and report["data"]["identical"] == TP_QUICK["n_requests"]
    assert multiprocessing.active_children() == []

