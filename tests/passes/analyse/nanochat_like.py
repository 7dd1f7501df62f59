"""Small GPTs in nanochat's style, written from its description (no nanochat code): weightless RMSNorm, a
"backout" that subtracts a scaled earlier residual from the final stream before the final norm, and per-layer
residual scalars (``x = resid_lambdas[i] * x + x0_lambdas[i] * x0``)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def norm(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.size(-1),))


class Block(nn.Module):
    def __init__(self, d: int, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.out = nn.Linear(4 * d, d, bias=False)

    def attn(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))

    def mlp(self, x):
        return self.out(F.relu(self.fc(x)).square())

    def forward(self, x):
        x = x + self.attn(norm(x))
        return x + self.mlp(norm(x))


class NanoChatLike(nn.Module):
    """``scaling``: ``"none"``, ``"start"`` (each block starts with ``x = resid_lambdas[i] * x + x0_lambdas[i] * x0``)
    or ``"end"`` (the stream is scaled, ``x = resid_lambdas[-1] * x``, after the last block). ``backout``: subtract
    ``backout_lambda * x_mid`` (the stream after the first block) before the final norm."""

    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 2, backout: bool = False, scaling: str = "none"):
        super().__init__()
        self.backout, self.scaling = backout, scaling
        self.wte = nn.Embedding(vocab, d)
        self.h = nn.ModuleList([Block(d) for _ in range(layers)])
        self.resid_lambdas = nn.Parameter(torch.ones(layers))
        self.x0_lambdas = nn.Parameter(torch.full((layers,), 0.1))
        self.backout_lambda = nn.Parameter(torch.tensor(0.5))
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = norm(self.wte(idx))
        x0, x_mid = x, None
        for i, block in enumerate(self.h):
            if self.scaling == "start":
                x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            x = block(x)
            if i == 0:
                x_mid = x
        if self.scaling == "end":
            x = self.resid_lambdas[-1] * x
        if self.backout:
            x = x - self.backout_lambda * x_mid
        return self.lm_head(norm(x))
