"""MSAR mix (multi-stream attention residuals), pure PyTorch. The one docstring of the op lives here.

    V^(0) = v_i,  V^(r) = causal depthwise conv_r(v_i) along the sequence (r = 1..m-1)     # m full-width views
    a^(r) = softmax_i( (γ_r ⊙ w_r) · RMSNorm(V_i^(r)) )                                      # per-stream depth softmax
    Z^(r) = Σ_i a_i^(r) · V_i^(r)      (values raw v_i when conv_values=False)
    g     = sigmoid( α · (RMS(flatten Z) @ φ) + b )   ∈ R^m                                 # input-dependent mixer
    h     = scale · Σ_r g_r Z^(r)

Qin et al., *Multi-Stream Attention Residuals* (2026); spec: shared/specs/msar.md §2, §4, §5. All math in fp32
(or wider), cast back once. The sequence axis is dim -2 of every source. Conv taps are stored ``[d, k]`` with the
*last* tap on the current token (cross-correlation over a left-padded input), so identity init is ``w[:, k-1] = 1``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

__all__ = ["msar_mix_ref", "causal_depthwise_conv"]


def causal_depthwise_conv(x: torch.Tensor, w: torch.Tensor, left: torch.Tensor | None = None) -> torch.Tensor:
    """``y[..., t, c] = Σ_τ w[c, k-1-τ] · x[..., t-τ, c]`` with zeros before the start (or ``left`` context).

    Args:
        x (Tensor): ``[..., T, d]``.
        w (Tensor): ``[d, k]`` taps, the last one on the current token.
        left (Tensor, optional): ``[..., k-1, d]`` earlier positions (the decoding state); zeros when None.
    """
    d, k = w.shape
    lead, T = x.shape[:-2], x.shape[-2]
    xs = x.reshape(-1, T, d).transpose(1, 2)  # [N, d, T]
    if left is None:
        pad = xs.new_zeros(xs.shape[0], d, k - 1)
    else:  # the last k-1 positions of the earlier chunk
        pad = left.reshape(-1, left.shape[-2], d).transpose(1, 2)[..., left.shape[-2] - (k - 1) :]
    xs = torch.cat([pad.to(xs.dtype), xs], dim=-1)
    y = F.conv1d(xs, w.unsqueeze(1).to(x.dtype), groups=d)  # [N, d, T]
    return y.transpose(1, 2).reshape(*lead, T, d)


def msar_mix_ref(
    sources: list[torch.Tensor],
    query: torch.Tensor,
    gain: torch.Tensor,
    conv: list[torch.Tensor],
    phi: torch.Tensor | None,
    bias: torch.Tensor | None,
    alpha: torch.Tensor | None,
    eps: float,
    scale: float,
    conv_values: bool = True,
    sigmoid_mixer: bool = True,
    left: list[torch.Tensor] | None = None,
    eps_mix: float = 1e-6,
) -> torch.Tensor:
    """Mix K depth sources through m stream views (identity + causal depthwise convs) and a sigmoid mixer.

    Args:
        sources (list[Tensor]): K tensors ``[..., T, D]`` (T: sequence), one shape and dtype.
        query (Tensor): pseudo-queries ``[m, D]``, one per stream.
        gain (Tensor): key-norm gains ``[m, D]``.
        conv (list[Tensor]): m-1 depthwise filters ``[D, k_r]`` (stream r = 1..m-1).
        phi (Tensor, optional): mixer projection ``[m·D, m]`` (None with the mean mixer).
        bias (Tensor, optional): mixer bias ``[m]``.
        alpha (Tensor, optional): mixer scale, ``[]`` or ``[1]``.
        eps (float): key RMSNorm epsilon.
        scale (float): ``K`` for ``mix_scale="count"``, ``1.0`` for ``"mean"``.
        conv_values (bool): values from the conv views (True, default) or raw sources (False). Default: True.
        sigmoid_mixer (bool): the sigmoid mixer (True) or the uniform mean 1/m (False). Default: True.
        left (list[Tensor], optional): per source, ``[..., k_max-1, D]`` earlier positions (decoding state).
        eps_mix (float): the mixer's RMS epsilon, independent of ``eps``. Default: 1e-6 (msar.md §5).

    Returns:
        Tensor ``[..., T, D]`` in the sources' dtype.
    """
    acc = torch.promote_types(sources[0].dtype, torch.float32)
    X = torch.stack([s.to(acc) for s in sources], dim=0)  # [K, ..., T, D]
    Lx = torch.stack([s.to(acc) for s in left], dim=0) if left is not None else None
    m = query.shape[0]
    Z = []
    for r in range(m):
        Xr = X if r == 0 else causal_depthwise_conv(X, conv[r - 1].to(acc), Lx)
        rms = torch.rsqrt(Xr.pow(2).mean(-1, keepdim=True) + eps)
        s = (Xr * (gain[r].to(acc) * query[r].to(acc))).sum(-1, keepdim=True) * rms  # [K, ..., T, 1]
        a = torch.softmax(s, dim=0)
        Z.append((a * (Xr if conv_values else X)).sum(0))  # [..., T, D]
    Zs = torch.stack(Z, dim=-2)  # [..., T, m, D]
    if sigmoid_mixer:
        z = Zs.flatten(-2)
        z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps_mix)
        g = torch.sigmoid(alpha.to(acc).reshape(()) * (z @ phi.to(acc)) + bias.to(acc))  # [..., T, m]
    else:
        g = torch.full(Zs.shape[:-1], 1.0 / m, dtype=acc, device=Zs.device)
    h = (g.unsqueeze(-1) * Zs).sum(-2) * scale
    return h.to(sources[0].dtype)
