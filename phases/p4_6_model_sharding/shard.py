"""Cut an unmodified Hugging Face model into one worker's shard, Megatron-style (the README's picture).

q/k/v_proj and gate/up_proj are column-parallel (`_rows`: a worker computes its heads, its MLP features);
o_proj and down_proj are row-parallel (`RowParallelLinear`: a partial sum [.., hidden], then ONE
all-reduce), so between the two all-reduces every worker holds the full hidden state and norms, residuals
and rotary run unchanged. Heads are cut by KV-head group (`split`), so no worker needs another's K/V; more
workers than KV heads is refused. The embedding and the LM head are cut by vocabulary (the driver gathers
the logits whole); tied embeddings keep one shared slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class UnsupportedTensorParallel(ValueError):
    """The model or the world size cannot be cut as this phase cuts it."""


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """n items into `parts` contiguous ranges, as even as can be (the first ones one larger)."""
    size, extra = divmod(n, parts)
    bounds, start = [], 0
    for r in range(parts):
        end = start + size + (r < extra)
        bounds.append((start, end))
        start = end
    return bounds


def check_world_size(world_size, n_kv_heads: int) -> None:
    """A world of 1 .. n_kv_heads workers (each needs at least one KV-head group)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise UnsupportedTensorParallel(f"tensor_parallel_size must be an integer >= 1, got {world_size!r}")
    if world_size > n_kv_heads:
        raise UnsupportedTensorParallel(
            f"tensor_parallel_size={world_size} is more than the model's {n_kv_heads} KV heads: each worker "
            f"holds whole KV-head groups, so at most {n_kv_heads} workers can share this model")


