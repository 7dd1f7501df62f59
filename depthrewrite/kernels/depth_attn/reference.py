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

__all__ = ["depth_attn_ref"]


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
