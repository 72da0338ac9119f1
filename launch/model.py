"""A small GPT-style byte-level language model for the training recipes (not part of the library)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layer: int = 4
    n_head: int = 4

    def __post_init__(self):
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        # separate q, k, v (not one fused qkv): a column shard of each holds whole heads under tensor parallelism
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.v = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.up = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False)
        self.down = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln1(x)
        # -1: the heads this rank holds (all of them, or n_head / tp under tensor_parallel)
        q, k, v = (lin(h).view(b, t, -1, d // self.n_head).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Parameter(torch.zeros(cfg.seq_len, cfg.d_model))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.apply(self._init)
        for block in self.blocks:  # scaled residual projections (GPT-2)
            for lin in (block.proj, block.down):
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, targets=None):
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def tensor_parallel(model: GPT, tp_mesh) -> GPT:
    """torchtitan's tensor-parallel plan over the 1-D mesh ``tp_mesh``, in place: in each block q/k/v and up
    column-sharded (``Shard(0)``: whole heads, whole output rows), proj and down row-sharded (``Shard(1)``:
    flashdist needs ``ceil(in_features / tp)`` to be a multiple of 32, e.g. d_model 128 at tp 2 or 4). The
    embeddings, norms and head stay outside tensor parallelism (replicated over the tp ranks). Every rank of
    a tensor-parallel group must be fed the same batch."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    if model.cfg.n_head % tp:
        raise ValueError(f"--tp {tp} must divide n_head {model.cfg.n_head}")
    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "proj": RowwiseParallel(),
            "up": ColwiseParallel(), "down": RowwiseParallel()}
    for block in model.blocks:
        parallelize_module(block, tp_mesh, plan)
    return model


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for parameters on several device meshes (tensor-parallel blocks on
    the (dp, tp) mesh, the rest on the dp mesh), where torch's refuses to stack norms of different meshes:
    the norm of each mesh's gradients (a collective over that mesh), combined, then torch's scaling."""
    from torch.distributed.tensor import DTensor

    by_mesh: dict = {}
    for p in parameters:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = []
    for params in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.tensor(0.0)
    for params in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
