"""`cow_demo`: n samples of one prompt, their block tables right after the fork and after the copy-on-write.

One request asks for n samples. The demo steps the SharingEngine by hand and
prints each sample's block table (physical ids, refcounts) at three moments:
right after the single prefill pass and the fork (every id shared n ways), after
the first decode step (the partly filled prompt block copied by n-1 samples,
the last one writing in place), and at the end of each sample's life.
"""

from __future__ import annotations

from common.prompts import TABLE_DEMO_PROMPT
from common.sampling import SamplingParams
from measure.demos import Option, RunConfig, demo
from measure.report import Report
from measure.workload import Request
from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE
from phases.p4_1_copy_on_write.engine import SharingEngine, worst_case_blocks

COW_DEMO_TEMPERATURE = 0.8
COW_DEMO_SEED = 0
QUICK_MAX_NEW_TOKENS = 4
QUICK_BLOCK_SIZE = 4


class RecordsBlockUsage:
    """A mixin for an engine of this phase's line: at every pass with decode tokens, just before it runs, it
    records `(blocks held, blocks the same tables would hold unshared)` in `usage`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.usage: list[tuple[int, int]] = []

    def schedule(self):
        batch = super().schedule()
        if batch.decode:
            self.usage.append(self.block_usage())
        return batch


class _RecordingEngine(RecordsBlockUsage, SharingEngine):
    """Notes each sample's block table just before its blocks go back, and the block usage of every pass."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.last_tables: dict[int, tuple[int, str]] = {}

    def retire(self, seq) -> None:
        self.last_tables[seq.seq_id] = (seq.kv.n_filled, _ids(self, seq.kv))
        super().retire(seq)


def _ids(engine: SharingEngine, table) -> str:
    """Physical ids with their refcounts, e.g. `7(x3) 1(x3) 4`."""
    rc = engine.allocator.refcount
    return " ".join(f"{b}(x{rc(b)})" if rc(b) > 1 else str(b) for b in table.block_ids)


def _snapshot(engine: SharingEngine, report: Report, title: str, group, notes: list[str]) -> None:
    t = report.table(title, ["sample", "tokens in KV", "block ids (x refcount when shared)"])
    for i, seq in enumerate(group.seqs):
        t.add_row(i, seq.kv.n_filled, _ids(engine, seq.kv))
    held, unshared = engine.block_usage()
    t.notes += [f"{held} distinct blocks held; {unshared} if every sample had its own copy"] + notes


@demo("cow_demo", phase="p4_1", help="n samples of one prompt: shared prompt blocks, then the copy-on-write",
      options=[Option("n", int, cpu=3, gpu=4, help="samples of the one prompt"),
               Option("max_new_tokens", int, cpu=32, gpu=128, help="cap per sample"),
               Option("block_size", int, cpu=DEFAULT_BLOCK_SIZE, help="tokens per KV block")])
def cow_demo(cfg: RunConfig) -> Report:
    lm = cfg.load()
    report = cfg.new_report("cow_demo")
    max_new = QUICK_MAX_NEW_TOKENS if cfg.quick else cfg.max_new_tokens
    block_size = QUICK_BLOCK_SIZE if cfg.quick else cfg.block_size
    prompt_ids = lm.prompt_ids(TABLE_DEMO_PROMPT)
    n_prompt = len(prompt_ids)
    n_blocks = worst_case_blocks(Request(prompt_ids=prompt_ids, max_new_tokens=max_new), cfg.n, block_size)
    engine = _RecordingEngine(lm, max_running=cfg.n, block_size=block_size, n_blocks=n_blocks)
    sampling = SamplingParams(temperature=COW_DEMO_TEMPERATURE, seed=COW_DEMO_SEED)
    group = engine.add_group(prompt_ids, max_new, sampling, n=cfg.n)

    engine.step()  # one prefill pass over the prompt, then the fork into n samples
    full, part = divmod(n_prompt, block_size)
    _snapshot(engine, report, f"After the prefill and the fork: {cfg.n} samples, one copy of the prompt", group,
              [f"prompt: {n_prompt} tokens = {full} full block(s)" + (f" + {part}/{block_size} in a shared last block"
                                                                      if part else ""),
               f"forward passes so far: {engine.n_forward_passes} (the prompt was prefilled once, not {cfg.n} times)"])
    first_ids = [list(s.kv.block_ids) for s in group.seqs]
    if engine.has_work:
        engine.step()  # each sample writes its first token's K/V: the copy-on-write moment
        moved = []
        for i, (before, seq) in enumerate(zip(first_ids, group.seqs)):
            if seq.kv.block_ids and len(before) == len(seq.kv.block_ids) and before[-1] != seq.kv.block_ids[-1]:
                moved.append(f"sample {i}: block {before[-1]} copied to {seq.kv.block_ids[-1]}")
        _snapshot(engine, report, "After the first decode step (copy-on-write)", group,
                  moved or ["no copy: the prompt filled its last block exactly, so every sample opened a new one"])
    while engine.has_work:
        engine.step()
    end = report.table("Each sample when it finished", ["sample", "generated", "tokens in KV", "block ids", "output"])
    for i, seq in enumerate(group.seqs):
        filled, ids = engine.last_tables[seq.seq_id]
        end.add_row(i, len(seq.output_ids), filled, ids, lm.decode(seq.output_ids)[:60])
    end.notes += [f"blocks copied by copy-on-write in the whole run: {engine.n_copied}",
                  f"after the run: {engine.allocator.n_free}/{engine.allocator.n_blocks} blocks free"]
    report.data.update(n_copied=engine.n_copied, usage=[list(u) for u in engine.usage], n=cfg.n,
                       block_size=block_size, n_prompt=n_prompt)
    return report
