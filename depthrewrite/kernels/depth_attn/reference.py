"""Depth attention (the AttnRes mix), pure PyTorch. The one docstring of the op lives here.

    u      = gain ⊙ query                                   # [d]
    r_i    = (mean_c(v_i²) + eps)^(-1/2)                    # per source, per token
    s_i    = (v_i · u) · r_i                                # plain dot product, no 1/sqrt(d)
    α      = softmax_i(s)                                   # over the K sources (depth)
    h      = scale · Σ_i α_i v_i                            # scale = K ("count") or 1 ("mean", paper-literal)

Kimi Team, *Attention Residuals*, arXiv:2603.15031, Eq. 2-4. All statistics, the softmax and the weighted sum are in
fp32; the result is cast back to the sources' dtype once.

How it is computed: the K sources are stacked once into ``[M, K, D]`` (M: the flattened leading dims, K next to the
row), so the key norms are one vector norm, the scores one matrix-vector product and the weighted sum one batched
``[1, K] @ [K, D]`` product per token (no ``[K, ..., D]`` temporaries). A small call with gradients off (a decoding
step: one token, a few sources) runs :func:`depth_attn_rows` instead, the same formula in half the tensor operations,
each of which costs more there than its arithmetic.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F  # noqa: N812

__all__ = ["depth_attn_ref", "depth_attn_partial_ref", "depth_attn_merge_ref"]


def _stack(sources: list[torch.Tensor], acc: torch.dtype) -> torch.Tensor:
    """``[M, K, D]`` in ``acc``: the sources stacked next to their rows (one copy; the cast is free for fp32)."""
    D = sources[0].shape[-1]
    return torch.stack(sources, dim=-2).to(acc).reshape(math.prod(sources[0].shape[:-1]), len(sources), D)


def _rsqrt_rms(v: torch.Tensor, eps: float) -> torch.Tensor:
    """``(mean_c(v²) + eps)^(-1/2)`` over the last dim, from one norm reduction (no squared temporary)."""
    return torch.rsqrt(torch.linalg.vector_norm(v, dim=-1).square() / v.shape[-1] + eps)


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
    v = _stack(sources, acc)  # [M, K, D]
    M, K, D = v.shape
    u = gain.to(acc) * query.to(acc)  # [D]
    s = (v.reshape(M * K, D) @ u).reshape(M, K) * _rsqrt_rms(v, eps)  # [M, K]
    a = torch.softmax(s, dim=-1)
    # reshaped before the scale, so the result is a tensor of its own, not a view (a block returning a view makes
    # FSDP2 warn that an in-place op on it would skip its all-gather)
    h = (a.unsqueeze(-2) @ v).reshape(sources[0].shape) * scale
    return h.to(sources[0].dtype)


def depth_attn_rows(rows: torch.Tensor, query: torch.Tensor, gain: torch.Tensor, eps: float, scale: float,
                    shape: torch.Size) -> torch.Tensor:
    """:func:`depth_attn_ref` of the sources stacked along the first axis, ``rows`` ``[K, ..., D]`` (fp32 or fp64),
    returned as ``shape``: the same formula in fewer, larger tensor operations (the K sources already one tensor, no
    ``[M, K, D]`` copy), for calls of a few tokens where each operation costs more than its arithmetic (a decoding
    step: see :func:`small_call`). Equal to the reference to rounding (the norms and sums run in another order)."""
    K, D = rows.shape[0], rows.shape[-1]
    v = rows.reshape(K, -1, D)  # [K, M, D]
    # the keys RMS-normed with their gain in one op: s = (γ ⊙ w) · v · r
    a = torch.softmax(F.rms_norm(v, (D,), gain, eps) @ query, dim=0)  # [K, M]
    if v.shape[1] == 1:  # one token: one vector-matrix product
        h = (a.reshape(K) @ v.reshape(K, D)).reshape(shape)
    else:
        h = (a.t().unsqueeze(1) @ v.transpose(0, 1)).reshape(shape)  # [M, 1, K] @ [M, K, D]
    return (h * scale).to(rows.dtype)  # the sources' dtype (under autocast the products are not); not a view


#: up to this many source elements (K · tokens · D) an eager call on plain CPU tensors that need no gradient runs
#: :func:`depth_attn_rows` (a decoding step: one token, a few sources)
SMALL_ROWS = 1 << 14


def small_call(sources: list[torch.Tensor], query: torch.Tensor, gain: torch.Tensor) -> bool:
    """Whether a depth-attention call on ``sources`` is a small no-grad eager one for :func:`depth_attn_rows`: fp32
    CPU tensors, at most :data:`SMALL_ROWS` source elements in all, gradients off and no source requiring one (a
    registered op's forward in a training step also runs with gradients off, on sources that require them: it keeps
    the reference, which its backward recomputes; a step whose sources are all frozen runs this path forward, equal
    to the reference to rounding), not traced."""
    t = sources[0]
    return (
        t.device.type == "cpu" and t.dtype == query.dtype == gain.dtype == torch.float32
        and sum(x.numel() for x in sources) <= SMALL_ROWS
        and not torch.is_grad_enabled() and not any(x.requires_grad for x in sources)
        and not torch.compiler.is_compiling()
    )


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
    v = _stack(sources, acc)  # [M, K, D]
    M, K, D = v.shape
    S = queries.shape[0]
    u = gains.to(acc) * queries.to(acc)  # [S, D]
    s = (v.reshape(M * K, D) @ u.t()).reshape(M, K, S) * _rsqrt_rms(v, eps).unsqueeze(-1)  # [M, K, S]
    lse = torch.logsumexp(s, dim=1)  # [M, S]
    p = torch.softmax(s, dim=1)
    o = p.transpose(1, 2) @ v  # [M, S, D]
    lead = sources[0].shape[:-1]
    # contiguous [S, ...], like the kernel's outputs and the fake
    return o.transpose(0, 1).reshape(S, *lead, D).contiguous(), lse.t().reshape(S, *lead).contiguous()


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
    s2 = (v @ u) * _rsqrt_rms(v, eps)
    lse = lse.to(acc)
    m = torch.maximum(lse, s2)
    a, b = torch.exp(lse - m), torch.exp(s2 - m)
    wa, wb = a / (a + b), b / (a + b)
    h = torch.addcmul(wb.unsqueeze(-1) * v, wa.unsqueeze(-1), o.to(acc))
    return (h * scale).to(last.dtype)
