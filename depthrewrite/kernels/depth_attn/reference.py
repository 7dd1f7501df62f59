"""Depth attention (the AttnRes mix), pure PyTorch. The one docstring of the op lives here.

    u      = gain ⊙ query                                   # [d]
    r_i    = (mean_c(v_i²) + eps)^(-1/2)                    # per source, per token
    s_i    = (v_i · u) · r_i                                # plain dot product, no 1/sqrt(d)
    α      = softmax_i(s)                                   # over the K sources (depth)
    h      = scale · Σ_i α_i v_i                            # scale = K ("count") or 1 ("mean", paper-literal)

Kimi Team, *Attention Residuals*, arXiv:2603.15031, Eq. 2-4. All statistics, the softmax and the weighted sum are in
fp32; the result is cast back to the sources' dtype once.
"""

from __future__ import annotations

import torch

__all__ = ["depth_attn_ref", "depth_attn_partial_ref", "depth_attn_merge_ref"]


def depth_attn_ref(
    sources: list[torch.Tensor], query: torch.Tensor, gain: torch.Tensor, eps: float, scale: float
) -> torch.Tensor:
    """Mix K depth sources by softmax attention with a learned pseudo-query.

    Args:
        sources (list[Tensor]): K tensors ``[..., D]`` of one shape and dtype (the values; keys are their RMS-normed
            copies).
        query (Tensor): the pseudo-query ``w``, ``[D]``.
        gain (Tensor): the key-norm gain ``γ``, ``[D]``.
        eps (float): the key RMSNorm epsilon.
        scale (float): multiplies the mix; ``K`` for ``mix_scale="count"``, ``1.0`` for ``"mean"``.

    Returns:
        Tensor ``[..., D]`` in the sources' dtype.
    """
    acc = torch.promote_types(sources[0].dtype, torch.float32)  # fp32 at least, on purpose (fp64 stays fp64)
    v = torch.stack([s.to(acc) for s in sources], dim=0)  # [K, ..., D]
    u = gain.to(acc) * query.to(acc)  # [D]
    r = torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)  # [K, ..., 1]
    s = (v * u).sum(-1, keepdim=True) * r  # [K, ..., 1]
    a = torch.softmax(s, dim=0)
    h = (a * v).sum(0) * scale
    return h.to(sources[0].dtype)


# ---- two-phase computation (attnres spec §7) --------------------------------------------------------------------------
#
#   phase 1, once per block:  (o_l, lse_l) = partial(completed sources, q_l, γ_l)  for all S sites l of the block
#   phase 2, per site:        h_l = merge(o_l, lse_l, open partial sum, q_l, γ_l)
#
# such that merge(o[l], lse[l], last, q_l, γ_l, eps, scale) == depth_attn_ref(sources + [last], q_l, γ_l, eps, scale).


def depth_attn_partial_ref(
    sources: list[torch.Tensor], queries: torch.Tensor, gains: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 1 of the two-phase mix: S pseudo-queries against the same K completed sources.

    Args:
        sources (list[Tensor]): K tensors ``[..., D]`` of one shape and dtype.
        queries (Tensor): the S pseudo-queries ``w_l``, ``[S, D]``.
        gains (Tensor): the S key-norm gains ``γ_l``, ``[S, D]``.
        eps (float): the key RMSNorm epsilon.

    Returns:
        ``(o, lse)``: ``o`` ``[S, ..., D]`` is the normalised softmax mix ``Σ_i α_{l,i} v_i`` (no ``scale``), ``lse``
        ``[S, ...]`` the log-sum-exp of the scores ``s_{l,i}``; both fp32 (fp64 for fp64 sources).
    """
    acc = torch.promote_types(sources[0].dtype, torch.float32)
    v = torch.stack([s.to(acc) for s in sources], dim=0)  # [K, ..., D]
    u = gains.to(acc) * queries.to(acc)  # [S, D]
    r = torch.rsqrt(v.pow(2).mean(-1) + eps)  # [K, ...]
    s = torch.einsum("k...d,sd->sk...", v, u) * r  # [S, K, ...]
    lse = torch.logsumexp(s, dim=1)  # [S, ...]
    p = torch.softmax(s, dim=1)
    o = torch.einsum("sk...,k...d->s...d", p, v)
    return o.contiguous(), lse.contiguous()  # contiguous, like the kernel's outputs and the fake


def depth_attn_merge_ref(
    o: torch.Tensor,
    lse: torch.Tensor,
    last: torch.Tensor,
    query: torch.Tensor,
    gain: torch.Tensor,
    eps: float,
    scale: float,
) -> torch.Tensor:
    """Phase 2 of the two-phase mix: merge one more source into a partial result by log-sum-exp.

    Args:
        o (Tensor): ``[..., D]`` fp32, the partial mix of one site (from :func:`depth_attn_partial_ref`).
        lse (Tensor): ``[...]`` fp32, its log-sum-exp.
        last (Tensor): ``[..., D]``, the extra source (the block's open partial sum).
        query (Tensor): the site's pseudo-query ``[D]``.
        gain (Tensor): the site's key-norm gain ``[D]``.
        eps (float): the key RMSNorm epsilon.
        scale (float): multiplies the mix (``K`` counting ``last``, or ``1.0``).

    Returns:
        Tensor ``[..., D]`` in ``last``'s dtype, equal to ``depth_attn_ref(sources + [last], query, gain, eps, scale)``.
    """
    acc = torch.promote_types(last.dtype, torch.float32)
    v = last.to(acc)
    u = gain.to(acc) * query.to(acc)
    r = torch.rsqrt(v.pow(2).mean(-1) + eps)
    s2 = (v * u).sum(-1) * r
    lse = lse.to(acc)
    m = torch.maximum(lse, s2)
    a, b = torch.exp(lse - m), torch.exp(s2 - m)
    h = (a.unsqueeze(-1) * o.to(acc) + b.unsqueeze(-1) * v) / (a + b).unsqueeze(-1)
    return (h * scale).to(last.dtype)
