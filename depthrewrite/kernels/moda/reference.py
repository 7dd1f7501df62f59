"""MoDA attention (mixture-of-depths attention), pure PyTorch. The one docstring of the op lives here.

    S_seq[j] = s · q_t · k_j        (sequence keys of this layer, masked as the model masks them)
    S_dep[i] = s · q_t · Kd_{t,i}   (depth slots: K/V that earlier sublayers wrote for the same token t)
    P        = softmax(concat(S_seq, λ-weighted S_dep))     one joint softmax, one scale, no gate
    o_t      = Σ_j P_seq[j] v_j + Σ_i P_dep[i] Vd_{t,i}

Zhu et al., *Mixture-of-Depths Attention*, arXiv:2603.15619; spec: shared/specs/moda.md §2, §5, §8 (Q8: λ).
Computed as the exact log-sum-exp merge of the sequence part (o_s, lse_s) and the depth part (o_d, lse_d):
``o = (e^{lse_s}·o_s + λ·e^{lse_d}·o_d) / (e^{lse_s} + λ·e^{lse_d})``, all in fp32, cast back once. Depth slots are
token-major ``[B, T, n, Hk, d]``; query head h reads KV head ⌊h / G⌋ (G = Hq / Hk) for sequence and depth alike.
"""

from __future__ import annotations

import math

import torch

__all__ = ["moda_attn_ref", "moda_slots_ref"]


def moda_slots_ref(keys: list[torch.Tensor]) -> torch.Tensor:
    """Token-major depth slots: n tensors ``[B, Hk, T, d]`` -> ``[B, T, n, Hk, d]`` (contiguous)."""
    return torch.stack(keys, dim=0).permute(1, 3, 0, 2, 4).contiguous()


def _dropout(p: torch.Tensor, rate: float, gen: torch.Generator | None) -> torch.Tensor:
    if rate <= 0.0:
        return p
    keep = torch.rand(p.shape, generator=gen, device=p.device, dtype=p.dtype) >= rate
    return p * keep / (1.0 - rate)


def moda_attn_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    depth_k: torch.Tensor,
    depth_v: torch.Tensor,
    depth_weight: torch.Tensor | None,
    scale: float,
    is_causal: bool,
    dropout_p: float = 0.0,
    seed: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Joint softmax over the sequence keys and the same-token depth slots.

    Args:
        q (Tensor): ``[B, Hq, T, d]``.
        k, v (Tensor): ``[B, Hk, S, d]`` sequence keys/values (Hq a multiple of Hk).
        attn_mask (Tensor, optional): boolean (True = attend) or additive, broadcastable to ``[B, Hq, T, S]``;
            applies to the sequence part only.
        depth_k, depth_v (Tensor): ``[B, T, n, Hk, d]`` token-major depth slots (n >= 1).
        depth_weight (Tensor, optional): λ ``[Hq]``, clamped at 0 (straight-through); None means λ = 1 (the paper).
        scale (float): the attention scale, shared by both parts.
        is_causal (bool): causal sequence mask (lower-triangular, top-left aligned, as SDPA's ``is_causal``).
        dropout_p (float): attention dropout on the joint probabilities. Default: 0.
        seed (Tensor, optional): int64 seed for the dropout masks, so backward recomputes the same ones.
        softcap (float): logit soft-capping ``c·tanh(x/c)`` on both parts (Gemma2); 0 disables it. Default: 0.

    Returns:
        Tensor ``[B, Hq, T, d]`` in q's dtype, laid out like SDPA's output (``[B, T, Hq, d]`` in memory), since
        model code may ``view`` the transposed output without a ``contiguous()``.
    """
    acc = torch.promote_types(q.dtype, torch.float32)
    B, Hq, T, d = q.shape
    Hk, S = k.shape[1], k.shape[2]
    G = Hq // Hk
    qf = q.to(acc)
    kf = k.to(acc).repeat_interleave(G, dim=1)  # query head h -> KV head h // G
    vf = v.to(acc).repeat_interleave(G, dim=1)
    scores = (qf @ kf.transpose(-1, -2)) * scale  # [B, Hq, T, S]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if is_causal:
        keep = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()  # top-left aligned, as SDPA's is_causal
        scores = scores.masked_fill(~keep, -math.inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, -math.inf)
        else:
            scores = scores + attn_mask.to(acc)
    lse_s = torch.logsumexp(scores, dim=-1, keepdim=True)  # [B, Hq, T, 1]
    Kd = depth_k.to(acc).repeat_interleave(G, dim=3)  # [B, T, n, Hq, d]
    Vd = depth_v.to(acc).repeat_interleave(G, dim=3)
    dlog = torch.einsum("bhtd,btnhd->bhtn", qf, Kd) * scale  # [B, Hq, T, n]
    if softcap > 0:
        dlog = softcap * torch.tanh(dlog / softcap)
    lse_d = torch.logsumexp(dlog, dim=-1, keepdim=True)
    gen = None
    if dropout_p > 0.0 and seed is not None:
        gen = torch.Generator(device=q.device).manual_seed(int(seed.reshape(-1)[0]))
    # dropout commutes with the per-row merge weights below, so it can act on each part's own softmax
    o_s = _dropout(torch.exp(scores - lse_s), dropout_p, gen) @ vf
    o_d = torch.einsum("bhtn,btnhd->bhtd", _dropout(torch.exp(dlog - lse_d), dropout_p, gen), Vd)
    m = torch.maximum(lse_s, lse_d)
    a = torch.exp(lse_s - m)
    b = torch.exp(lse_d - m)
    if depth_weight is not None:
        lam = depth_weight.to(acc)
        lam = lam + (lam.clamp_min(0.0) - lam).detach()  # λ >= 0 forward, gradient passes unchanged
        b = b * lam.view(1, Hq, 1, 1)
    out = (a * o_s + b * o_d) / (a + b)
    return out.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)
