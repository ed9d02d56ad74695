"""Phase 3.8 on the tier's device: the chunked-prefill engine equals HF `generate`, and both paged engines honour
sliding windows and softcaps, with the compiled kernels.

fp32, TF32 off (`no_tf32`). On CUDA the engine runs the compiled Triton kernels: the
K/V store, phase 3.5's paged decode kernel on the decode rows of each pass and the
varlen prefill kernel on its chunks. Cases:

- `tiny` and `dummy:qwen3-0.6b` (28 layers, GQA 16:8, head_dim 128): prompts packed
  whole, and cut into chunks that split 4-token blocks and end mid-block while other
  sequences decode in the same pass; on CUDA also a long prompt arriving next to
  running streams, prefilled 64 tokens at a time;
- `tiny-sliding` (Mistral, a 7-token window on every layer) and `tiny-softcap`
  (Gemma 2: softcap, a windowed layer and a full one), past the window, in phase
  3.6's engine and this one;
- phase 3.5's decode kernel with a window and a softcap, compiled, against its reference
  (tests/gpu/test_kernels_gpu.py covers it without them).
"""

from __future__ import annotations

import pytest
import torch

from phases.p2_2_scheduler.sequence import Status
from measure.paged_inputs import random_paged_batch
from phases.p3_6_batched_engine.engine import BatchedPagedEngine
from phases.p3_5_paged_attention.reference import paged_decode_attention_reference
from phases.p3_8_chunked_prefill.engine import DEFAULT_MAX_NUM_BATCHED_TOKENS, ChunkedPrefillEngine
from tests.gpu.conftest import tier_runs_on_cuda
from tests.oracles import hf_greedy, run_ignoring_eos

pytestmark = pytest.mark.gpu

BLOCK_SIZE = 4
PROMPT_LENGTHS = (1, 6, 11, 19)
NEW_TOKENS = 4
MAX_RUNNING = 2
POOL_BLOCKS = 128
BUDGETS = [DEFAULT_MAX_NUM_BATCHED_TOKENS, 7]     # whole prompts packed; chunks of <= 7 tokens next to decodes
LONG_PROMPT = 300          # CUDA only: minutes per pass of Qwen3's shapes on a CPU
LONG_BUDGET = 64
WINDOW_MODELS = ["tiny-sliding", "tiny-softcap"]
WINDOW_NEW_TOKENS = 8
ON_CUDA = tier_runs_on_cuda()
TOKEN_RANGE = (100, 40_000)
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def random_prompts(lengths, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(*TOKEN_RANGE, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("budget", BUDGETS)
def test_chunked_prefill_engine_equals_hf_generate(tier_lm, no_tf32, budget):
    prompts = random_prompts(PROMPT_LENGTHS)
    engine = ChunkedPrefillEngine(tier_lm, max_running=MAX_RUNNING, block_size=BLOCK_SIZE, n_blocks=POOL_BLOCKS,
                                  max_num_batched_tokens=budget)
    assert run_ignoring_eos(engine, prompts, NEW_TOKENS) == [hf_greedy(tier_lm, p, NEW_TOKENS, ignore_eos=True)
                                                             for p in prompts]
    assert engine.n_forward_passes == engine.n_steps
    if budget < max(PROMPT_LENGTHS):
        assert engine.n_chunks > len(prompts) and engine.n_mixed_passes > 0


def test_a_long_prompt_arriving_mid_stream_is_chunked_next_to_running_streams(tier_lm, no_tf32):
    if not ON_CUDA:
        pytest.skip("a 300-token prompt through Qwen3-0.6B's shapes: minutes on a CPU")
    streams = random_prompts((5, 9), seed=1)
    long_prompt = random_prompts([LONG_PROMPT], seed=2)[0]
    engine = ChunkedPrefillEngine(tier_lm, max_running=3, block_size=16, n_blocks=POOL_BLOCKS,
                                  max_num_batched_tokens=LONG_BUDGET)
    seqs = [engine.add(p, 12, ignore_eos=True) for p in streams]
    engine.step()
    seqs.append(engine.add(long_prompt, NEW_TOKENS, ignore_eos=True))
    while seqs[-1].status in (Status.WAITING, Status.PREFILLING):
        decoding = {s for s in seqs[:2] if s.status is Status.DECODING}
        outputs = engine.step()
        assert {o.seq for o in outputs} >= decoding        # running streams get a token every step
    engine.run()
    assert engine.n_chunks >= LONG_PROMPT // LONG_BUDGET
    for seq, prompt, n in zip(seqs, streams + [long_prompt], (12, 12, NEW_TOKENS)):
        assert seq.output_ids == hf_greedy(tier_lm, prompt, n, ignore_eos=True)


@pytest.fixture(scope="module")
def window_models(gpu_device):
    from common.model import load_model
    return {name: load_model(name, device=gpu_device, dtype=torch.float32) for name in WINDOW_MODELS}


@pytest.mark.parametrize("engine_cls, budget", [(BatchedPagedEngine, None), (ChunkedPrefillEngine, 5),
                                                (ChunkedPrefillEngine, DEFAULT_MAX_NUM_BATCHED_TOKENS)])
@pytest.mark.parametrize("name", WINDOW_MODELS)
def test_window_and_softcap_models_equal_hf_generate(window_models, no_tf32, name, engine_cls, budget):
    from common.model import TINY_WINDOW
    lm = window_models[name]
    prompts = random_prompts((3, TINY_WINDOW + 2, 14, 23), seed=3)
    kwargs = {} if budget is None else dict(max_num_batched_tokens=budget)
    engine = engine_cls(lm, max_running=MAX_RUNNING, block_size=BLOCK_SIZE, n_blocks=POOL_BLOCKS, **kwargs)
    assert run_ignoring_eos(engine, prompts, WINDOW_NEW_TOKENS) == [
        hf_greedy(lm, p, WINDOW_NEW_TOKENS, ignore_eos=True) for p in prompts]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, softcap", [(5, None), (None, 2.0), (37, 50.0)])
def test_decode_kernel_window_and_softcap_compiled(gpu_device, no_tf32, dtype, window, softcap):
    from extras.p3_5_paged_attention.split_kv import paged_decode_attention_split
    from phases.p3_5_paged_attention.kernels import paged_decode_attention_triton
    lens = [1, 7, 17, 70] + ([300, 1000] if ON_CUDA else [])
    batch = random_paged_batch(lens, 16, 2, 64, dtype=dtype, device=gpu_device, seed=5)
    q = (4 * torch.randn(len(lens), 8, 64, generator=torch.Generator().manual_seed(6))).to(gpu_device, dtype)
    args = (q, batch.kv_store, 1, batch.block_tables, batch.seq_lens)
    kw = dict(sliding_window=window, softcap=softcap)
    exact = paged_decode_attention_reference(q.float(), batch.kv_store.float(), *args[2:], **kw)
    for out in (paged_decode_attention_triton(*args, **kw),
                paged_decode_attention_split(*args, blocks_per_split=2, **kw)):
        torch.testing.assert_close(out.float(), exact, **TOL[dtype])
