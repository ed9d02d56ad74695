"""What a long prompt arriving does to streams already decoding: their inter-token latency (ITL), any engine.

    rows = latency_table(report, lm, engines, n_streams=4, stream_prompt=32, long_prompt=512, budget=64, ...)

`engines` maps a row name to `make(lm, max_running=, block_size=, n_blocks=)`, a
fresh engine with the schedulers' shape (`add(prompt_ids, max_new_tokens, ...)`,
`step()`, `run()`, `n_steps`, `allocator`); measure/ imports no phase, so a phase's
demo builds them. The last two rows are read as one engine with whole prompts,
then the same engine prefilling in chunks of `budget` tokens.
"""

from __future__ import annotations

from typing import Callable

import torch

from common.clock import now
from measure.bench import ceil_div, percentile
from measure.harness import pool_problems
from measure.progress import progress_bar
from measure.report import Report
from measure.workload import FIRST_ORDINARY_TOKEN_ID

IDS_SEED = 1
TOKEN_RANGE = (FIRST_ORDINARY_TOKEN_ID, 40_000)   # ordinary ids in every model's vocabulary
STREAM_TAIL_STEPS = 8   # the streams decode this many steps past the long prompt's expected prefill


def random_ids(n: int, gen: torch.Generator) -> list[int]:
    """n random ordinary token ids: a prompt whose content does not matter, only its length."""
    return torch.randint(*TOKEN_RANGE, (n,), generator=gen).tolist()


def stream_latency(lm, engine, n_streams: int, stream_prompt: int, long_prompt: int, steps_before: int,
                   stream_tokens: int) -> dict:
    """Streams decode; after `steps_before` steps the long prompt arrives. The streams' gaps between
    tokens from then on (ms: p50, p99, max), and the long prompt's TTFT."""
    gen = torch.Generator().manual_seed(IDS_SEED)
    streams = [engine.add(random_ids(stream_prompt, gen), stream_tokens, ignore_eos=True) for _ in range(n_streams)]
    for _ in range(steps_before):
        engine.step()
    arrival = now(lm.device)
    long_seq = engine.add(random_ids(long_prompt, gen), 2, ignore_eos=True, arrival=arrival)
    engine.run()
    assert not pool_problems(engine.allocator), "blocks leaked"
    gaps = [(b - a) * 1e3 for s in streams for a, b in zip(s.timing.token_times, s.timing.token_times[1:])
            if b > arrival]
    return dict(p50=percentile(gaps, 50), p99=percentile(gaps, 99), max=max(gaps), n_gaps=len(gaps),
                long_ttft_ms=long_seq.timing.ttft_ms, steps=engine.n_steps)


def latency_table(report: Report, lm, engines: dict[str, Callable], n_streams: int, stream_prompt: int,
                  long_prompt: int, budget: int, steps_before: int, block_size: int) -> dict[str, dict]:
    """Every engine through `stream_latency` on the same requests (one warm-up run first); one table row each."""
    t = report.table(f"{n_streams} streams decoding when a {long_prompt}-token prompt arrives: their "
                     "inter-token latency from then on",
                     ["engine", "ITL p50 ms", "ITL p99 ms", "ITL max ms", "long prompt TTFT ms", "steps"])
    # Every engine does the same work: the streams run long enough to outlast the chunked prefill
    # (the decode tokens take n_streams of each step's budget, the chunk the rest).
    chunk_steps = ceil_div(long_prompt, max(budget - n_streams, 1))
    stream_tokens = steps_before + chunk_steps + STREAM_TAIL_STEPS
    pool = dict(max_running=n_streams + 1, block_size=block_size,
                n_blocks=n_streams * ceil_div(stream_prompt + stream_tokens, block_size)
                + ceil_div(long_prompt + 2, block_size))
    args = (n_streams, stream_prompt, long_prompt, steps_before, stream_tokens)
    rows = {}
    with progress_bar(f"{report.demo}: latency", total=len(engines)) as bar:
        for name, make in engines.items():
            stream_latency(lm, make(lm, **pool), *args)                        # warm-up: same shapes
            r = rows[name] = stream_latency(lm, make(lm, **pool), *args)
            t.add_row(name, r["p50"], r["p99"], r["max"], r["long_ttft_ms"], r["steps"])
            bar.advance()
    whole, chunked = list(rows.values())[-2:]
    t.notes += [
        f"ITL: gaps between consecutive tokens of the {n_streams} streams ({stream_tokens} tokens each, prompts "
        f"of {stream_prompt}) after the long prompt arrived ({whole['n_gaps']} gaps per engine); one warm-up "
        "run first on the same requests.",
        f"p99 ITL, whole prompts / chunks: {whole['p99'] / chunked['p99']:.2f}x lower with chunking.",
        "With whole prompts every stream waits for the long prompt's whole prefill once; with chunks each step "
        "carries at most max_num_batched_tokens tokens, so no gap is longer than one such pass, and the long "
        "prompt's first token comes later.",
    ]
    return rows
