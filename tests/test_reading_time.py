"""Every phase reads in `MAX_MINUTES` or less from its own folder (scripts/reading_time.py), and the README's
reading-time table is the one the script prints."""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("reading_time", ROOT / "scripts" / "reading_time.py")
reading_time = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reading_time)


def rows() -> list[dict]:
    return [reading_time.measure(d) for d in reading_time.phase_dirs()]


def test_no_phase_takes_longer_than_the_limit_to_read():
    over = {r["phase"]: round(r["minutes"]) for r in rows() if r["minutes"] > reading_time.MAX_MINUTES}
    assert over == {}


def test_most_phases_read_in_under_the_target():
    measured = rows()
    assert sum(r["minutes"] < reading_time.TARGET_MINUTES for r in measured) > len(measured) / 2


def test_demos_and_only_demos_are_left_out_of_the_count(tmp_path):
    phase = tmp_path / "p9_9_example"
    phase.mkdir()
    (phase / "README.md").write_text("word " * 230)
    (phase / "idea.py").write_text("a = 1\n\n# why\nb = 2\n")      # 3 non-blank lines
    (phase / "demo.py").write_text("print('table')\n" * 100)
    (phase / "load_demo.py").write_text("x = 0\n" * 100)
    row = reading_time.measure(phase)
    assert (row["words"], row["lines"], row["files"]) == (230, 3, 1)
    assert row["minutes"] == 1 + 3 / 20


def test_phases_are_in_reading_order():
    names = [d.name for d in reading_time.phase_dirs()]
    assert names.index("p3_9_tuned_decode_kernel") < names.index("p3_10_cuda_graphs")
    assert names[0] == "p0_generate"


def test_the_readme_table_is_the_scripts():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- reading-time -->\n(.*?)\n<!-- /reading-time -->", readme, re.S)
    assert block, "README.md has no reading-time table between its markers"
    assert block.group(1).strip() == reading_time.table(rows()).strip()
