"""One served step runs code in the number of files docs/architecture.md states (scripts/step_files.py traces
every Python call of the step, not only the methods the page's trace names)."""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("step_files", ROOT / "scripts" / "step_files.py")
step_files = importlib.util.module_from_spec(spec)
spec.loader.exec_module(step_files)


def stated() -> int:
    text = (ROOT / "docs" / "architecture.md").read_text()
    return int(re.search(r"runs code in (\d+) files", text).group(1))


def test_the_page_states_the_files_one_served_step_runs():
    files, _ = step_files.step_files()
    assert len(files) == stated(), sorted(files)


def test_the_step_traced_decodes_and_prefills():
    engine = step_files.mixed_step_engine()
    batch = engine.schedule()
    assert batch.decode and batch.chunks
