"""Where the `tput` measurement used to live; it is now common/ (the harness) and this phase's demo.py.

A re-export kept only until phase 3.5's runners and demo, notebook 06 and tests/test_p3_5_engine.py import
these names from their new homes:
- common/harness.py  EngineRun, EngineRunner, measure, warm_up, warmup_requests, warmup_rule, pick_engines,
                     format_settings, workload_pool_blocks, WARMUP_NEW_TOKENS_CPU
- common/tput.py     the batch-size sweep: run_tput, tput_options, tput_requests, plot_tput
- demo.py            this phase's engines: run_dynamic, run_paged, TPUT_ENGINES
"""

from __future__ import annotations

import common.tput
from common.harness import (WARMUP_NEW_TOKENS_CPU, EngineRun, EngineRunner, format_settings,
                            measure, pick_engines, warm_up, warmup_requests, warmup_rule, workload_pool_blocks)
from common.tput import plot_tput, tput_options, tput_requests
from phases.p3_3_paged_cache.demo import KV_ACCOUNTING, TPUT_ENGINES, run_dynamic, run_paged

__all__ = ["WARMUP_NEW_TOKENS_CPU", "EngineRun", "EngineRunner", "format_settings", "measure", "pick_engines",
           "warm_up", "warmup_requests", "warmup_rule", "workload_pool_blocks", "plot_tput", "tput_options",
           "tput_requests", "TPUT_ENGINES", "run_dynamic", "run_paged", "run_tput"]


def run_tput(cfg, engines, on_request=()):
    """common.tput.run_tput with this phase's note on how the engines count KV bytes (as before the move)."""
    return common.tput.run_tput(cfg, engines, on_request, kv_note=KV_ACCOUNTING)
