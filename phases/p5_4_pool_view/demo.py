"""`pool_replay`: a demo's run, step by step, as one HTML file that draws its KV pool (the /pool page, offline).

`python -m common pool_replay cow_demo` runs that demo's scene on its phase's engine, small enough to read
block by block, takes `pool_frame` after every step, and writes `pool-replay-cow-demo_<device>_<model>.html`
beside the report: the page's HTML, CSS and JavaScript with the frames inlined, nothing fetched. Open it,
press the step buttons (or the arrow keys), and watch the paper's figures happen in the real engine:

    tput          the blog's short and long prompts on phase 3.6's batched engine, four at a time: blocks claimed
                  as sequences grow and given back as they finish (the paper's Fig. 6 and 7)
    cow_demo      n samples of one prompt (phase 4.1): one copy of the prompt's blocks, ref count n, then
                  the copy-on-write of the shared last block (the paper's Fig. 8)
    share_demo    beam search of width n (phase 4.2): beams that share a parent share every block up to the fork,
                  and a pruned beam's blocks go back (the paper's Fig. 9)
    prefix_demo   requests behind one few-shot system prompt (phase 4.3): the first computes it, the next
                  map its cached blocks in; finished ones stay cached-free until evicted (Fig. 9's sharing)
    preempt_demo  a burst against a pool far too small (phase 4.4): the latest requests are preempted, their
                  blocks given back, and recomputed (or swapped, --preemption-mode swap) when room returns
"""

from __future__ import annotations

import json
from pathlib import Path

from common.prompts import LATENCY_DEMO_MAX_RUNNING, LONG_PROMPTS, SHORT_PROMPTS, TABLE_DEMO_PROMPT
from common.sampling import GREEDY, SamplingParams
from measure.demos import Option, RunConfig, demo
from measure.report import Report
from measure.workload import Request, burst
from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE
from phases.p3_6_batched_engine.engine import BatchedPagedEngine
from phases.p4_1_copy_on_write.demo import COW_DEMO_SEED, COW_DEMO_TEMPERATURE
from phases.p4_1_copy_on_write.engine import SharingEngine, worst_case_blocks
from phases.p4_2_beam_search.engine import BeamSearchEngine
from phases.p4_3_prefix_caching.demo import request_ids
from phases.p4_3_prefix_caching.engine import PrefixCachingEngine
from phases.p4_4_preemption.engine import PREEMPTION_MODES, PreemptingEngine
from phases.p5_4_pool_view.pool_stream import POOL_PAGE as PAGE, counters, pool_frame

REPLAYS = ("tput", "cow_demo", "share_demo", "prefix_demo", "preempt_demo")
MAX_STEPS = 5000            # a replay longer than this is cut (a page keeps 5000 frames)
TPUT_POOL_BLOCKS = 64       # tput's pool: room for the four running, so nobody waits for blocks
PREFIX_POOL_BLOCKS = 64     # prefix_demo's pool: room for a few prompts, so the oldest are evicted
PREEMPT_POOL_BLOCKS = 24    # preempt_demo's pool: about a third of what its burst needs at once
PREEMPT_BURST = dict(n=8, prompt_len=(16, 96), output_len=(32, 96))


def tput_scene(lm, cfg: RunConfig):
    """Short and long chat prompts in turn, greedy (short answers stop at EOS), four running at once."""
    engine = BatchedPagedEngine(lm, max_running=LATENCY_DEMO_MAX_RUNNING, block_size=cfg.block_size,
                                n_blocks=TPUT_POOL_BLOCKS)
    for short, long in zip(SHORT_PROMPTS, LONG_PROMPTS):
        for prompt in (short, long):
            engine.add(prompt, cfg.max_new_tokens * 2)
    return engine


def cow_scene(lm, cfg: RunConfig):
    """cow_demo's request: n samples of one prompt, in a pool of exactly its worst case."""
    ids = lm.prompt_ids(TABLE_DEMO_PROMPT)
    n_blocks = worst_case_blocks(Request(prompt_ids=ids, max_new_tokens=cfg.max_new_tokens), cfg.n, cfg.block_size)
    engine = SharingEngine(lm, max_running=cfg.n, block_size=cfg.block_size, n_blocks=n_blocks)
    engine.add_group(ids, cfg.max_new_tokens, SamplingParams(temperature=COW_DEMO_TEMPERATURE, seed=COW_DEMO_SEED),
                     n=cfg.n)
    return engine


def share_scene(lm, cfg: RunConfig):
    """share_demo's search: one prompt, n beams, in a pool of their worst case (every beam a private copy)."""
    ids = lm.prompt_ids(TABLE_DEMO_PROMPT)
    n_blocks = worst_case_blocks(Request(prompt_ids=ids, max_new_tokens=cfg.max_new_tokens), cfg.n, cfg.block_size)
    engine = BeamSearchEngine(lm, max_running=cfg.n, block_size=cfg.block_size, n_blocks=n_blocks)
    engine.add_beam_search(ids, cfg.max_new_tokens, beam_width=cfg.n)
    return engine


