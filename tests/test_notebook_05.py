"""The phases 3.5-3.6 notebook runs headless."""

import pytest

from tests.nbrun import run_notebook


@pytest.mark.notebook("05_paged_attention.ipynb")
def test_paged_attention_notebook_runs():
    nb = run_notebook("05_paged_attention.ipynb")
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "outputs equal to hf_static: True" in text and "False" not in text
