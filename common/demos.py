"""The demo registry: one place that knows every demo, its options and defaults.

A phase registers a demo with the `@demo(...)` decorator in its own `demo.py`.
`python -m common <name>` (common/__main__.py) and `modal run
modal_run.py::<name>` (modal_run.py) both look demos up here, so a demo runs
the same code on a laptop CPU and on a Modal GPU; only the defaults differ
(`Option.cpu` vs `Option.gpu`), because a CPU minute buys far fewer tokens.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from common.report import Report

# Every module that registers demos, in reading order. A new phase adds its line here.
DEMO_MODULES = [
    "phases.p1_kv_cache.demo",
    "phases.p2_1_naive_batching.demo",
    "phases.p2_3_continuous_batching.demo",
    "phases.p3_1_block_allocator.demo",
    "phases.p3_2_block_table.demo",
    "phases.p3_3_paged_cache.demo",
    "phases.p3_4_gather_kernel.demo",
    "phases.p3_5_paged_attention.kernel_demo",
    "phases.p3_5_paged_attention.demo",
    "phases.p4_1_copy_on_write.demo",
    "phases.p4_2_beam_search.demo",
    "phases.p5_serving.demo",
    "phases.p4_3_prefix_caching.demo",
    "phases.p4_4_preemption.demo",
]


@dataclass
class Option:
    """A demo flag. `cpu`/`gpu` are its defaults on each kind of device."""
    name: str
    type: Callable[[str], Any]
    cpu: Any
    gpu: Any = None
    help: str = ""
    many: bool = False  # a list: `--batch-sizes 1 2 4`

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
        from common.report import environment_meta
        lm = self._lm
        meta = environment_meta(device=lm.device if lm else self.device, model=self.model,
                                dtype=str(lm.dtype).removeprefix("torch.") if lm else self.dtype)
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

    def resolve(self, on_gpu: bool, given: dict[str, Any] | None = None) -> dict[str, Any]:
        given = given or {}
        unknown = set(given) - {o.name for o in self.options}
        if unknown:
            raise ValueError(f"demo '{self.name}' has no option(s) {sorted(unknown)}; "
                             f"it takes {[o.name for o in self.options]}")
        return {o.name: given.get(o.name, o.default(on_gpu)) for o in self.options}


DEMOS: dict[str, Demo] = {}


def demo(name: str, phase: str, help: str, options: list[Option] | None = None,
         plot: Callable | None = None, needs_model: bool = True, extends: str | None = None):
    """Register the decorated function `run(cfg) -> Report` as demo `name`.

    `extends="p3_3"`: a later phase deliberately takes over an earlier phase's
    demo of the same name (e.g. `tput` gains the batched engine in p3_5). The
    earlier function stays importable; the command runs the latest one.
    """
    def register(fn: Callable[[RunConfig], Report]):
        earlier = DEMOS.get(name)
        if earlier and earlier.run.__module__ != fn.__module__ and earlier.phase != extends:
            raise ValueError(f"demo '{name}' registered twice (by {earlier.phase} and {phase}); "
                             f"pass extends='{earlier.phase}' if {phase} means to take it over")
        DEMOS[name] = Demo(name, fn, phase, help, options or [], plot, needs_model)
        return fn
    return register


def load_all() -> dict[str, Demo]:
    """Import every demo module (registering its demos) and return the registry."""
    for mod in DEMO_MODULES:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            # A phase not written yet is skipped; a broken import inside one is not.
            if e.name and mod.startswith(e.name):
                continue
            raise
    return DEMOS


def get(name: str) -> Demo:
    demos = load_all()
    if name not in demos:
        raise SystemExit(f"unknown demo '{name}'. Demos: {', '.join(sorted(demos))}")
    return demos[name]
