"""The measurement lab: how the demos run, time, compare and report the phases' engines.

It sits above every phase (a demo names the phase it measures; see demos.py),
and no phase's engine code imports it. The ground floor it measures with is
common/ (the model, the prompts, the clock).

- cli.py, demos.py          `python -m common <demo>` (or `python -m measure`): the runner and the demo registry
- bench.py                  peak memory, CPU threads, the metric maths over common/clock.py's timestamps
- report.py, plots.py       tables, JSON and markdown results; matplotlib figures from them
- progress.py               the progress bar a demo shows while it works
- workload.py, load_gen.py  request traces (prompt lists, length distributions, arrivals); a streaming load generator
- harness.py, hf_peers.py   any engine on the same requests, one row each; Hugging Face's engines as peers
- preempt_checks.py         a preempting scheduler's promises, checked as it runs and after it drains
- tput.py, *_bench.py       each demo's harness: throughput sweeps, kernels, steps, prefill, preemption, serving
- roofline.py, kernel_count.py, stream_latency.py, prefill_attention.py
                            what a step could reach, the kernels it launches, streams' latency, prefill attention
- gpu_check.py, gpu_headline.py, headline_parts.py
                            the gpu test tier and every demo on a GPU; the headline GPU figures in one run
"""
