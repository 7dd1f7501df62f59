"""Test helpers: comparison functions and small hand-written models.

The models are ordinary PyTorch code, written the way people write them, not shaped for our passes:

* :class:`GPT` is a nanoGPT-style decoder (``x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))``, tied embeddings);
  ``nanogpt(flash=False)`` gives its textbook attention (minGPT's: ``q @ kᵀ · 1/√d``, ``masked_fill`` with a
  registered lower-triangular buffer, softmax, dropout, ``@ v``);
* :class:`PlainMLP` has no residual connection at all;
* :class:`NoNormResidual` has residual blocks whose branches skip the norm (``x = x + f(x)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "GPTConfig", "GPT", "nanogpt", "PlainMLP", "NoNormResidual", "sqnr", "assert_close_rms", "KERNEL_TOL", "Tol", "close",
    "assert_matches",
]


@dataclass
class GPTConfig:
    block_size: int = 64  # longest sequence
    vocab_size: int = 256  # byte-level
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True
    flash: bool = True  # False: nanoGPT's / minGPT's textbook attention (matmul, masked_fill with a causal buffer)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.flash = cfg.flash
        if not cfg.flash:  # minGPT / nanoGPT without flash: a causal mask buffer and an explicit softmax
            self.attn_dropout = nn.Dropout(cfg.dropout)
            tril = torch.tril(torch.ones(cfg.block_size, cfg.block_size))
            self.register_buffer("bias", tril.view(1, 1, cfg.block_size, cfg.block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v  # (B, nh, T, T) x (B, nh, T, hs) -> (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """nanoGPT-style decoder: token + position embeddings, PreNorm blocks, final LayerNorm, tied LM head."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
                ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # scaled init of residual projections (GPT-2 paper)
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))

    def configure_optimizers(self, weight_decay: float = 0.1, lr: float = 1e-3) -> torch.optim.Optimizer:
        """AdamW with decay on matrices only, as nanoGPT's own ``configure_optimizers``."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=lr)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy continuation of ``idx`` [B, T] (nanoGPT's loop: the whole context at every step, no cache)."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.block_size:])
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return idx


def nanogpt(n_layer: int = 4, n_embd: int = 64, **kw) -> GPT:
    """Factory for CLI specs: ``depthrewrite inspect depthrewrite.testing:nanogpt``."""
    torch.manual_seed(kw.pop("seed", 0))
    return GPT(GPTConfig(n_layer=n_layer, n_embd=n_embd, **kw))


class PlainMLP(nn.Module):
    """No skip connection anywhere."""

    def __init__(self, d: int = 32, layers: int = 3):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.layers:
            x = torch.relu(lin(x))
        return self.norm(x)


class NoNormBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))  # the branch reads the raw stream


class NoNormResidual(nn.Module):
    """Residual blocks whose branches skip the norm; a final norm is present."""

    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([NoNormBlock(d) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio in dB, 20·log10(‖ref‖ / ‖ref − out‖) (torchao's whole-model measure)."""
    ref, out = ref.detach().double(), out.detach().double()
    noise = (ref - out).norm()
    if noise == 0:
        return math.inf
    return float(20 * torch.log10(ref.norm() / noise))


def assert_close_rms(name: str, ref: torch.Tensor, out: torch.Tensor, ratio: float) -> None:
    """RMS(ref − out) / RMS(ref) ≤ ratio; NaN fails; the message carries the max abs difference."""
    ref, out = ref.detach().double(), out.detach().double()
    if torch.isnan(out).any() != torch.isnan(ref).any():
        raise AssertionError(f"{name}: NaN in one tensor only")
    diff = (ref - out).pow(2).mean().sqrt()
    base = ref.pow(2).mean().sqrt().clamp_min(1e-30)
    err = float(diff / base)
    if not err <= ratio:
        raise AssertionError(f"{name}: rms ratio {err:.3e} > {ratio:.1e} (max abs diff {float((ref - out).abs().max()):.3e})")


# ---- kernel comparisons: one tolerance table for "fused == reference" ----------------------------------------------


class Tol(NamedTuple):
    """How close a fused kernel must be to its reference, for one dtype.

    ``fwd`` and ``grad`` are ``(atol, rtol)`` for outputs and gradients (``atol`` scaled by ``max(1, max|ref|)``, see
    :func:`close`); ``rms`` is the RMS-ratio bound of :func:`assert_close_rms` (flash-linear-attention's
    ``assert_close(name, ref, tri, ratio)``), applied to every output and gradient. Half-precision references run in
    fp32 on upcast inputs, so the bounds cover the kernel's rounding of inputs, outputs and partial sums."""

    fwd: tuple[float, float]
    grad: tuple[float, float]
    rms: float


KERNEL_TOL: dict[torch.dtype, Tol] = {
    torch.float32: Tol(fwd=(1e-5, 1e-5), grad=(1e-4, 1e-4), rms=1e-5),
    torch.float16: Tol(fwd=(2e-3, 2e-3), grad=(1e-2, 1e-2), rms=5e-3),  # fla's ratio for fp16
    torch.bfloat16: Tol(fwd=(2e-2, 2e-2), grad=(5e-2, 5e-2), rms=1e-2),  # 3 fewer mantissa bits
}


def close(got, want, tol) -> None:
    """Pairwise over two sequences of tensors: same dtype and shape, and close with ``atol`` scaled by
    ``max(1, max|want|)``. ``tol`` is ``(atol, rtol)``."""
    atol, rtol = tol
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), atol=atol * max(1.0, b.abs().max().item()), rtol=rtol)


def assert_matches(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, kind: str = "fwd") -> None:
    """``got`` (the kernel's, in ``dtype``) against ``want`` (the reference's, possibly fp32) by :data:`KERNEL_TOL`:
    the scaled allclose of ``kind`` (``"fwd"`` or ``"grad"``) and the RMS ratio. NaN anywhere in ``got`` fails
    (``want`` is finite by construction)."""
    tol = KERNEL_TOL[dtype]
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values ({int((~torch.isfinite(got)).sum())} of {got.numel()})"
    atol, rtol = getattr(tol, kind)
    b = want.detach().float()
    torch.testing.assert_close(got.detach().float(), b, atol=atol * max(1.0, b.abs().max().item()) if b.numel() else atol,
                               rtol=rtol, msg=lambda m: f"{name}: {m}")
    if b.numel():
        assert_close_rms(name, want, got, tol.rms)
