"""docs/architecture.md traces one step of the served engine with file:line; the trace must match the code.

Each row of the trace names `Class.method` and `path:line`. The check: the method that runs for the
served engine (or for its KV, runner or sampler part) is that class's, and it is defined at that line.
The page's redesign table (classes in the served chain, methods along it, most levels, hidden methods, part-making
methods overridden, files the trace visits) is counted from the code.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from phases.p5_1_served_engine.engine import ServingEngine

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
ROW = re.compile(r"\| (\w+) \|[^|]*\| `(\w+)\.(\w+)` `([\w/.]+\.py):(\d+)` \|")
STAGES = ["step", "schedule", "admit", "admission", "plan", "claim", "run_batch", "run", "written", "emit", "sample",
          "update"]
# the part each stage's method belongs to; every other stage is the engine's
PART_OF_STAGE = {"admission": "admission", "plan": "prefill", "run": "runner", "written": "kv", "sample": "sampler"}


def trace_rows() -> list[tuple[str, str, str, str, int]]:
    """(stage, class, method, path, line) of every row of the doc's step trace, in order."""
    return [(s, c, m, p, int(n)) for s, c, m, p, n in ROW.findall(DOC.read_text())]


def test_the_step_trace_names_every_stage_in_order():
    assert [row[0] for row in trace_rows()] == STAGES


def test_each_traced_method_is_the_one_that_runs_and_is_where_the_doc_says(tiny32):
    engine = ServingEngine(tiny32, max_running=4, block_size=4, n_blocks=32)
    for stage, cls_name, method, path, line in trace_rows():
        owner = getattr(engine, PART_OF_STAGE[stage]) if stage in PART_OF_STAGE else engine
        fn = getattr(type(owner), method)
        assert fn.__qualname__ == f"{cls_name}.{method}", (stage, fn.__qualname__)
        source = Path(inspect.getsourcefile(fn)).resolve().relative_to(ROOT).as_posix()
        assert (source, inspect.getsourcelines(fn)[1]) == (path, line), (stage, source, inspect.getsourcelines(fn)[1])


def test_the_check_reads_a_row():
    row = "| run | the mixed pass | `StaticRunner.run` `phases/p3_10_cuda_graphs/runner.py:107` |"
    assert ROW.findall(row) == [("run", "StaticRunner", "run", "phases/p3_10_cuda_graphs/runner.py", "107")]


def served_chain() -> list[type]:
    """The project classes the served engine is made of, most derived first."""
    return [c for c in ServingEngine.__mro__ if c.__module__.startswith("phases.")]


def redesign_row(label: str) -> str:
    """The 'after' cell of one row of the doc's redesign table."""
    row = next(line for line in DOC.read_text().splitlines() if line.startswith(f"| {label} |"))
    return row.split("|")[3].strip()


def test_the_served_chain_is_every_engine_of_the_line():
    """Each engine the reader studies from phase 3.6 on is a link of the served engine's chain, in phase order."""
    names = [c.__name__ for c in reversed(served_chain())]
    assert names == ["BatchedPagedEngine", "ChunkedPrefillEngine", "StaticDecodeEngine", "SharingEngine",
                     "PrefixCachingEngine", "PreemptingEngine", "SpeculativeEngine", "TensorParallelEngine",
                     "ServingEngine"]


def test_the_redesign_table_states_the_served_chain_as_it_is():
    chain = served_chain()
    defined = [name for c in chain for name, v in vars(c).items()
               if callable(v) or isinstance(v, (property, staticmethod, classmethod))]
    levels = {name: defined.count(name) for name in set(defined) if name != "__init__"}
    most = max(levels.values())
    deepest = ", ".join(f"`{name}`" for name in sorted(n for n, k in levels.items() if k == most))
    assert redesign_row("classes in the served engine's chain") == str(len(chain))
    assert redesign_row("methods defined along it") == f"{len(defined)} ({len(set(defined))} distinct)"
    assert redesign_row("most levels one method is defined at (`__init__` aside)") == f"{most} ({deepest})"


def hidden_methods() -> list[str]:
    """Every method along the served chain that an override hides without calling it (`super().name`, from any
    method of the overriding class)."""
    chain = served_chain()
    hidden = []
    for name in {n for c in chain for n in vars(c) if not (n.startswith("__") and n != "__init__")}:
        owners = [c for c in chain if name in vars(c)]
        for above, below in zip(owners, owners[1:]):
            if f"super().{name}" not in inspect.getsource(above):
                hidden.append(f"{below.__name__}.{name} (hidden by {above.__name__})")
    return hidden


def test_no_method_along_the_served_chain_is_dead():
    """A method defined at several levels runs at each, so no earlier phase's method rides along unused; the one
    exception is a `make_` method, which a later phase overrides to make another part in place of its own."""
    hidden = hidden_methods()
    dead = [h for h in hidden if not h.split(".")[1].startswith("make_")]
    assert dead == []
    assert redesign_row("methods along it hidden by an override that never calls them") == str(len(dead))
    assert redesign_row("part-making methods overridden to pick another part") == str(len(hidden) - len(dead))


def test_the_redesign_table_counts_the_files_the_step_trace_visits():
    assert redesign_row("files one served step visits (the trace above)") == str(len({row[3] for row in trace_rows()}))
