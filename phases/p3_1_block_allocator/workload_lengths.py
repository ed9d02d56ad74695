"""Real token counts for the block-accounting demos: run the latency workload once, keep the lengths.

How many blocks a sequence needs depends on how many tokens it ends up
holding, which nobody knows before it runs: "What is 2 + 2?" stops after a
handful of tokens, "Describe the history of the Roman Empire" runs to the cap.
So the demos of phases 3.1 and 3.2 do not guess lengths: they run phase 2.3's
continuous-batching scheduler on the latency demo's prompts (short and long,
interleaved) and account blocks for the lengths the model really produced.
"""

from __future__ import annotations

from common.prompts import (LATENCY_DEMO_MAX_RUNNING, LATENCY_DEMO_MAX_TOKENS,
                            interleaved_latency_prompts)


def latency_workload_lengths(lm, max_new_tokens: int = LATENCY_DEMO_MAX_TOKENS,
                             max_running: int = LATENCY_DEMO_MAX_RUNNING,
                             prompts: list[str] | None = None) -> list[dict]:
    """Generate the workload; return, in prompt order, one dict per sequence:
    `{"prompt": str, "prompt_tokens": int, "generated_tokens": int}`.

    The sequence's K/V footprint is prompt_tokens + generated_tokens tokens.
    """
    # Imported here: phase 3.1 depends on phase 2.3 only for these numbers.
    from phases.p2_3_continuous_batching.scheduler import ContinuousScheduler

    prompts = interleaved_latency_prompts() if prompts is None else list(prompts)
    if not prompts:
        raise ValueError("no prompts: the workload needs at least one")
    scheduler = ContinuousScheduler(lm, max_running=max_running)
    for prompt in prompts:
        scheduler.add(prompt, max_new_tokens)
    with _progress(len(prompts)) as advance:
        finished = scheduler.run(progress=advance)
    finished = sorted(finished, key=lambda s: s.seq_id)
    return [{"prompt": p, "prompt_tokens": len(s.prompt_ids), "generated_tokens": len(s.output_ids)}
            for p, s in zip(prompts, finished)]


class _progress:
    """A rich progress bar over finished sequences (the CPU run takes tens of seconds)."""

    def __init__(self, total: int):
        from rich.progress import Progress
        self.bar = Progress(transient=True)
        self.task = self.bar.add_task("generating the latency workload", total=total)

    def __enter__(self):
        self.bar.start()
        return lambda n_finished, n_added: self.bar.update(self.task, completed=n_finished)

    def __exit__(self, *exc):
        self.bar.stop()
