"""MSAR mix (multi-stream attention residuals), pure PyTorch. The one docstring of the op lives here.

    V^(0) = v_i,  V^(r) = causal depthwise conv_r(v_i) along the sequence (r = 1..m-1)     # m full-width views
    a^(r) = softmax_i( (γ_r ⊙ w_r) · RMSNorm(V_i^(r)) )                                      # per-stream depth softmax
    Z^(r) = Σ_i a_i^(r) · V_i^(r)      (values raw v_i when conv_values=False)
    g     = sigmoid( α · (RMS(flatten Z) @ φ) + b )   ∈ R^m                                 # input-dependent mixer
    h     = scale · Σ_r g_r Z^(r)

Qin et al., *Multi-Stream Attention Residuals* (2026); spec: shared/specs/msar.md §2, §4, §5. All math in fp32
(or wider), cast back once. The sequence axis is dim -2 of every source. Conv taps are stored ``[d, k]`` with the
*last* tap on the current token (cross-correlation over a left-padded input), so identity init is ``w[:, k-1] = 1``.

How it is computed: the K sources are stacked once into ``[K·B, T, D]`` (B: the flattened leading dims), left-padded
once to the longest filter, and every stream view is one depthwise convolution of that stack (all sources at once).
In eager mode the convolution is ``conv2d`` on a channels-last view (time on the width axis, D channels: oneDNN's
depthwise kernel on CPU, no transposes), or for a few positions (a decoding step) one multiply and one sum over the
unfolded windows, cheaper than oneDNN's call there; while ``torch.compile`` traces (:func:`torch.compiler.is_compiling`)
it is the same sum of k shifted multiply-adds written pointwise, which inductor fuses with its consumers. Per stream the
key statistics are one norm and one matrix-vector product over the stack, the softmax runs over the stacked axis. A
small call with gradients off (a decoding step) computes all m streams at once over one ``[m, K, B·T, D]`` stack of
the views (:func:`_streams_at_once`), fewer and larger ops than the loop over streams.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

from .._trace import tracing

__all__ = ["msar_mix_ref", "causal_depthwise_conv"]


# ---- the depthwise convolution on a left-padded stack [B, T+k-1, C] (shared with the backward in op.py) ------------


def _pointwise() -> bool:
    """Shifted multiply-adds instead of ``conv2d`` while compiling or traced as a decomposition for inductor
    (inductor fuses them; it would call the convolution as an extern kernel)."""
    return tracing() or torch.compiler.is_compiling()


def _cl(x: torch.Tensor) -> torch.Tensor:
    """``[B, T, C]`` as a channels-last ``[B, C, 1, T]`` view (time on the width axis; no copy)."""
    return x.unsqueeze(1).permute(0, 3, 1, 2)


def _uncl(y: torch.Tensor) -> torch.Tensor:
    """The inverse view of :func:`_cl`: ``[B, C, 1, T]`` -> ``[B, T, C]``."""
    return y.permute(0, 2, 3, 1).squeeze(1)


def _pad_time(x: torch.Tensor, k1: int, left: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, T, C]`` -> ``[B, k1 + T, C]``: the last ``k1`` positions of ``left`` ``[B, L, C]`` (zeros when None) first."""
    if k1 == 0:
        return x
    if left is None:
        return F.pad(x, (0, 0, k1, 0))
    return torch.cat([left[:, left.shape[1] - k1 :].to(x.dtype), x], dim=1)


def _conv_padded(xp: torch.Tensor, w: torch.Tensor, T: int) -> torch.Tensor:
    """``y[b, t, c] = Σ_j w[c, j] · xp[b, t + j + o, c]`` for t < T, with ``o = xp.shape[1] - (T + k - 1)``.

    ``xp`` ``[B, ≥T+k-1, C]`` (left padded), ``w`` ``[C, k]`` in xp's dtype. Returns ``[B, T, C]``.
    """
    C, k = w.shape
    xp = xp[:, xp.shape[1] - (T + k - 1) :]
    if _pointwise() or T == 0 or xp.shape[0] == 0:
        y = xp[:, k - 1 :] * w[:, k - 1]
        for j in range(k - 1):
            y = y + xp[:, j : j + T] * w[:, j]
        return y
    if xp.shape[0] * T * C * k <= _UNFOLD_MAX:  # a few positions (a decoding step): one multiply and one sum
        return (xp.unfold(1, k, 1) * w).sum(-1)
    return _uncl(F.conv2d(_cl(xp), w.reshape(C, 1, 1, k), groups=C))


