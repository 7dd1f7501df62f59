"""A plain PreNorm decoder with Full / Block AttnRes, written from shared/specs/attnres.md (not from the pass).

Used by the independent-reference tests: the vanilla twin (`use_attnres=False`) is converted by depthrewrite, the
weights are copied, and both sides get the same random pseudo-queries and gains.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.heads = heads

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up = nn.Linear(d, 3 * d, bias=False)
        self.down = nn.Linear(3 * d, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


class Mix(nn.Module):
    """One site: h = c · Σ softmax(w · RMSNorm_γ(v_i)) v_i, in fp32 (spec §2, §5 count rescaling)."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(d))
        self.gain = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, sources, count: bool):
        V = torch.stack(sources).float()  # [K, B, T, D]
        keys = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + self.eps) * self.gain
        alpha = torch.softmax((keys * self.query).sum(-1), dim=0)  # [K, B, T]
        h = (alpha.unsqueeze(-1) * V).sum(0)
        return (h * len(sources) if count else h).to(sources[0].dtype)


class Decoder(nn.Module):
    """L_b blocks = 2·L_b sublayers (attention, MLP, ...). ``block_size`` S in sublayers; S=1 is Full AttnRes."""

    def __init__(self, vocab=64, d=32, layers=3, heads=4, use_attnres=False, block_size=1, count=True):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.norms = nn.ModuleList([RMSNorm(d) for _ in range(2 * layers)])
        self.fns = nn.ModuleList([Attention(d, heads) if j % 2 == 0 else MLP(d) for j in range(2 * layers)])
        self.final = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.use_attnres, self.S, self.count = use_attnres, block_size, count
        if use_attnres:
            # sites 1..L-1 and the output site; sublayer 0 has a single source and no parameters (spec §11.9)
            self.mixes = nn.ModuleDict({str(j): Mix(d, 1e-6) for j in range(1, 2 * layers)} | {"output": Mix(d, 1e-6)})

    def forward(self, idx):
        x = self.emb(idx)
        if not self.use_attnres:
            for norm, f in zip(self.norms, self.fns):
                x = x + f(norm(x))
            return self.head(self.final(x))
        # K3 ordering (spec §4), written directly
        blocks, prefix = [], x
        for j, (norm, f) in enumerate(zip(self.norms, self.fns)):
            srcs = blocks + [prefix]
            h = self.mixes[str(j)](srcs, self.count) if len(srcs) > 1 else prefix
            if j % self.S == 0:
                blocks, prefix = blocks + [prefix], None
            out = f(norm(h))
            prefix = out if prefix is None else prefix + out
        h = self.mixes["output"](blocks + [prefix], self.count)
        return self.head(self.final(h))
