"""One served step runs code in the number of files docs/architecture.md states (scripts/step_files.py traces
every Python call of the step, not only the methods the page's trace names)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORCE_KERNELS_ENV = "ENGINE_FORCE_TRITON_INTERPRET"   # a test may set it; the count is the plain CPU step's


def stated() -> int:
    text = (ROOT / "docs" / "architecture.md").read_text()
    return int(re.search(r"runs code in (\d+) files", text).group(1))


def traced() -> tuple[int, str]:
    """(files, the script's output) from a fresh interpreter, so no test's imports or settings leak in."""
    env = {k: v for k, v in os.environ.items() if k != FORCE_KERNELS_ENV}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "step_files.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=True)
    return int(re.search(r"^(\d+) files run in one served step", done.stdout, re.M).group(1)), done.stdout


def test_the_page_states_the_files_one_served_step_runs():
    files, listing = traced()
    assert files == stated(), listing


def test_the_step_traced_decodes_and_prefills():
    sys.path.insert(0, str(ROOT / "scripts"))
    import step_files
    batch = step_files.mixed_step_engine().schedule()
    assert batch.decode and batch.chunks