def prefix_scene(lm, cfg: RunConfig):
    """prefix_demo's few-shot requests, two running at a time, so the later ones find the prompt cached."""
    engine = PrefixCachingEngine(lm, max_running=2, block_size=cfg.block_size, n_blocks=PREFIX_POOL_BLOCKS)
    for ids in request_ids(lm, n_shots=1, n_requests=cfg.n + 3):
        engine.add_group(ids, cfg.max_new_tokens, GREEDY, ignore_eos=True, n=1)
    return engine


def preempt_scene(lm, cfg: RunConfig):
    """preempt_demo's burst (random prompts, no prefix cache, as the demo runs it) against a small pool."""
    engine = PreemptingEngine(lm, preemption_mode=cfg.preemption_mode, prefix_caching=False, max_running=8,
                              block_size=cfg.block_size, n_blocks=PREEMPT_POOL_BLOCKS)
    for r in burst(lm.vocab_size, **PREEMPT_BURST):
        engine.add_group(r.prompt_ids, r.max_new_tokens, GREEDY, ignore_eos=True, n=1)
    return engine


SCENES = {"tput": tput_scene, "cow_demo": cow_scene, "share_demo": share_scene, "prefix_demo": prefix_scene, "preempt_demo": preempt_scene}


def record(engine) -> list[dict]:
    """A frame before the first step, then one after each step, until the engine is idle."""
    before = counters(engine)
    frames = [pool_frame(engine, (), before)]
    while engine.has_work and len(frames) <= MAX_STEPS:
        before = counters(engine)
        outputs = engine.step()
        frames.append(pool_frame(engine, [o.seq for o in outputs if o.finished], before))
    return frames


def replay_html(frames: list[dict], title: str) -> str:
    """The pool page as one file: its CSS and script inlined, the frames before the script."""
    html = (PAGE / "index.html").read_text()
    css = (PAGE / "pool.css").read_text()
    js = (PAGE / "pool.js").read_text()
    data = json.dumps(frames, separators=(",", ":")).replace("</", "<\\/")   # no "</script>" inside the data
    html = html.replace('<link rel="stylesheet" href="/pool/pool.css">', f"<style>\n{css}</style>")
    return html.replace('<script src="/pool/pool.js"></script>',
                        f"<script>window.POOL_TITLE = {json.dumps(title)};\nwindow.POOL_FRAMES = {data};</script>\n"
                        f"<script>\n{js}</script>")


def write_replay(report: Report, folder: Path) -> Path:
    """The HTML file of a report's frames, beside its JSON."""
    path = Path(folder) / f"{report.stem()}.html"
    path.write_text(replay_html(report.data["frames"], report.data["title"]))
    return path


@demo("pool_replay", phase="p5_4", writes=write_replay,
      help="a demo's run (tput, cow_demo, share_demo, prefix_demo, preempt_demo) as one HTML file that draws the pool step by step",
      options=[Option("of", str, cpu="cow_demo", choices=REPLAYS, positional=True, help="the demo to replay"),
               Option("n", int, cpu=3,
                      help="samples (cow_demo), beams (share_demo), or requests beyond the first three (prefix_demo)"),
               Option("max_new_tokens", int, cpu=24,
                      help="tokens per sequence (tput: twice, to EOS; the others ignore EOS but cow_demo)"),
               Option("block_size", int, cpu=DEFAULT_BLOCK_SIZE, help="tokens per KV block"),
               Option("preemption_mode", str, cpu="recompute", choices=PREEMPTION_MODES,
                      help="preempt_demo: recompute or swap")])
def pool_replay(cfg: RunConfig) -> Report:
    cfg.use_quick(max_new_tokens=4, n=2)
    lm = cfg.load()
    engine = SCENES[cfg.of](lm, cfg)
    frames = record(engine)
    title = f"{cfg.of} replay: {lm.name}, {len(frames) - 1} steps"
    report = cfg.new_report(f"pool_replay_{cfg.of}")
    t = report.table(title, ["steps", "blocks", "block size", "most blocks in use", "preemptions", "copies",
                             "prefix-hit blocks", "finished"])
    last = frames[-1]["totals"]
    t.add_row(len(frames) - 1, engine.allocator.n_blocks, engine.allocator.block_size,
              max(sum(r > 0 for r in f["refs"]) for f in frames), last["preemptions"], last["cow_copies"],
              last["prefix_hit_blocks"], sum(len(f["finished"]) for f in frames))
    t.notes.append("open the .html file saved beside this report: one frame per step, the step buttons walk them")
    report.data.update(title=title, frames=frames)
    return report
