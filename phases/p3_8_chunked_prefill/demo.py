"""`prefill_bench`: prefill before and after this phase, and what chunked prefill does to streams already running.

Four sections (`--sections`), each its own table; the harness is measure/prefill_bench.py, this file hands
it phase 3.6's and this phase's attention and engines:

attention  one layer's attention over a packed prefill, the model's head shapes, median ms -> tok/s:
           phase 3.6's per-segment loop, this phase's one varlen call, and no paging at all
           (`attention_pack`)
engine     the whole model's prefill pass of the same packs through phase 3.6's `BatchedPagedEngine`
           and this phase's `ChunkedPrefillEngine`: prompt tokens computed per second, with and without
           a held prefix (`PREFILL_ENGINES`, `HeldPrefix`)
latency    `n_streams` sequences are decoding when a `long_prompt`-token prompt arrives: the streams'
           inter-token latency (ITL) from then on, p50 / p99 / max, and the long prompt's TTFT, with
           and without chunks (`latency_engines`; measure/stream_latency.py)
workload   workload_bench's equal and mixed work (measure/workload.py) through `batched` (3.6) and
           `chunked` (3.8), same requests, one run: is any engine slower than before?

Packs are written NxL (N segments of L tokens) or NxA-B (N segments of A..B tokens, seeded).
The GPU defaults: 1 x 4096, 16 x 256, 256 x 16-128, prefixes of 0 and 1024 tokens; a CPU run
takes fewer tokens through the whole model, in fp32 (CPU_DEFAULT_DTYPE).
"""

from __future__ import annotations

from measure.demos import RunConfig, demo
from measure.harness import EngineRun, EngineRunner, pool_problems, submit, workload_pool_blocks
from measure.prefill_bench import (AttentionPack, Contender, pack_lengths, plot_prefill,  # noqa: F401 (tests)
                                  prefill_options, run_prefill_bench)
from measure.report import Report
from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE
from phases.p3_4_gather_kernel.dispatch import use_kernels
from phases.p3_6_batched_engine.demo import BATCHED
from phases.p3_6_batched_engine.engine import BatchedPagedEngine
from phases.p3_6_batched_engine.kv import BlockKV
from phases.p3_7_varlen_prefill.demo import loop_attention, packed_layer
from phases.p3_7_varlen_prefill.plan import plan_prefill
from phases.p3_8_chunked_prefill.attention import MixedBatch, varlen_attention_forward
from phases.p3_8_chunked_prefill.engine import DEFAULT_MAX_NUM_BATCHED_TOKENS, ChunkedPrefillEngine, WholePromptEngine


# --- attention: phase 3.6's per-segment loop and this phase's varlen call, on one pack -----------------
def attention_pack(lm, seg_lens: list[int], prefix: int, block_size: int) -> AttentionPack:
    """Phase 3.7's pack (`packed_layer`: what one layer of the model hands each attention function), with this
    phase's attention function in place of the bare kernel call.

    loop     phase 3.6's attention: one SDPA call per segment; after a held prefix, a gather of the whole
             context and a masked SDPA (`paged_attention_forward`)
    varlen   this phase's: ONE call for the pack (`varlen_attention_forward`): on a GPU the Triton kernel
             reads K/V in place from the pool, on a CPU the PyTorch path
    bound    (the harness's) no paging at all: the same K/V already contiguous. On CUDA torch's flash varlen
             (`torch.nn.attention.varlen.varlen_attn`, one call for the pack; bf16/fp16 only), elsewhere
             SDPA per segment (causal kernel when fresh, a mask after a prefix)

    Loop and varlen include writing the pack's new K/V into the pool, as in the engine."""
    layer = packed_layer(lm, seg_lens, prefix, block_size)
    p = layer.pack
    varlen_batch = MixedBatch(**layer.paged, n_decode=0, cu_seqlens_q=p.cu_seqlens_q, context_lens=p.context_lens,
                              prefill_plan=plan_prefill(layer.cu, layer.context, device=lm.device))
    varlen = ("the Triton kernel" if use_kernels(lm.device)
              else "the CPU path: SDPA per segment over one copy of the blocks read")
    return AttentionPack(
        loop=loop_attention(layer),
        varlen=lambda: varlen_attention_forward(layer.module, layer.query, layer.key, layer.value,
                                                scaling=layer.scale, paged=varlen_batch)[0],
        q=p.q, k=p.k, v=p.v, scale=layer.scale,
        about="loop: phase 3.6's paged_attention_forward (SDPA per segment; after a prefix, gather + masked SDPA "
              "per segment). varlen: this phase's varlen_attention_forward, one call for the pack "
              f"({varlen}).")


