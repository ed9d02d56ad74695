"""`serve_workload`: the served engine on workload_bench's equal and mixed work, beside phase 3.6's and 3.10's.

`ServingEngine` carries every later layer (samples over shared blocks, prefix
caching, preemption, failure isolation) on top of phase 3.10's static decode
step. None of those layers does any work on these requests
(one sample each, distinct random prompts, a pool large enough for all of
them), so whatever the served engine costs beyond phase 3.10's is the price of
carrying them: the bookkeeping each one adds to every step. The target says
that price should be nothing: the served engine as fast as phase 3.6's
batched engine on the same requests.

It needs no HTTP stack (no fastapi or uvicorn): the harness drives the
engine directly, as workload_bench drives the others.
"""

from __future__ import annotations

from functools import partial

from measure.demos import RunConfig, demo
from measure.harness import EngineRunner
from measure.hf_peers import HF_STATIC
from measure.report import Report
from measure.workload_bench import run_workload_bench, workload_options
from phases.p3_6_batched_engine.demo import BATCHED
from phases.p3_10_cuda_graphs.demo import GRAPHS, prefilled_graph_engine, run_graphs
from phases.p5_1_served_engine.engine import ServingEngine

SERVED = EngineRunner("served", "ServingEngine (p5): the served engine, every layer of phases 4.1-5 on 3.10's "
                      "static decode step", partial(run_graphs, engine_cls=ServingEngine))
ENGINES = [BATCHED, GRAPHS, SERVED, HF_STATIC]
TARGETS = {  # (workload, faster, slower) -> the ratio this phase aims for: the later layers cost nothing here
    ("equal", "served", "batched"): 1.0,
    ("mixed", "served", "batched"): 1.0,
}


@demo("serve_workload", phase="p5_1",
      help="workload_bench's equal and mixed work through the served engine, phase 3.6's and 3.10's engines",
      options=workload_options(["batched", "graphs", "served"], ["hf_static", "batched", "graphs", "served"],
                               [e.name for e in ENGINES] + ["hf_cb"]))
def serve_workload(cfg: RunConfig) -> Report:
    return run_workload_bench(cfg, ENGINES, focus="served", targets=TARGETS,
                              profile_engine=partial(prefilled_graph_engine, engine_cls=ServingEngine),
                              name="serve_workload")
