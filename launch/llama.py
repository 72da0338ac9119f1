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
        q = self.q(h).view(b, t, c.heads, hd).transpose(1, 2)
        k = self.k(h).view(b, t, c.kv_heads, hd).transpose(1, 2)
        v = self.v(h).view(b, t, c.kv_heads, hd).transpose(1, 2)
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
