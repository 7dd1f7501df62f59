"""A small decoder whose norms are written the ways OLMo-core writes them: the gain cast to the activation's dtype
(``self.weight.type_as(x) * x``), and the whole norm inside ``torch.autocast(enabled=False)`` (which torch.export
records as a ``wrap_with_autocast`` region) or ``torch.no_grad()`` (``wrap_with_set_grad_enabled``); PreNorm blocks
``h + f(Norm(h))`` or OLMo2's reordered norm ``h + Norm(f(h))``."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

#: how the gain is applied: "plain" self.weight * x, "type_as" self.weight.type_as(x) * x (OLMo-core),
#: "type_as_input" self.weight.type_as(<norm input>) * x
GAINS = ("plain", "type_as", "type_as_input")
#: the region the norm runs in: None, "autocast" (OLMo-core's RMSNorm), "no_grad", "nested" (no_grad around autocast)
REGIONS = (None, "autocast", "no_grad", "nested")


class Norm(nn.Module):
    """OLMo-core's RMSNorm math (``x.float()``, the statistic, the gain, ``.to(og_dtype)``) in a configurable region.
    ``spy=True``: the region also returns a statistic of its input that the model reads outside the norm."""

    def __init__(self, d: int, gain: str = "type_as", region: str | None = "autocast", spy: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.gain, self.region, self.spy = gain, region, spy

    def _region(self, x):
        if self.region == "autocast":
            return torch.autocast(x.device.type, enabled=False)
        if self.region == "no_grad":
            return torch.no_grad()
        if self.region == "nested":
            stack = contextlib.ExitStack()
            stack.enter_context(torch.no_grad())
            stack.enter_context(torch.autocast(x.device.type, enabled=False))
            return stack
        return contextlib.nullcontext()

    def forward(self, x):
        with self._region(x):
            og = x.dtype
            h = x.float()
            n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            if self.gain == "plain":
                n = self.weight * n
            elif self.gain == "type_as":
                n = self.weight.type_as(n) * n
            else:
                n = self.weight.type_as(x) * n
            out = n.to(og)
            if self.spy:
                return out, x.abs().amax(-1, keepdim=True)
        return out


class Attention(nn.Module):
    def __init__(self, d: int, heads: int = 2):
        super().__init__()
        self.qkv, self.o, self.heads = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False), heads

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, D // self.heads).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, D))


class MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, d: int, reordered: bool, block_region: bool, **norm):
        super().__init__()
        self.attn, self.mlp = Attention(d), MLP(d)
        self.attn_norm, self.mlp_norm = Norm(d, **norm), Norm(d, **norm)
        self.reordered, self.block_region = reordered, block_region

    def forward(self, h):
        """(h_out, the statistics spy norms returned)."""
        stats = []

        def norm(n, x):
            y = n(x)
            if isinstance(y, tuple):
                y, stat = y
                stats.append(stat)
            return y

        with torch.autocast(h.device.type, enabled=False) if self.block_region else contextlib.nullcontext():
            if self.reordered:  # OLMo2: h + Norm(f(h))
                h = h + norm(self.attn_norm, self.attn(h))
                h = h + norm(self.mlp_norm, self.mlp(h))
            else:
                h = h + self.attn(norm(self.attn_norm, h))
                h = h + self.mlp(norm(self.mlp_norm, h))
        return h, stats


class WrappedNormLM(nn.Module):
    """Embedding, ``layers`` blocks, final norm (a plain-region norm of the same gain when ``block_region``), head.
    With a ``spy`` norm the model returns ``(logits, the sum of the spied statistics)``."""

    def __init__(self, gain: str = "type_as", region: str | None = "autocast", reordered: bool = False,
                 spy: bool = False, block_region: bool = False, d: int = 16, layers: int = 2, vocab: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            Block(d, reordered, block_region, gain=gain, region=region, spy=spy) for _ in range(layers)
        )
        self.norm = Norm(d, gain=gain, region=region)
        self.head = nn.Linear(d, vocab, bias=False)
        self.spy = spy

    def forward(self, ids):
        h = self.emb(ids)
        stats = []
        for b in self.blocks:
            h, s = b(h)
            stats += s
        logits = self.head(self.norm(h))
        if self.spy:
            return logits, torch.stack([s.sum() for s in stats]).sum()
        return logits
