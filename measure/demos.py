"""The demo registry: one table naming every demo and the module that defines it.

A phase defines a demo with the `@demo(...)` decorator in its own `demo.py`
and adds one line to DEMO_MODULES below. `python -m common <name>`
(measure/cli.py) and `modal run modal_run.py::<name>` (modal_run.py) both
look demos up here, so a demo runs the same code on a laptop CPU and on a
Modal GPU; only the defaults differ (`Option.cpu` vs `Option.gpu`), because a
CPU minute buys far fewer tokens.

The registry is lazy: `get(name)` imports only the module that defines
`name`. A demo whose module needs a package that is not installed (the
server's fastapi and uvicorn, say) fails alone, with `MissingPackage` naming
the package and its install command; every other demo still runs. Nothing in
measure/ imports a phase until a demo is asked for by name.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from measure.report import Report

# Every demo -> the module that defines it, in reading order. A new demo adds its line here.
# `tput` is defined in p3_3 and taken over by p3_6 (see `demo(extends=...)`): the table names the latest.
DEMO_MODULES: dict[str, str] = {
    "decode_sweep": "phases.p1_kv_cache.demo",
    "sweep": "phases.p2_1_naive_batching.demo",
    "waste_demo": "phases.p2_1_naive_batching.demo",
    "latency_demo": "phases.p2_3_continuous_batching.demo",
    "wall": "phases.p2_3_continuous_batching.demo",
    "alloc_demo": "phases.p3_1_block_allocator.demo",
    "table_demo": "phases.p3_2_block_table.demo",
    "block_size_study": "phases.p3_2_block_table.demo",
    "vm_analogy": "phases.p3_2_block_table.demo",
    "snapshot": "phases.p3_3_paged_cache.demo",
    "grow_demo": "phases.p3_3_paged_cache.demo",
    "gather_bench": "phases.p3_4_gather_kernel.demo",
    "stack_bench": "phases.p3_4_gather_kernel.demo",
    "attn_bench": "phases.p3_5_paged_attention.demo",
    "tput": "phases.p3_6_batched_engine.demo",
    "workload_bench": "phases.p3_6_batched_engine.demo",
    "varlen_bench": "phases.p3_7_varlen_prefill.demo",
    "prefill_bench": "phases.p3_8_chunked_prefill.demo",
    "decode_bench": "phases.p3_9_tuned_decode_kernel.demo",
    "graph_bench": "phases.p3_10_cuda_graphs.demo",
    "graph_workload": "phases.p3_10_cuda_graphs.demo",
    "fused_bench": "phases.p3_11_fused_ops.demo",
    "fused_workload": "phases.p3_11_fused_ops.demo",
    "cow_demo": "phases.p4_1_copy_on_write.demo",
    "share_demo": "phases.p4_2_beam_search.demo",
    "prefix_demo": "phases.p4_3_prefix_caching.demo",
    "preempt_demo": "phases.p4_4_preemption.demo",
    "stress_demo": "phases.p4_4_preemption.demo",
    "rate_sweep": "phases.p4_4_preemption.demo",
    "block_sweep": "phases.p4_4_preemption.demo",
    "share_sweep": "phases.p4_4_preemption.demo",
    "spec_demo": "phases.p4_5_speculative_decoding.demo",
    "tp_demo": "phases.p4_7_tensor_parallel.demo",
    "bench_serve": "phases.p5_6_http_server.demo",
    "serve_workload": "phases.p5_1_served_engine.workload_demo",
    "vllm_cpu_peer": "measure.vllm_cpu",
    "pool_replay": "phases.p5_4_pool_view.demo",
}

REQUIREMENTS = Path(__file__).resolve().parent.parent / "requirements.txt"
# Import names whose PyPI distribution has another name (or comes with another package).
DISTRIBUTION_OF = {"starlette": "fastapi", "pydantic": "fastapi", "yaml": "pyyaml", "PIL": "pillow",
                   "prometheus_client": "prometheus-client", "zmq": "pyzmq"}


@dataclass
class Option:
    """A demo flag. `cpu`/`gpu` are its defaults on each kind of device."""
    name: str
    type: Callable[[str], Any]
    cpu: Any
    gpu: Any = None
    help: str = ""
    many: bool = False  # a list: `--batch-sizes 1 2 4`
    choices: tuple | None = None   # the values it takes, if a fixed set: refused at parsing otherwise
    positional: bool = False       # given bare after the demo's name (`pool_replay cow_demo`), not as a flag

    def refusal(self, value: Any) -> str | None:
        """Why `value` (one, or a list for `many`) is not among the choices; None when it is, or when any goes."""
        if self.choices is None:
            return None
        bad = [v for v in (value if self.many else [value]) if v not in self.choices]
        return f"option '{self.name}' takes {list(self.choices)}, not {bad}" if bad else None

    def default(self, on_gpu: bool) -> Any:
        return self.gpu if (on_gpu and self.gpu is not None) else self.cpu


@dataclass
class RunConfig:
    """What a demo function receives: the model choice and its resolved options."""
    model: str = "smollm2-135m"
    device: str | None = None
    dtype: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    quick: bool = False  # tests: smallest settings that still exercise every code path
    _lm: Any = None

    def __getattr__(self, name: str) -> Any:
        # Options read as attributes: cfg.batch_sizes
        options = self.__dict__.get("options", {})
        if name in options:
            return options[name]
        raise AttributeError(name)

    def use_quick(self, **smallest: Any) -> None:
        """Under `quick`, run with these option values instead (the smallest that still exercise every code
        path); the report's meta then records what really ran. Without `quick`, nothing changes."""
        if self.quick:
            self.options.update(smallest)

    @property
    def on_gpu(self) -> bool:
        from common.model import pick_device
        return pick_device(self.device).startswith("cuda")

    def load(self, **kwargs):
        """Load (once) and return the LoadedModel this run is about."""
        if self._lm is None or kwargs:
            from common.model import load_model
            lm = load_model(self.model, device=self.device, dtype=self.dtype, **kwargs)
            if kwargs:
                return lm
            self._lm = lm
        return self._lm

    def new_report(self, demo_name: str) -> Report:
        from measure.report import environment_meta
        lm = self._lm
        meta = environment_meta(device=lm.device if lm else self.device, model=self.model,
                                dtype=str(lm.dtype).removeprefix("torch.") if lm else self.dtype)
        if lm is not None:
            from common.model import dtype_and_reason
            meta["dtype_reason"] = dtype_and_reason(self.dtype, lm.device)[1]
        meta["options"] = {k: v for k, v in self.options.items()}
        return Report(demo_name, meta=meta)