class Comm:
    """The collectives a shard calls, on one process group."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the workers, in place; every worker gets the sum."""
        dist.all_reduce(x)
        return x

    def gather_to_driver(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0 gets every worker's `x` concatenated along the last axis; the others get theirs back."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x.contiguous(), parts, dst=0)
        return torch.cat(parts, dim=-1) if self.rank == 0 else x


def _rows(linear: nn.Linear, lo: int, hi: int) -> nn.Linear:
    """Column-parallel: output features lo .. hi-1 (a copy, so the full weight can be freed)."""
    out = nn.Linear(linear.in_features, hi - lo, bias=linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype)
    out.weight.data.copy_(linear.weight.data[lo:hi])
    if linear.bias is not None:
        out.bias.data.copy_(linear.bias.data[lo:hi])
    return out


class RowParallelLinear(nn.Module):
    """Input features lo .. hi-1 of a linear layer, then one all-reduce: x [.., hi-lo] -> [.., out].

    A bias is added once, after the sum, or every worker would add it."""

    def __init__(self, linear: nn.Linear, lo: int, hi: int, comm: Comm):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.data[:, lo:hi].clone(), requires_grad=False)   # [out, hi - lo]
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.data.clone(), requires_grad=False)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.comm.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows lo .. lo + per_rank - 1 of the embedding (padded with zeros past the vocabulary), then one all-reduce:
    ids [..] -> [.., hidden]. An id outside this worker's rows looks up zeros; its owner fills it in. A model
    that scales its embeddings (Gemma's sqrt(hidden), `embed_scale`) keeps its scale."""

    def __init__(self, weight: torch.Tensor, lo: int, comm: Comm, scale: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)       # [per_rank, hidden]
        self.lo, self.comm = lo, comm
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.lo
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * mine.unsqueeze(-1)
        if self.scale is not None:
            out = out * self.scale.to(out.dtype)
        return self.comm.all_reduce(out)


class VocabParallelHead(nn.Module):
    """Columns lo .. lo + per_rank - 1 of the logits, gathered whole on the driver: h [.., hidden] -> [.., V] on
    rank 0 (the padding past the vocabulary cut off), [.., per_rank] elsewhere."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, comm: Comm):
        super().__init__()
        self.weight = weight                                          # [per_rank, hidden]
        self.vocab_size, self.comm = vocab_size, comm

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.comm.gather_to_driver(F.linear(h, self.weight))
        return logits[..., :self.vocab_size] if self.comm.rank == 0 else logits


def _vocab_slice(weight: torch.Tensor, rank: int, world_size: int) -> tuple[torch.Tensor, int]:
    """This worker's rows of a [V, hidden] weight, padded to ceil(V / world) rows so every shard has one shape
    (a gather needs equal parts). Returns (rows, first vocabulary id)."""
    vocab = weight.shape[0]
    per_rank = -(-vocab // world_size)
    lo = rank * per_rank
    rows = weight.new_zeros(per_rank, weight.shape[1])
    take = weight[lo:min(lo + per_rank, vocab)]
    rows[:take.shape[0]] = take
    return rows, lo


@dataclass
class ShardInfo:
    """What one worker holds."""
    rank: int
    world_size: int
    kv_heads: tuple[int, int]       # [lo, hi) of the model's KV heads
    heads: tuple[int, int]          # [lo, hi) of its query heads
    intermediate: tuple[int, int]   # [lo, hi) of the MLP's features

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def n_heads(self) -> int:
        return self.heads[1] - self.heads[0]


def decoder_layers(model) -> list[nn.Module]:
    """The model's decoder layers, each with the linear layers this file cuts; refused by name otherwise."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise UnsupportedTensorParallel(f"{type(model).__name__}: no `model.layers` to shard")
    for layer in layers:
        parts = [(getattr(layer, "self_attn", None), n) for n in ATTENTION_PROJECTIONS] + \
                [(getattr(layer, "mlp", None), n) for n in MLP_PROJECTIONS]
        if missing := [n for module, n in parts if not isinstance(getattr(module, n, None), nn.Linear)]:
            raise UnsupportedTensorParallel(f"{type(model).__name__}: a decoder layer lacks the linear layers "
                                            f"{missing} that tensor parallelism cuts")
    return list(layers)


def shard_model(model, rank: int, world_size: int, comm: Comm) -> ShardInfo:
    """Cut `model` (a causal LM, loaded whole) in place down to worker `rank`'s shard; returns what it kept."""
    cfg = model.config
    n_heads = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    check_world_size(world_size, n_kv)
    group = n_heads // n_kv                                       # query heads per KV head
    layers = decoder_layers(model)
    head_dim = layers[0].self_attn.head_dim
    kv_lo, kv_hi = split(n_kv, world_size)[rank]
    ff = layers[0].mlp.gate_proj.out_features
    ff_lo, ff_hi = split(ff, world_size)[rank]
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj = _rows(attn.q_proj, kv_lo * group * head_dim, kv_hi * group * head_dim)
        attn.k_proj = _rows(attn.k_proj, kv_lo * head_dim, kv_hi * head_dim)
        attn.v_proj = _rows(attn.v_proj, kv_lo * head_dim, kv_hi * head_dim)
        attn.o_proj = RowParallelLinear(attn.o_proj, kv_lo * group * head_dim, kv_hi * group * head_dim, comm)
        mlp.gate_proj = _rows(mlp.gate_proj, ff_lo, ff_hi)
        mlp.up_proj = _rows(mlp.up_proj, ff_lo, ff_hi)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, ff_lo, ff_hi, comm)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    if head is not None and getattr(head, "bias", None) is not None:
        raise UnsupportedTensorParallel(f"{type(model).__name__}: an LM head with a bias is not cut here")
    rows, lo = _vocab_slice(embed.weight.data, rank, world_size)
    new_embed = VocabParallelEmbedding(rows, lo, comm, getattr(embed, "embed_scale", None))
    head_rows = new_embed.weight if tied else nn.Parameter(_vocab_slice(head.weight.data, rank, world_size)[0],
                                                           requires_grad=False)
    model.set_input_embeddings(new_embed)
    model.set_output_embeddings(VocabParallelHead(head_rows, cfg.vocab_size, comm))
    return ShardInfo(rank, world_size, (kv_lo, kv_hi), (kv_lo * group, kv_hi * group), (ff_lo, ff_hi))