#: up to this many multiply-adds an eager conv is ``(windows * w).sum(-1)``: 9-43 µs where oneDNN's depthwise call
#: costs ~43 µs whatever the size (2-core EPYC, one thread, 2026-12-05; the two meet near 60k)
_UNFOLD_MAX = 32768


def _conv_padded_backward(dy: torch.Tensor, xp: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`_conv_padded` ``(dx, dw)``: ``dx`` ``[B, T, C]`` for the last T positions of ``xp`` only
    (the padding's gradient is dropped), ``dw`` ``[C, k]``. ``dy`` ``[B, T, C]``."""
    C, k = w.shape
    T = dy.shape[1]
    xp = xp[:, xp.shape[1] - (T + k - 1) :]
    if _pointwise() or T == 0 or xp.shape[0] == 0:
        # y[t] = Σ_j w_j xp[t + j]  =>  dx[s] = Σ_j w_j dy[s + k-1-j] (zero past T), dw_j = Σ dy[t] xp[t + j]
        dyp = F.pad(dy, (0, 0, 0, k - 1))
        dx = dyp[:, :T] * w[:, k - 1]
        for j in range(k - 1):
            dx = dx + dyp[:, k - 1 - j : k - 1 - j + T] * w[:, j]
        dw = torch.stack([(dy * xp[:, j : j + T]).sum((0, 1)) for j in range(k)], dim=-1)
        return dx, dw
    gx, gw, _ = torch.ops.aten.convolution_backward(
        _cl(dy), _cl(xp), w.reshape(C, 1, 1, k), None, [1, 1], [0, 0], [1, 1], False, [0, 0], C, [True, True, False]
    )
    return _uncl(gx)[:, k - 1 :], gw.reshape(C, k)


def causal_depthwise_conv(x: torch.Tensor, w: torch.Tensor, left: torch.Tensor | None = None) -> torch.Tensor:
    """``y[..., t, c] = Σ_τ w[c, k-1-τ] · x[..., t-τ, c]`` with zeros before the start (or ``left`` context).

    Args:
        x (Tensor): ``[..., T, d]``.
        w (Tensor): ``[d, k]`` taps, the last one on the current token.
        left (Tensor, optional): ``[..., k-1, d]`` earlier positions (the decoding state); zeros when None.
    """
    d, k = w.shape
    lead, T = x.shape[:-2], x.shape[-2]
    xs = x.reshape(-1, T, d)
    ls = None if left is None else left.reshape(-1, left.shape[-2], d)
    y = _conv_padded(_pad_time(xs, k - 1, ls), w.to(x.dtype), T)
    return y.reshape(*lead, T, d)


# ---- the mix -----------------------------------------------------------------------------------------------------


def _stack(sources: list[torch.Tensor] | torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``[K·B, T, D]`` in ``acc``: the sources stacked along a new leading axis (one copy; the cast is free for fp32).
    ``sources`` may be stacked already (a tensor ``[K, ..., T, D]``: ``msar_mix_stack``'s decomposition)."""
    T, D = sources[0].shape[-2:]
    stacked = sources if isinstance(sources, torch.Tensor) else torch.stack(sources, dim=0)
    return stacked.to(acc).reshape(-1, T, D)


def _count(sources: list[torch.Tensor] | torch.Tensor) -> int:
    """K: how many sources (a stacked tensor's first size, which may be a dynamic one)."""
    return sources.shape[0] if isinstance(sources, torch.Tensor) else len(sources)


def _stream_views(sources, conv, acc, left=None):
    """``(X, Xp, views)``: the stack ``[K·B, T, D]``, its left-padded copy (k_max-1 positions of zeros or ``left``;
    None without convs) and the m views ``[X, conv_1(X), ...]``."""
    X = _stack(sources, acc)
    T, D = X.shape[-2:]
    k1 = max((w.shape[-1] for w in conv), default=1) - 1
    Xp = None
    if conv:
        Lx = _stack(left, acc) if left is not None else None
        Xp = _pad_time(X, k1, Lx)
    return X, Xp, [X] + [_conv_padded(Xp, w.to(acc), T) for w in conv]


def _scores(V: torch.Tensor, u: torch.Tensor, eps: float, K: int):
    """Per source and token: ``(rs, dt, a)`` = key rsqrt-RMS, ``u·V`` and the depth softmax, each ``[K, B·T]``."""
    D = V.shape[-1]
    rs = torch.rsqrt(torch.linalg.vector_norm(V, dim=-1).square() / D + eps).reshape(K, -1)
    dt = (V.reshape(-1, D) @ u).reshape(K, -1)
    return rs, dt, torch.softmax(dt * rs, dim=0)


def _weighted(a: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """``Σ_i a_i Y_i``: ``a`` ``[K, B·T]``, ``Y`` ``[K·B, T, D]`` -> ``[B·T, D]``."""
    K = a.shape[0]
    return (a.unsqueeze(-1) * Y.reshape(K, -1, Y.shape[-1])).sum(0)


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
        sources (list[Tensor]): K tensors ``[..., T, D]`` (T: sequence), one shape and dtype (or them stacked,
            ``[K, ..., T, D]``).
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
    lead, (T, D) = sources[0].shape[:-2], sources[0].shape[-2:]
    K, m = _count(sources), query.shape[0]
    u = gain.to(acc) * query.to(acc)  # [m, D]
    # a no-grad call (decoding, evaluation): not the forward of a training step, which runs the registered op with
    # grad mode off inside it but sources that require grad (its backward recomputes the loop below)
    stacked = isinstance(sources, torch.Tensor)
    if (not stacked and not torch.is_grad_enabled() and not any(s.requires_grad for s in sources) and not _pointwise()
            and m * K * sources[0].numel() <= _SMALL_MIX):
        Zs = _streams_at_once(sources, u, conv, acc, eps, conv_values, left)
    else:
        X, _, V = _stream_views(sources, conv, acc, left)
        Z = []
        for r in range(m):
            _, _, a = _scores(V[r], u[r], eps, K)
            Z.append(_weighted(a, V[r] if conv_values else X))  # [B·T, D]
        Zs = torch.stack(Z, dim=-2)  # [B·T, m, D]
    h = _mixed(Zs, phi, bias, alpha, sigmoid_mixer, eps_mix, acc)
    return (h.reshape(*lead, T, D) * scale).to(sources[0].dtype)  # a tensor of its own, not a view (FSDP2 warns)


#: up to this many elements in all stream views (m·K·B·T·D) a no-grad eager call computes every stream at once
#: (a decoding step: ~40 ops where the loop over streams runs ~100, each a few µs at this size)
SMALL_MIX = 1 << 16
_SMALL_MIX = SMALL_MIX  # the bound in force (bench/generation.py --ab fast-paths sets 0)


def _streams_at_once(sources, u, conv, acc, eps: float, conv_values: bool, left) -> torch.Tensor:
    """The m streams' ``Z`` ``[B·T, m, D]`` of :func:`msar_mix_ref` in one pass over a ``[m, K, B·T, D]`` stack of
    the views (every conv a window sum with its taps left-padded to the longest filter), for a few positions."""
    K = len(sources)
    X = _stack(sources, acc)  # [K·B, T, D]
    T, D = X.shape[-2:]
    views = X.unsqueeze(0)
    if conv:
        k = max(w.shape[-1] for w in conv)
        Xp = _pad_time(X, k - 1, _stack(left, acc) if left is not None else None)
        W = torch.stack([F.pad(w.to(acc), (k - w.shape[-1], 0)) for w in conv])  # [m-1, D, k]
        Y = (Xp[:, Xp.shape[1] - (T + k - 1):].unfold(1, k, 1).unsqueeze(0) * W[:, None, None]).sum(-1)
        views = torch.cat([views, Y])  # [m, K·B, T, D]
    m = views.shape[0]
    Vs = views.reshape(m, K, -1, D)  # [m, K, B·T, D]
    rs = torch.rsqrt(torch.linalg.vector_norm(Vs, dim=-1).square() / D + eps)  # [m, K, B·T]
    dt = (Vs.reshape(m, -1, D) @ u.unsqueeze(-1)).reshape(m, K, -1)
    a = torch.softmax(dt * rs, dim=1)
    values = Vs if conv_values else X.reshape(1, K, -1, D)
    return (a.unsqueeze(-1) * values).sum(1).transpose(0, 1)  # [B·T, m, D]


def _mixed(Zs: torch.Tensor, phi, bias, alpha, sigmoid_mixer: bool, eps_mix: float, acc: torch.dtype) -> torch.Tensor:
    """``Σ_r g_r Z^(r)`` ``[B·T, D]`` from the streams ``Zs`` ``[B·T, m, D]``: the sigmoid mixer or the mean."""
    m = Zs.shape[-2]
    if sigmoid_mixer:
        z = Zs.flatten(-2)
        z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps_mix)
        g = torch.sigmoid(alpha.to(acc).reshape(()) * (z @ phi.to(acc)) + bias.to(acc))  # [B·T, m]
        h = (g.unsqueeze(-1) * Zs).sum(-2)
    else:
        h = Zs.sum(-2) * (1.0 / m)
    return h