@dataclass
class Demo:
    name: str
    run: Callable[[RunConfig], Report]
    phase: str
    help: str
    options: list[Option] = field(default_factory=list)
    plot: Callable[[Report, Any], None] | None = None  # (report, png_path) -> None
    needs_model: bool = True
    writes: Callable[[Report, Path], Path] | None = None  # (report, folder) -> one more file it saves there

    def resolve(self, on_gpu: bool, given: dict[str, Any] | None = None) -> dict[str, Any]:
        given = given or {}
        unknown = set(given) - {o.name for o in self.options}
        if unknown:
            raise ValueError(f"demo '{self.name}' has no option(s) {sorted(unknown)}; "
                             f"it takes {[o.name for o in self.options]}")
        for o in self.options:
            if o.name in given and (why := o.refusal(given[o.name])):
                raise ValueError(f"demo '{self.name}': {why}")
        return {o.name: given.get(o.name, o.default(on_gpu)) for o in self.options}


DEMOS: dict[str, Demo] = {}          # name -> the demo the command runs (from DEMO_MODULES' module)
EARLIER: dict[str, list[Demo]] = {}   # name -> earlier versions a later phase took over (still importable)


class UnknownDemo(LookupError):
    """No demo of that name."""


class MissingPackage(RuntimeError):
    """A demo's module needs a Python package that is not installed here."""

    def __init__(self, what: str, package: str):
        self.what, self.package = what, package   # what: "demo 'bench_serve'", "`python -m common serve`", ...
        super().__init__(f"{what} needs the Python package '{package}', which is not installed. "
                         f"Install it with:  {install_command(package)}")


