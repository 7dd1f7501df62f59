"""mHC (manifold-constrained hyper-connections), pure PyTorch. The one docstring of each op lives here.

    x⃗      = vec(X) ∈ R^{n·d} per token;  r = (mean(x⃗²) + ε)^{-1/2}
    mix    = (x⃗ @ φ) · r                                   φ: [n·d, n²+2n], columns [pre (n) | post (n) | res (n²)]
    H_pre  = σ(α_pre · mix_pre + b_pre) + ε                 (+ε as DeepSeek-V4)
    H_post = 2σ(α_post · mix_post + b_post)
    H_res  = Sinkhorn(α_res · mix_res + b_res)              [n_out, n_in], 20 iterations (rows exact: exact_rows)
    u      = Σ_i H_pre[i] X_i        X' = H_res X + H_postᵀ y

Xie et al., *mHC: Manifold-Constrained Hyper-Connections*, arXiv:2512.24880, Eqs. 3, 7-9; numerics of DeepSeek-V4
(paper orientation). Spec: shared/specs/mhc.md §3, §8. Coefficients, Sinkhorn and the mixes are fp32 (or wider);
the state X keeps the model dtype.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["sinkhorn", "mhc_coeffs_ref", "mhc_pre_ref", "mhc_post_ref", "mhc_collapse_ref"]


def sinkhorn(logits: torch.Tensor, iters: int, eps: float, exact_rows: bool = False) -> torch.Tensor:
    """Doubly-stochastic projection of ``exp(logits)`` (``[..., n_out, n_in]``), V4 numerics in paper orientation:
    softmax over outputs, then alternate row / column normalisation; the last step normalises rows.

    Every division adds ``eps`` (DeepSeek-V4), so rows end summing to ``S / (S + eps)``, 1 − O(eps). With
    ``exact_rows`` the last row normalisation divides by the plain row sum (positive: every entry is >= eps before
    it), so each row sums to 1 up to rounding — what makes mHC the original function at init (docs/mhc.md).
    """
    M = torch.softmax(logits, dim=-2) + eps
    last = iters <= 1
    M = M / (M.sum(-1, keepdim=True) + (0.0 if exact_rows and last else eps))
    for i in range(iters - 1):
        M = M / (M.sum(-2, keepdim=True) + eps)
        M = M / (M.sum(-1, keepdim=True) + (0.0 if exact_rows and i == iters - 2 else eps))
    return M


def mhc_coeffs_ref(
    X: torch.Tensor, phi: torch.Tensor, bias: torch.Tensor, alpha: torch.Tensor, iters: int, eps: float,
    exact_rows: bool = False, *, project: Callable[..., torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dynamic coefficients of one mHC site.

    Args:
        X (Tensor): the n-stream state ``[..., n, D]``.
        phi (Tensor): ``[n·D, n²+2n]``.
        bias (Tensor): ``[n²+2n]``.
        alpha (Tensor): ``[3]`` = (α_pre, α_post, α_res).
        iters (int): Sinkhorn iterations.
        eps (float): RMS epsilon, H_pre floor and Sinkhorn epsilon.
        exact_rows (bool): the last Sinkhorn row normalisation without ``eps`` (rows of H_res sum to 1).
        project (callable): computes :func:`sinkhorn` (same arguments); None: :func:`sinkhorn` itself.

    Returns:
        (H_pre ``[..., n]``, H_post ``[..., n]``, H_res ``[..., n, n]``), fp32 (or wider).
    """
    acc = torch.promote_types(X.dtype, torch.float32)
    n = X.shape[-2]
    xf = X.flatten(-2).to(acc)
    mix = (xf @ phi.to(acc)) * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    a, b = alpha.to(acc), bias.to(acc)
    pre = torch.sigmoid(a[0] * mix[..., :n] + b[:n]) + eps
    post = 2 * torch.sigmoid(a[1] * mix[..., n : 2 * n] + b[n : 2 * n])
    res = (a[2] * mix[..., 2 * n :] + b[2 * n :]).unflatten(-1, (n, n))
    return pre, post, (project or sinkhorn)(res, iters, eps, exact_rows)


def mhc_pre_ref(X: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """u = Σ_i H_pre[i] X_i: ``[..., n, D]``, ``[..., n]`` -> ``[..., D]`` in X's dtype."""
    acc = torch.promote_types(X.dtype, pre.dtype)
    return (pre.to(acc).unsqueeze(-1) * X.to(acc)).sum(-2).to(X.dtype)


def mhc_post_ref(X: torch.Tensor, res: torch.Tensor, post: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """X' = H_res X + H_postᵀ y: ``[..., n, D]``, ``[..., n, n]``, ``[..., n]``, ``[..., D]`` -> ``[..., n, D]``."""
    acc = torch.promote_types(X.dtype, res.dtype)
    Xa, ra = X.to(acc), res.to(acc)
    out = post.to(acc).unsqueeze(-1) * y.to(acc).unsqueeze(-2)
    for i in range(X.shape[-2]):  # n multiply-adds over [..., n, D], not n x n matmuls per token (inductor fuses them)
        out = out + ra[..., :, i : i + 1] * Xa[..., i : i + 1, :]
    return out.to(X.dtype)


def mhc_collapse_ref(X: torch.Tensor, mode: str) -> torch.Tensor:
    """The n streams -> one, before the final norm: ``"mean"`` (default) or ``"sum"``."""
    acc = torch.promote_types(X.dtype, torch.float32)
    Xf = X.to(acc)
    return (Xf.mean(-2) if mode == "mean" else Xf.sum(-2)).to(X.dtype)
