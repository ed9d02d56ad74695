"""`varlen_bench`: one layer's prefill attention over a packed batch, phase 3.6's loop beside this phase's one call.

Each pack (N segments of L tokens, written NxL, or of A..B tokens, NxA-B), after `prefix` tokens of each
sequence already in the pool, is attended three ways, with the model's head shapes:

loop    phase 3.6's `paged_attention_forward`: one SDPA call per segment (after a prefix, a gather of the
        whole context and a masked SDPA per segment)
varlen  this phase's `paged_prefill_attention`: ONE call for the pack, the Triton kernel on a GPU and the
        CPU path elsewhere (`varlen_pack`)
bound   no paging at all: the same K/V already contiguous (measure/prefill_attention.py's `contiguous_bound`)

Both paged ways include writing the pack's new K/V into the pool (phase 3.5's store), as an engine does. The
table is measure/prefill_attention.py's; the GPU defaults are 1 x 4096, 16 x 256 and 256 x 16-128 tokens with
prefixes of 0 and 1024, and a CPU run takes fewer tokens, in fp32 (a bf16 matmul has no hardware path there).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from types import SimpleNamespace

import torch

from measure.demos import Option, RunConfig, demo
from measure.prefill_attention import AttentionPack, attention_table, pack_lengths
from measure.prefill_bench import CPU_DEFAULT_DTYPE
from measure.report import Report
from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE
from phases.p3_4_gather_kernel.dispatch import use_kernels
from phases.p3_5_paged_attention.ops import write_kv
from phases.p3_6_batched_engine.attention import PagedBatch, Segment, paged_attention_forward
from phases.p3_7_varlen_prefill.ops import paged_prefill_attention
from measure.paged_inputs import PrefillPack, random_prefill_pack
from phases.p3_7_varlen_prefill.plan import plan_prefill

LAYER = 1                 # the layer the table attends in (of a 2-layer pool)
QUICK = dict(packs=["1x24", "3x4-12"], prefix=[0, 8], block_size=4, warmup=1, iters=1)


@dataclass
class PackedLayer:
    """One packed prefill in a scattered pool, as one layer of the model hands it to an attention function."""
    pack: PrefillPack
    query: torch.Tensor       # [1, H, N, D]
    key: torch.Tensor         # [1, H_kv, N, D] the new tokens' keys
    value: torch.Tensor       # [1, H_kv, N, D]
    module: SimpleNamespace   # what the attention function reads of the layer (index, GQA group, causal)
    scale: float
    cu: list[int]             # [S + 1] where each segment starts in the packed row
    context: list[int]        # [S] tokens of each sequence in the pool before its segment
    paged: dict               # phase 3.6's PagedBatch fields for this pack: pool, slots, tables, lengths, segments


def packed_layer(lm, seg_lens: list[int], prefix: int, block_size: int) -> PackedLayer:
    """A packed prefill of `seg_lens` new tokens, each segment after `prefix` tokens already in the pool."""
    group = lm.n_heads // lm.n_kv_heads
    context = [prefix] * len(seg_lens)
    p = random_prefill_pack(seg_lens, context, block_size, lm.n_kv_heads, group, lm.head_dim, dtype=lm.dtype,
                            device=lm.device, layer_idx=LAYER, fill=0.0, seed=len(seg_lens) + prefix)
    cu = list(accumulate(seg_lens, initial=0))
    tables = p.block_tables.tolist()                                   # [S][max_blocks] block ids
    slots = [tables[s][pos // block_size] * block_size + pos % block_size    # [N] pool slot of each new token
             for s, (n, c) in enumerate(zip(seg_lens, context)) for pos in range(c, c + n)]
    paged = dict(kv_store=p.kv_store, block_tables=p.block_tables, is_decode=False,
                 slot_mapping=torch.tensor(slots, device=lm.device),
                 seq_lens=torch.tensor([c + n for c, n in zip(context, seg_lens)], dtype=torch.int32,
                                       device=lm.device),
                 segments=[Segment(start, n, c, s) for s, (start, n, c) in enumerate(zip(cu, seg_lens, context))])
    return PackedLayer(p, query=p.q.transpose(0, 1)[None], key=p.new_k.transpose(0, 1)[None],
                       value=p.new_v.transpose(0, 1)[None],
                       module=SimpleNamespace(layer_idx=LAYER, config=SimpleNamespace(), num_key_value_groups=group,
                                              is_causal=True),
                       scale=lm.head_dim ** -0.5, cu=cu, context=context, paged=paged)


def loop_attention(layer: PackedLayer):
    """Phase 3.6's attention over the pack: one call that loops over the segments -> [1, N, H, D]."""
    batch = PagedBatch(**layer.paged)
    return lambda: paged_attention_forward(layer.module, layer.query, layer.key, layer.value, scaling=layer.scale,
                                           paged=batch)[0]


def varlen_pack(lm, seg_lens: list[int], prefix: int, block_size: int) -> AttentionPack:
    """The table's builder: phase 3.6's loop and this phase's one call on the same pack."""
    layer = packed_layer(lm, seg_lens, prefix, block_size)
    p = layer.pack
    plan = plan_prefill(layer.cu, layer.context, device=lm.device)    # once per pass, shared by every layer

    def varlen():   # the pack's K/V into the pool, then one attention call -> [1, N, H, D]
        write_kv(p.kv_store, LAYER, p.new_k, p.new_v, layer.paged["slot_mapping"])
        return paged_prefill_attention(*p.args(), scale=layer.scale, plan=plan)[None]

    how = "the Triton kernel" if use_kernels(lm.device) else "the CPU path: SDPA per segment over one copy of the " \
                                                             "blocks read"
    return AttentionPack(loop=loop_attention(layer), varlen=varlen, q=p.q, k=p.k, v=p.v, scale=layer.scale,
                         about=f"loop: phase 3.6's paged_attention_forward (SDPA per segment; after a prefix, gather "
                               f"+ masked SDPA per segment). varlen: this phase's paged_prefill_attention, one call "
                               f"for the pack ({how}).")


@demo("varlen_bench", phase="p3_7",
      help="one layer's prefill attention over packed prompts: phase 3.6's loop vs one varlen call vs no paging",
      options=[Option("packs", str, cpu=["1x1024", "8x128", "32x16-128"], gpu=["1x4096", "16x256", "256x16-128"],
                      many=True, help="packed prefills: NxL or NxA-B segments"),
               Option("prefix", int, cpu=[0, 256], gpu=[0, 1024], many=True,
                      help="tokens cached before each segment (0: fresh prompts)"),
               Option("block_size", int, cpu=DEFAULT_BLOCK_SIZE, help="tokens per KV block"),
               Option("warmup", int, cpu=2, gpu=5, help="untimed calls before timing"),
               Option("iters", int, cpu=5, gpu=20, help="timed calls (median reported)")])
def varlen_bench(cfg: RunConfig) -> Report:
    cfg.use_quick(**QUICK)
    for spec in cfg.packs:
        pack_lengths(spec)                 # a bad pack fails now, not after minutes of timing
    if cfg.dtype is None and not cfg.on_gpu:
        cfg.dtype = CPU_DEFAULT_DTYPE
    lm = cfg.load()
    report = cfg.new_report("varlen_bench")
    report.data["attention"] = attention_table(report, lm, varlen_pack, cfg.packs, cfg.prefix, cfg.block_size,
                                               cfg.warmup, cfg.iters)
    return report