def install_command(package: str) -> str:
    """`pip install <package>==<the version requirements.txt pins>` (unpinned if it pins none)."""
    pinned = package
    if REQUIREMENTS.exists():
        m = re.search(rf"^{re.escape(package)}==(\S+)", REQUIREMENTS.read_text(), re.MULTILINE | re.IGNORECASE)
        if m:
            pinned = f"{package}=={m.group(1)}"
    return f"pip install {pinned}"


def demo(name: str, phase: str, help: str, options: list[Option] | None = None,
         plot: Callable | None = None, needs_model: bool = True, extends: str | None = None,
         writes: Callable | None = None):
    """Register the decorated function `run(cfg) -> Report` as demo `name`.

    The module DEMO_MODULES names for `name` defines the demo the command
    runs. `extends="p3_3"` says a later phase deliberately takes over an
    earlier phase's demo of the same name (`tput` gains the batched engine in
    p3_6); the earlier function stays importable and is kept in EARLIER.
    """
    if name not in DEMO_MODULES:
        raise ValueError(f"demo '{name}' is not in measure.demos.DEMO_MODULES; add the line "
                         f"'\"{name}\": \"<its module>\"' there")

    def register(fn: Callable[[RunConfig], Report]):
        entry = Demo(name, fn, phase, help, options or [], plot, needs_model, writes)
        if fn.__module__ == DEMO_MODULES[name]:
            DEMOS[name] = entry
        else:
            EARLIER.setdefault(name, []).append(entry)
        return fn
    return register


def run_sections(cfg: RunConfig, lm, report: Report, sections: dict[str, Callable]) -> Report:
    """Run the sections `cfg.sections` names, in that order: sections[name](cfg, lm, report) each. An unknown
    name is refused before any section runs."""
    unknown = set(cfg.sections) - set(sections)
    if unknown:
        raise ValueError(f"unknown section(s) {sorted(unknown)}; choose from {sorted(sections)}")
    for name in cfg.sections:
        sections[name](cfg, lm, report)
    return report


def names() -> list[str]:
    """Every demo name, in reading order, without importing any phase."""
    return list(DEMO_MODULES)


def missing_distribution(err: ModuleNotFoundError) -> str | None:
    """The third-party distribution whose absence `err` reports, or None if it is this repo's own module
    (a bug to show in full, not a package to install)."""
    missing = (err.name or "").split(".")[0]
    if not missing or missing in {"common", "measure", "phases"}:
        return None
    return DISTRIBUTION_OF.get(missing, missing)


def get(name: str) -> Demo:
    """The demo `name`, importing only the module that defines it.

    Raises UnknownDemo for a name not in the table, MissingPackage when its
    module needs a package that is not installed."""
    if name not in DEMO_MODULES:
        raise UnknownDemo(f"unknown demo '{name}'. Demos: {', '.join(sorted(DEMO_MODULES))}")
    module = DEMO_MODULES[name]
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        package = missing_distribution(e)
        if package is None:
            raise
        raise MissingPackage(f"demo '{name}'", package) from e
    if name not in DEMOS:
        raise RuntimeError(f"{module} was imported but defines no demo '{name}' (measure.demos.DEMO_MODULES "
                           "names it as the module that does)")
    return DEMOS[name]


def load_all() -> tuple[dict[str, Demo], dict[str, MissingPackage]]:
    """Import every demo module: (the demos that load here, {name: why} for those that need a missing package)."""
    loaded, missing = {}, {}
    for name in DEMO_MODULES:
        try:
            loaded[name] = get(name)
        except MissingPackage as e:
            missing[name] = e
    return loaded, missing