# --- engine: the whole prefill pass, a held prefix on both engines ---------------------------------------
class HeldPrefix(BlockKV):
    """Phase 3.6's KV part, holding the full blocks of one computed prefix as well: a new prompt that starts
    with it maps them in (one more reference each), so its prefill starts past them (at `n_filled`). The
    bench's "with prefix" rows measure prefill after a prefix this way."""
    held_ids: list[int] = []
    held_blocks: list[int] = []

    def hold(self, seq) -> None:
        """Keep `seq`'s full prompt blocks (its prefill has run) after it is gone."""
        n = len(seq.prompt_ids) // self.block_size
        self.held_blocks = list(seq.kv.block_ids[:n])
        self.held_ids = seq.prompt_ids[:n * self.block_size]
        for block in self.held_blocks:
            self.allocator.incref(block)

    def drop(self) -> None:
        for block in self.held_blocks:
            self.allocator.free(block)
        self.held_blocks, self.held_ids = [], []

    def new(self, seq):
        table = super().new(seq)
        n = len(self.held_ids)
        if n and len(seq.prompt_ids) > n and seq.prompt_ids[:n] == self.held_ids:
            for block in self.held_blocks:
                self.allocator.incref(block)
            table.block_ids += self.held_blocks
            table.n_filled = n
        return table


def with_held_prefix(engine):
    """`engine` with the `HeldPrefix` KV part."""
    engine.kv = HeldPrefix(engine.allocator)
    return engine


# Each engine prefills the pack in one pass. "with prefix": every prompt starts with the same prefix, mapped in
# from blocks the engine holds (`HeldPrefix`), so only the rest is computed.
PREFILL_ENGINES = [
    Contender("p3_6", "BatchedPagedEngine (attention per segment per layer)",
              lambda lm, budget, **pool: with_held_prefix(BatchedPagedEngine(lm, max_prefill_tokens=budget, **pool))),
    Contender("p3_8", "ChunkedPrefillEngine with a budget that takes the whole pack in one pass (varlen "
              "attention, one call per layer)",
              lambda lm, budget, **pool: with_held_prefix(ChunkedPrefillEngine(lm, max_num_batched_tokens=budget,
                                                                                **pool))),
]


# --- latency: a long prompt next to running streams -------------------------------------------------------
def latency_engines(cfg: RunConfig) -> dict:
    """Phase 3.6 (the prompt in one prefill pass, then the decode pass), then this phase's step with whole
    prompts (`WholePromptEngine`: one pass, prompt and decode tokens together), then with chunks of `cfg.budget`
    tokens (`max_num_batched_tokens`)."""
    return {
        "p3_6 (whole prompt, its own prefill pass)":
            lambda lm, **pool: BatchedPagedEngine(lm, max_prefill_tokens=cfg.long_prompt, **pool),
        "p3_8, whole prompts (WholePromptEngine)":
            lambda lm, **pool: WholePromptEngine(lm, max_num_batched_tokens=cfg.budget, **pool),
        f"p3_8, chunks (max_num_batched_tokens={cfg.budget})":
            lambda lm, **pool: ChunkedPrefillEngine(lm, max_num_batched_tokens=cfg.budget, **pool),
    }


# --- workload: this phase's engine as measure/harness.py runs engines ---------------------------------------
def run_chunked(lm, requests, max_running: int, block_size: int = DEFAULT_BLOCK_SIZE,
                max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS) -> EngineRun:
    n_blocks = workload_pool_blocks(lm, requests, block_size)
    engine = ChunkedPrefillEngine(lm, max_running=max_running, block_size=block_size, n_blocks=n_blocks,
                                  max_num_batched_tokens=max_num_batched_tokens)
    submit(engine, lm, requests)
    finished = engine.run()
    assert not pool_problems(engine.allocator), "blocks leaked"
    settings = dict(max_running=max_running, block_size=block_size, pool_blocks=n_blocks,
                    max_num_batched_tokens=max_num_batched_tokens,
                    attention="Triton kernels" if use_kernels(lm.device) else "PyTorch paths (no GPU)")
    return EngineRun.from_sequences(finished, engine.peak_blocks_used * engine.allocator.bytes_per_block,
                                    note=f"{engine.n_forward_passes} forward passes in {engine.n_steps} steps, "
                                         f"{engine.n_mixed_passes} mixed", settings=settings)


CHUNKED = EngineRunner("chunked", "ChunkedPrefillEngine (p3_8): one mixed pass per step, varlen prefill attention, "
                       "chunked prefill", run_chunked)


@demo("prefill_bench", phase="p3_8", plot=plot_prefill, options=prefill_options(DEFAULT_BLOCK_SIZE),
      help="prefill tok/s per packed batch: 3.6's per-segment loop vs the varlen kernel vs contiguous SDPA/flash; "
           "streams' ITL while a long prompt arrives, with and without chunked prefill")
def prefill_bench(cfg: RunConfig) -> Report:
    return run_prefill_bench(cfg, attention=attention_pack, prefill_engines=PREFILL_ENGINES,
                             latency_engines=latency_engines, runners=[BATCHED, CHUNKED])
