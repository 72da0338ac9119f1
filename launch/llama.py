"""A Llama-shaped decoder for benchmarks (RMSNorm, rotary-free attention via SDPA, SwiGLU MLP).

Shapes follow Llama-3.2-1B by default (hidden 2048, 16 layers, 32 heads / 8 KV heads, MLP 8192, vocab
128256, untied output head). Not part of the library: the benchmarks need a model with real shapes and a
real backward pass, not a faithful Llama.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    vocab: int = 128256
    hidden: int = 2048
    layers: int = 16
    heads: int = 32
    kv_heads: int = 8
    mlp: int = 8192

    @classmethod
    def named(cls, name: str) -> "LlamaConfig":
        presets = {
            "1b": cls(),
            "8b": cls(vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8, mlp=14336),
            "tiny": cls(vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, mlp=128),
        }
        return presets[name]


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype))


class Layer(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.c = c
        hd = c.hidden // c.heads
        self.attn_norm = RMSNorm(c.hidden)
        self.q = nn.Linear(c.hidden, c.heads * hd, bias=False)
        self.k = nn.Linear(c.hidden, c.kv_heads * hd, bias=False)
        self.v = nn.Linear(c.hidden, c.kv_heads * hd, bias=False)
        self.o = nn.Linear(c.heads * hd, c.hidden, bias=False)
        self.mlp_norm = RMSNorm(c.hidden)
        self.gate = nn.Linear(c.hidden, c.mlp, bias=False)
        self.up = nn.Linear(c.hidden, c.mlp, bias=False)
        self.down = nn.Linear(c.mlp, c.hidden, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        c = self.c
        hd = c.hidden // c.heads
        h = self.attn_norm(x)
        # -1: the heads this rank holds (all of them, or heads / tp under tensor_parallel)
        q = self.q(h).view(b, t, -1, hd).transpose(1, 2)
        k = self.k(h).view(b, t, -1, hd).transpose(1, 2)
        v = self.v(h).view(b, t, -1, hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, -1))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.hidden)
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, targets):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def tensor_parallel(model: Llama, tp_mesh) -> Llama:
    """torchtitan's tensor-parallel plan over the 1-D mesh ``tp_mesh``, in place: in each layer q/k/v and
    gate/up column-sharded (``Shard(0)``: whole output rows per rank) and o/down row-sharded (``Shard(1)``:
    a piece of every input row, whole 32-value groups when ``ceil(in_features / tp) % 32 == 0``), the
    embedding split by vocabulary rows and the output head by vocabulary columns, both ``Shard(0)``. Norm
    weights stay replicated. Every rank of a tensor-parallel group must be fed the same batch."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    c = model.layers[0].c
    if c.heads % tp or c.kv_heads % tp:
        raise ValueError(f"--tp {tp} must divide the model's {c.heads} heads and {c.kv_heads} key/value heads")
    layer_plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel(),
                  "gate": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, layer_plan)
    parallelize_module(model, tp_mesh, {"embed": RowwiseParallel(input_layouts=Replicate()),
                                        "head": ColwiseParallel(output_layouts=Replicate())})
    return model
