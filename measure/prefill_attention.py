"""One layer's attention over a packed prefill: two paged ways a phase hands in, against no paging at all.

A packed prefill is S segments (prompts, or chunks of them) of new tokens, each after `prefix`
tokens already cached, written `NxL` (N segments of L tokens) or `NxA-B` (N segments of A..B
tokens, seeded): `pack_lengths`. A phase's builder, `build(lm, seg_lens, prefix, block_size)`,
returns an `AttentionPack`: the two attention calls to compare (`loop`, `varlen`: each writes the
pack's K/V into the pool and attends, as in the engine) and the same K/V laid out contiguously,
for `contiguous_bound`, what the attention costs with no pool. measure/ imports no phase.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable

import torch

from measure.kernel_bench import median_ms
from measure.progress import progress_bar
from measure.report import Report

PACK_SEED = 0


def pack_lengths(spec: str, seed: int = PACK_SEED) -> list[int]:
    """'16x256' -> 16 segments of 256 tokens; '256x16-128' -> 256 segments of 16..128 tokens (seeded)."""
    try:
        count, length = spec.lower().split("x")
        lo, _, hi = length.partition("-")
        count, lo, hi = int(count), int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"a pack is NxL or NxA-B (e.g. 16x256, 256x16-128), got {spec!r}") from None
    if count < 1 or not 1 <= lo <= hi:
        raise ValueError(f"pack {spec!r}: need N >= 1 and 1 <= A <= B")
    rng = random.Random(f"{seed}:{spec}")
    return [rng.randint(lo, hi) for _ in range(count)]


@dataclass
class AttentionPack:
    """One packed prefill of S segments, N new tokens, from a phase's builder."""
    loop: Callable[[], torch.Tensor]     # one layer's attention the old way, K/V write included -> [1, N, H, D]
    varlen: Callable[[], torch.Tensor]   # the same, the new way
    q: torch.Tensor                      # [N, H, D] the packed queries
    k: torch.Tensor                      # [S, H_kv, max_total, D] each sequence's keys, contiguous
    v: torch.Tensor                      # [S, H_kv, max_total, D]
    scale: float
    about: str                           # one line for the notes: what `loop` and `varlen` run here


def contiguous_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg_lens: list[int], context: list[int],
                     scale: float) -> tuple[Callable[[], object], str]:
    """The attention with no paging, on K/V already contiguous: q [N, H, D]; k, v [S, H_kv, max_total, D].
    Returns (fn, name): torch's flash varlen on CUDA where it runs (one call), else SDPA per segment."""
    totals = [c + n for c, n in zip(context, seg_lens)]
    cu_q, cu_k = list(accumulate(seg_lens, initial=0)), list(accumulate(totals, initial=0))
    gqa = q.shape[1] != k.shape[1]
    fallback = ""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        try:
            from torch.nn.attention.varlen import varlen_attn
            kp = torch.cat([k[s, :, :t].transpose(0, 1) for s, t in enumerate(totals)])   # [sum totals, H_kv, D]
            vp = torch.cat([v[s, :, :t].transpose(0, 1) for s, t in enumerate(totals)])
            cu_q_t = torch.tensor(cu_q, dtype=torch.int32, device=q.device)
            cu_k_t = torch.tensor(cu_k, dtype=torch.int32, device=q.device)

            def flash():   # causal aligned bottom-right: query i of a segment sits at context + i
                return varlen_attn(q, kp, vp, cu_q_t, cu_k_t, max(seg_lens), max(totals), scale=scale,
                                   window_size=(-1, 0), enable_gqa=gqa)
            flash()
            return flash, "torch flash varlen (one call)"
        except Exception as e:   # no flash build for this GPU / dtype: SDPA below, and the note says why
            fallback = f" (torch varlen_attn failed here: {type(e).__name__})"
    heads = q.transpose(0, 1)[None]                                    # [1, H, N, D]
    # A fresh segment takes SDPA's causal kernel; after a prefix, query i sits at c + i and sees keys
    # 0 .. c + i: an explicit [n, c + n] mask, the lower triangle shifted right by c.
    masks = [None if c == 0 else torch.ones(n, c + n, dtype=torch.bool, device=q.device).tril(c)
             for n, c in zip(seg_lens, context)]

    def sdpa():   # -> one [1, H, n, D] per segment
        return [torch.nn.functional.scaled_dot_product_attention(
                    heads[:, :, start:start + n], k[s:s + 1, :, :t], v[s:s + 1, :, :t], attn_mask=mask,
                    is_causal=mask is None, scale=scale, enable_gqa=gqa)
                for s, (start, n, t, mask) in enumerate(zip(cu_q, seg_lens, totals, masks))]
    return sdpa, "SDPA per segment" + fallback


def measure_attention(lm, build: Callable[..., AttentionPack], spec: str, prefix: int, block_size: int,
                      warmup: int, iters: int) -> tuple[dict, str]:
    """One pack: median ms of the loop, varlen and the bound, for one layer with the model's head shapes;
    and the pack's `about` line."""
    seg_lens = pack_lengths(spec)
    p = build(lm, seg_lens, prefix, block_size)
    bound, bound_name = contiguous_bound(p.q, p.k, p.v, seg_lens, [prefix] * len(seg_lens), p.scale)
    max_err = float((p.loop().float() - p.varlen().float()).abs().max())
    ms = {name: median_ms(fn, lm.device, warmup, iters)
          for name, fn in (("loop", p.loop), ("varlen", p.varlen), ("bound", bound))}
    n = sum(seg_lens)
    return dict(pack=spec, n_segments=len(seg_lens), n_tokens=n, prefix=prefix, ms=ms, bound=bound_name,
                tok_s={k: n / (v / 1e3) for k, v in ms.items()}, max_err=max_err), p.about


def attention_table(report: Report, lm, build: Callable[..., AttentionPack], packs: list[str], prefixes: list[int],
                    block_size: int, warmup: int, iters: int) -> list[dict]:
    """Every (pack, prefix) through `measure_attention`: one table row each; returns the rows."""
    t = report.table(f"One layer's prefill attention ({lm.n_heads} query / {lm.n_kv_heads} KV heads, head_dim "
                     f"{lm.head_dim}, block_size {block_size}, {str(lm.dtype).removeprefix('torch.')})",
                     ["pack", "prefix", "new tokens", "loop ms", "varlen ms", "bound ms", "varlen tok/s",
                      "varlen / loop", "varlen / bound", "max |loop - varlen|"])
    rows = []
    cases = [(spec, prefix) for spec in packs for prefix in prefixes]
    with progress_bar(f"{report.demo}: attention", total=len(cases)) as bar:
        for spec, prefix in cases:
            r, about = measure_attention(lm, build, spec, prefix, block_size, warmup, iters)
            rows.append(r)
            tok = r["tok_s"]
            t.add_row(spec, prefix, r["n_tokens"], r["ms"]["loop"], r["ms"]["varlen"], r["ms"]["bound"],
                      tok["varlen"], f"{tok['varlen'] / tok['loop']:.2f}x", f"{tok['varlen'] / tok['bound']:.0%}",
                      f"{r['max_err']:.1e}")
            bar.advance()
    t.notes += [
        f"Median ms of one call. {about} Both include the K/V write into the pool.",
        f"bound: {', '.join(sorted({r['bound'] for r in rows}))} on the same K/V stored contiguously (no pool, no "
        "write): what attention costs without paging. varlen / bound is the share of that throughput the paged "
        "path reaches.",
        "prefix: tokens of each sequence already in the pool before its new tokens (a prefix-cache hit, an "
        "earlier chunk, a recomputed sequence).",
    ]
    return rows
