"""Phase 3.4: the Triton gather equals the torch reference equals the Python per-block gather.

The kernel runs under Triton's CPU interpreter (kernel.py sets TRITON_INTERPRET=1
when there is no GPU), so shapes stay small.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from phases.p3_3_paged_cache.gather import gather_python
from measure.paged_inputs import random_paged_batch
from phases.p3_4_gather_kernel.dispatch import FORCE_KERNELS_ENV, gather_kv
from phases.p3_4_gather_kernel.kernel import gather_triton
from phases.p3_4_gather_kernel.reference import gather_reference

LAYER = 1
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
REPO_ROOT = Path(__file__).resolve().parent.parent


def run_fresh_without_interpret_env(code: str, timeout_s: int) -> str:
    """Run `code` in a fresh interpreter at the repo root with TRITON_INTERPRET unset (the kernel modules
    must set it themselves); it must succeed. Returns its stdout. Phase 3.5's kernel tests use it too."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout_s,
                         cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.parametrize("block_size", [4, 8, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_equals_reference_equals_python(block_size, dtype):
    lens = [1, block_size - 1, block_size, 2 * block_size + 3, 0]
    batch = random_paged_batch(lens, block_size, n_kv_heads=2, head_dim=8, dtype=dtype, seed=block_size)
    k_ref, v_ref = gather_reference(batch.kv_store, LAYER, batch.block_tables, batch.seq_lens)
    k_tri, v_tri = gather_triton(batch.kv_store, LAYER, batch.block_tables, batch.seq_lens)
    assert k_ref.shape == (len(lens), 2, max(lens), 8) and k_ref.dtype == dtype
    # A gather only copies, so every path must agree bit for bit, in every dtype.
    assert torch.equal(k_tri, k_ref) and torch.equal(v_tri, v_ref)
    for b, n in enumerate(lens):
        k_py, v_py = gather_python(batch.kv_store, batch.block_ids[b], n, LAYER)
        assert k_py.shape == (1, 2, n, 8)
        assert torch.equal(k_ref[b, :, :n], k_py[0]) and torch.equal(v_ref[b, :, :n], v_py[0])
        assert not k_ref[b, :, n:].any() and not v_ref[b, :, n:].any(), "padding must be zeros"


def test_gather_reads_the_right_layer_and_k_v():
    batch = random_paged_batch([5], block_size=4, n_kv_heads=1, head_dim=4, n_layers=3)
    phys = batch.block_ids[0]
    k, v = gather_triton(batch.kv_store, 2, batch.block_tables, batch.seq_lens)
    assert torch.equal(k[0, 0, 4], batch.kv_store[phys[1], 2, 0, 0, 0])  # token 4 = block 1, slot 0
    assert torch.equal(v[0, 0, 0], batch.kv_store[phys[0], 2, 1, 0, 0])


def test_padding_in_tables_is_never_read():
    batch = random_paged_batch([3, 9], block_size=4, n_kv_heads=2, head_dim=4)
    poisoned = batch.block_tables.clone()
    poisoned[0, 1:] = 10_000  # past sequence 0's length: an id far outside the pool
    k_ref, _ = gather_reference(batch.kv_store, LAYER, batch.block_tables, batch.seq_lens)
    k_tri, _ = gather_triton(batch.kv_store, LAYER, poisoned, batch.seq_lens)
    assert torch.equal(k_tri, k_ref)


def test_explicit_max_len_pads_further():
    batch = random_paged_batch([2, 5], block_size=4, n_kv_heads=1, head_dim=4)
    k, v = gather_triton(batch.kv_store, LAYER, batch.block_tables, batch.seq_lens, max_len=8)
    k_ref, _ = gather_reference(batch.kv_store, LAYER, batch.block_tables, batch.seq_lens, max_len=8)
    assert k.shape[2] == 8 and torch.equal(k, k_ref) and not k[:, :, 5:].any()


def test_gather_kv_dispatch(monkeypatch):
    batch = random_paged_batch([6, 2], block_size=4, n_kv_heads=2, head_dim=8)
    ref = gather_reference(batch.kv_store, LAYER, batch.block_tables, batch.seq_lens)
    for force in ("0", "1"):
        monkeypatch.setenv(FORCE_KERNELS_ENV, force)
        k, v = gather_kv(batch.kv_store, LAYER, batch.block_tables, batch.seq_lens)
        assert torch.equal(k, ref[0]) and torch.equal(v, ref[1])


def test_bad_input_gets_a_clear_error():
    batch = random_paged_batch([5, 3], block_size=4, n_kv_heads=2, head_dim=8)
    pool, tables, lens = batch.kv_store, batch.block_tables, batch.seq_lens
    with pytest.raises(ValueError, match="6-d"):
        gather_reference(pool[0], LAYER, tables, lens)
    with pytest.raises(ValueError, match="layer_idx"):
        gather_triton(pool, 7, tables, lens)
    with pytest.raises(ValueError, match="seq_lens must be"):
        gather_reference(pool, LAYER, tables, lens[:1])
    with pytest.raises(ValueError, match="int32 or int64"):
        gather_reference(pool, LAYER, tables.float(), lens)
    with pytest.raises(ValueError, match=r"seq_lens must lie in"):
        gather_triton(pool, LAYER, tables, lens + 100)
    with pytest.raises(ValueError, match="outside the pool"):
        gather_reference(pool, LAYER, tables + 1000, lens)
    odd = random_paged_batch([5], block_size=6, n_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        gather_triton(odd.kv_store, LAYER, odd.block_tables, odd.seq_lens)
    # The reference has no such limit, and still agrees with the Python gather.
    k, _ = gather_reference(odd.kv_store, LAYER, odd.block_tables, odd.seq_lens)
    assert torch.equal(k[0], gather_python(odd.kv_store, odd.block_ids[0], 5, LAYER)[0][0])
    with pytest.raises(ValueError, match="needs? 2 blocks"):
        gather_python(pool, batch.block_ids[0][:1], 5, LAYER)


def test_interpreter_switch_works_in_a_fresh_process():
    """kernel.py sets TRITON_INTERPRET before @triton.jit runs, even when triton was imported first."""
    stdout = run_fresh_without_interpret_env(
        "import triton, torch\n"
        "from measure.paged_inputs import random_paged_batch\n"
        "from phases.p3_4_gather_kernel.kernel import gather_triton\n"
        "b = random_paged_batch([3], 4, 1, 4)\n"
        "k, v = gather_triton(b.kv_store, 0, b.block_tables, b.seq_lens)\n"
        "print('ok', tuple(k.shape))\n", timeout_s=120)
    assert "ok (1, 1, 3, 4)" in stdout


def test_gather_bench_demo_quick(tmp_path):
    from measure.cli import run_demo
    from phases.p3_4_gather_kernel.demo import plot_gather
    report = run_demo("gather_bench", model="tiny", device="cpu", dtype="fp32", quick=True)
    rows = report.tables[0].rows
    assert len(rows) == 4 and rows[0][-1] is True  # the kernel was checked against the reference
    assert all(isinstance(r[3], float) and isinstance(r[4], float) for r in rows)
    assert all(r["kernel_ms"] is None for r in report.data["rows"])  # CPU: no kernel timings
    plot_gather(report, tmp_path / "g.png")
    assert (tmp_path / "g.png").stat().st_size > 0


@pytest.mark.notebook("04_gather_kernel.ipynb")
def test_notebook_runs():
    from tests.nbrun import run_notebook
    nb = run_notebook("04_gather_kernel.ipynb")
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    for line in ("matches the table: True", "kernel == reference (K and V): True",
                 "reference == python per-block gather: True", "padding is zeros: True",
                 "kernel == reference here too: True", "same greedy tokens: True"):
        assert line in text, line
