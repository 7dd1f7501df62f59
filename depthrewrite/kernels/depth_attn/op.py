"""``depthrewrite::depth_attn`` and the two-phase pair ``depth_attn_partial`` / ``depth_attn_merge`` as registered ops.

One node per mixing site in exported and compiled graphs; the ops are documented once, in :mod:`.reference`. Each
op body dispatches with :func:`~depthrewrite.kernels.dispatch.route`: the fused Triton kernel (:mod:`.fused`,
imported lazily) when the backend picks Triton and the gate :func:`.limits.covers` (:func:`.limits.covers_merge`)
takes the call, the PyTorch reference (:mod:`.reference`) otherwise. Each backward is its own registered op
(``depthrewrite::depth_attn_backward``, ``…_partial_backward``, ``…_merge_backward``), called from the registered
autograd formula, so a compiled backward graph shows one opaque node per site; it dispatches the same way, to the
Triton backward or to the reference formulas below. Nothing but the inputs is saved for backward: scores and
softmax weights are recomputed from the sources.
"""

from __future__ import annotations

import torch

from .._triton_utils import acc_dtype as _acc_dtype
from ..dispatch import KernelInfo, register_kernel_info, route
from .limits import MAX_ROW, MAX_SOURCES, covers, covers_merge
from .reference import depth_attn_merge_ref, depth_attn_partial_ref, depth_attn_ref, depth_attn_rows, small_call

__all__ = ["depth_attn", "depth_attn_stack", "depth_attn_partial", "depth_attn_merge", "MAX_SOURCES", "MAX_ROW", "covers",
           "covers_merge"]

# ---- reference backward formulas (attnres spec §9), used when the Triton kernel does not run ------------------------


def _partial_backward_ref(grad_o, grad_lse, sources, queries, gains, eps) -> list[torch.Tensor]:
    """Gradients of ``(o, lse) = depth_attn_partial_ref(sources, queries, gains, eps)``.

    ``grad_o`` ``[S, ..., D]``, ``grad_lse`` ``[S, ...]`` or ``None``. Returns
    ``[grad_queries, grad_gains, *grad_sources]``. With ``p = softmax_i(s)``:
    ``ds_{s,i} = p_{s,i}(go_s·v_i − go_s·o_s + glse_s)``;
    ``dv_i = Σ_s p_{s,i} go_s + r_i Σ_s ds_{s,i} u_s − (r_i²/D)(Σ_s ds_{s,i} s_{s,i}) v_i``;
    ``du_s = Σ_tokens Σ_i ds_{s,i} r_i v_i``, ``dw = γ ⊙ du``, ``dγ = w ⊙ du``.

    Same layout as the reference: the sources stacked as ``[M, K, D]``; scores, ``go·v`` and ``du`` are (batched)
    matrix products, each source's gradient is its own tensor. Functional (no in-place writes): the compile backend
    traces it as a decomposition (:mod:`depthrewrite.kernels.decompose`).
    """
    from .reference import _rsqrt_rms, _stack  # the reference's stacking and key-norm statistics

    acc = _acc_dtype(sources[0])
    v = _stack(sources, acc)  # [M, K, D]
    M, K, D = v.shape
    S = queries.shape[0]
    u = gains.to(acc) * queries.to(acc)  # [S, D]
    r = _rsqrt_rms(v, eps)  # [M, K]
    s = (v.reshape(M * K, D) @ u.t()).reshape(M, K, S) * r.unsqueeze(-1)  # [M, K, S]
    p = torch.softmax(s, dim=1)
    go = grad_o.to(acc).reshape(S, M, D)
    gv = v @ go.permute(1, 2, 0)  # [M, K, S]: go_s·v_i
    inner = gv - (p * gv).sum(1, keepdim=True)
    if grad_lse is not None:
        inner = inner + grad_lse.to(acc).reshape(S, 1, M).permute(2, 1, 0)
    ds = p * inner
    cu = ds * r.unsqueeze(-1)  # [M, K, S]
    cv = r * r / D * (ds * s).sum(-1)  # [M, K]
    du = cu.reshape(M * K, S).t() @ v.reshape(M * K, D)  # [S, D]
    gq = (gains.to(acc) * du).to(queries.dtype)
    gg = (queries.to(acc) * du).to(gains.dtype)
    gs = []
    shape = sources[0].shape
    for i, src in enumerate(sources):  # one tensor per source: outputs of a custom op may not alias each other
        dv = cu[:, i] @ u  # [M, D]
        dv = torch.addcmul(dv, cv[:, i].unsqueeze(-1), v[:, i], value=-1.0)
        for j in range(S):
            dv = torch.addcmul(dv, p[:, i, j].unsqueeze(-1), go[j])
        gs.append(dv.reshape(shape).to(src.dtype))
    return [gq, gg, *gs]


def _backward_ref(grad, sources, query, gain, eps, scale) -> list[torch.Tensor]:
    """Gradients of ``depth_attn_ref``, ``[grad_query, grad_gain, *grad_sources]``: the two-phase partial's backward
    with one query (``S = 1``), the scale folded into the incoming gradient and no log-sum-exp gradient."""
    gq, gg, *gs = _partial_backward_ref(
        grad.unsqueeze(0) * scale, None, sources, query.unsqueeze(0), gain.unsqueeze(0), eps
    )
    return [gq[0], gg[0], *gs]


def _merge_backward_ref(grad, o, lse, last, query, gain, eps, scale) -> list[torch.Tensor]:
    """Gradients of ``depth_attn_merge_ref``: ``[grad_o, grad_lse, grad_last, grad_query, grad_gain]``.

    With ``w1 = σ(lse − s2)``, ``w2 = 1 − w1``, ``ĝ = scale·grad`` and ``t = w1·w2·ĝ·(v − o)``:
    ``grad_o = w1·ĝ``, ``grad_lse = −t``, ``grad_last = w2·ĝ + t·r·(u − s2·r·v/D)``, ``du = Σ_tokens t·r·v``.
    """
    from .reference import _rsqrt_rms

    acc = _acc_dtype(last)
    D = last.shape[-1]
    v = last.to(acc)
    u = gain.to(acc) * query.to(acc)
    r = _rsqrt_rms(v, eps)
    s2 = (v @ u) * r
    w1 = torch.sigmoid(lse.to(acc) - s2)
    w2 = 1 - w1
    g = grad.to(acc)
    t = w1 * w2 * scale * (g * (v - o.to(acc))).sum(-1)
    cr = t * r
    dv = torch.addcmul((cr * s2 * r / -D).unsqueeze(-1) * v, cr.unsqueeze(-1), u)
    dv = torch.addcmul(dv, (w2 * scale).unsqueeze(-1), g)
    du = cr.reshape(1, -1) @ v.reshape(-1, D)
    return [
        ((w1 * scale).unsqueeze(-1) * g).to(o.dtype),
        (-t).to(lse.dtype),
        dv.to(last.dtype),
        (gain.to(acc) * du.reshape(D)).to(query.dtype),
        (query.to(acc) * du.reshape(D)).to(gain.dtype),
    ]


# ---- depthrewrite::depth_attn ---------------------------------------------------------------------------------------


@torch.library.custom_op("depthrewrite::depth_attn", mutates_args=())
def depth_attn(sources: list[torch.Tensor], query: torch.Tensor, gain: torch.Tensor, eps: float, scale: float) -> torch.Tensor:
    return _depth_attn(sources, query, gain, eps, scale)


def _depth_attn(sources, query, gain, eps, scale):
    if route(
        "depthrewrite::depth_attn", (*sources, query, gain), lambda: covers(sources, query, gain, whole_row=True)
    ):
        from . import fused

        return fused.depth_attn_fwd(sources, query, gain, eps, scale)
    if small_call(sources, query, gain):
        return depth_attn_rows(torch.stack(sources), query, gain, eps, scale, sources[0].shape)
    return depth_attn_ref(sources, query, gain, eps, scale)


@depth_attn.register_fake
def _(sources, query, gain, eps, scale):
    return torch.empty_like(sources[0])


@torch.library.custom_op("depthrewrite::depth_attn_backward", mutates_args=())
def depth_attn_backward(
    grad: torch.Tensor, sources: list[torch.Tensor], query: torch.Tensor, gain: torch.Tensor, eps: float, scale: float
) -> list[torch.Tensor]:
    """``[grad_query, grad_gain, *grad_sources]`` of ``depth_attn`` (recomputes the forward's scores and weights)."""
    return _depth_attn_backward(grad, sources, query, gain, eps, scale)


def _depth_attn_backward(grad, sources, query, gain, eps, scale):
    if route(
        "depthrewrite::depth_attn_backward", (grad, *sources, query, gain), lambda: covers(sources, query, gain, grad)
    ):
        from . import fused

        return fused.depth_attn_bwd(grad, sources, query, gain, eps, scale)
    return _backward_ref(grad, sources, query, gain, eps, scale)


@depth_attn_backward.register_fake
def _(grad, sources, query, gain, eps, scale):
    return [torch.empty_like(query), torch.empty_like(gain), *[torch.empty_like(s) for s in sources]]


def _setup_context(ctx, inputs, output):
    sources, query, gain, eps, scale = inputs
    ctx.save_for_backward(query, gain, *sources)
    ctx.eps, ctx.scale = eps, scale


def _backward(ctx, grad):
    query, gain, *sources = ctx.saved_tensors
    gq, gg, *gs = depth_attn_backward(grad, sources, query, gain, ctx.eps, ctx.scale)
    return list(gs), gq, gg, None, None


depth_attn.register_autograd(_backward, setup_context=_setup_context)


# ---- depthrewrite::depth_attn_stack: the same mix, its earlier sources one stacked tensor ------------------------------
#
# A block program reads its block's earlier sources as one tensor ``stack`` ``[n, ...]`` (rows of a buffer the
# converted model fills once per forward, :func:`depthrewrite.blocks.source_stack`) and the sources it makes itself
# as ``extra``: blocks that differ only in how many earlier sources they read then run one program, whose compiled
# graph takes ``n`` as a dynamic size. ``depth_attn_stack(stack, extra, w, γ, eps, scale, per_source)`` equals
# ``depth_attn([*stack, *extra], w, γ, eps, scale · K if per_source else scale)`` with ``K = n + len(extra)``.


def _stack_scale(stack: torch.Tensor, extra: list[torch.Tensor], scale: float, per_source: bool) -> float:
    return scale * (stack.shape[0] + len(extra)) if per_source else scale


@torch.library.custom_op("depthrewrite::depth_attn_stack", mutates_args=())
def depth_attn_stack(stack: torch.Tensor, extra: list[torch.Tensor], query: torch.Tensor, gain: torch.Tensor,
                     eps: float, scale: float, per_source: bool) -> torch.Tensor:
    if route("depthrewrite::depth_attn_stack", (stack, *extra, query, gain),
             lambda: covers([stack, *extra], query, gain, whole_row=True)):
        from . import fused

        return fused.depth_attn_fwd([*stack.unbind(0), *extra], query, gain, eps,
                                    _stack_scale(stack, extra, scale, per_source))
    if small_call([stack, *extra], query, gain):  # a decoding step: the stack's rows as they are
        rows = torch.cat([stack, *(e.unsqueeze(0) for e in extra)]) if extra else stack
        return depth_attn_rows(rows, query, gain, eps, _stack_scale(stack, extra, scale, per_source), stack.shape[1:])
    # depth_attn's own reference on the rows (the same bits as before the stack); the compile backend traces
    # depth_attn_stack_ref instead (no Python loop over a dynamic size)
    return depth_attn_ref([*stack.unbind(0), *extra], query, gain, eps, _stack_scale(stack, extra, scale, per_source))


@depth_attn_stack.register_fake
def _(stack, extra, query, gain, eps, scale, per_source):
    return stack.new_empty(stack.shape[1:])


@torch.library.custom_op("depthrewrite::depth_attn_stack_backward", mutates_args=())
def depth_attn_stack_backward(grad: torch.Tensor, stack: torch.Tensor, extra: list[torch.Tensor], query: torch.Tensor,
                              gain: torch.Tensor, eps: float, scale: float, per_source: bool) -> list[torch.Tensor]:
    """``[grad_stack, grad_query, grad_gain, *grad_extra]`` of ``depth_attn_stack``."""
    fused = route("depthrewrite::depth_attn_stack_backward", (grad, stack, *extra, query, gain),
                  lambda: covers([stack, *extra], query, gain, grad))
    sources, n = [*stack.unbind(0), *extra], stack.shape[0]
    if fused:
        from .fused import depth_attn_bwd

        gq, gg, *gs = depth_attn_bwd(grad, sources, query, gain, eps, _stack_scale(stack, extra, scale, per_source))
    else:
        gq, gg, *gs = _backward_ref(grad, sources, query, gain, eps, _stack_scale(stack, extra, scale, per_source))
    return [torch.stack(gs[:n]) if n else torch.zeros_like(stack), gq, gg, *gs[n:]]


@depth_attn_stack_backward.register_fake
def _(grad, stack, extra, query, gain, eps, scale, per_source):
    return [torch.empty_like(stack), torch.empty_like(query), torch.empty_like(gain), *[torch.empty_like(e) for e in extra]]


def _stack_setup_context(ctx, inputs, output):
    stack, extra, query, gain, eps, scale, per_source = inputs
    ctx.save_for_backward(stack, query, gain, *extra)
    ctx.args = (eps, scale, per_source)


def _stack_backward(ctx, grad):
    stack, query, gain, *extra = ctx.saved_tensors
    gstack, gq, gg, *ge = depth_attn_stack_backward(grad, stack, extra, query, gain, *ctx.args)
    return gstack, list(ge), gq, gg, None, None, None


depth_attn_stack.register_autograd(_stack_backward, setup_context=_stack_setup_context)


def depth_attn_stack_ref(stack: torch.Tensor, extra: list[torch.Tensor], query: torch.Tensor, gain: torch.Tensor,
                         eps: float, scale: float, per_source: bool) -> torch.Tensor:
    """``depth_attn_ref`` of the sources ``[*stack, *extra]`` as tensor operations on the stack (no Python loop over a
    size that may be dynamic): what the compile backend traces for inductor."""
    from .reference import _rsqrt_rms

    acc = torch.promote_types(stack.dtype, torch.float32)
    v, shape = _stacked_rows(stack, extra, acc)  # [M, K, D]
    M, K, D = v.shape
    u = gain.to(acc) * query.to(acc)
    s = (v @ u) * _rsqrt_rms(v, eps)  # [M, K]
    a = torch.softmax(s, dim=-1)
    h = (a.unsqueeze(-2) @ v).reshape(shape) * (scale * K if per_source else scale)
    return h.to(stack.dtype)


def _stacked_rows(stack: torch.Tensor, extra: list[torch.Tensor], acc: torch.dtype) -> tuple[torch.Tensor, tuple]:
    shape = stack.shape[1:]
    D = shape[-1]
    parts = [stack.to(acc).reshape(stack.shape[0], -1, D)]
    parts += [e.to(acc).reshape(1, -1, D) for e in extra]
    return torch.cat(parts).transpose(0, 1), shape  # [M, K, D]


def _stack_backward_ref(grad, stack, extra, query, gain, eps, scale, per_source) -> list[torch.Tensor]:
    """Gradients of :func:`depth_attn_stack_ref`, ``[grad_stack, grad_query, grad_gain, *grad_extra]``: the one-query
    case of :func:`_partial_backward_ref` with every source's gradient computed at once."""
    from .reference import _rsqrt_rms

    acc = torch.promote_types(stack.dtype, torch.float32)
    v, shape = _stacked_rows(stack, extra, acc)
    M, K, D = v.shape
    u = gain.to(acc) * query.to(acc)
    r = _rsqrt_rms(v, eps)  # [M, K]
    s = (v @ u) * r
    p = torch.softmax(s, dim=-1)
    go = grad.to(acc).reshape(M, D) * (scale * K if per_source else scale)
    gv = (v @ go.unsqueeze(-1)).squeeze(-1)  # [M, K]: go·v_i
    ds = p * (gv - (p * gv).sum(-1, keepdim=True))
    cu = ds * r
    cv = r * r / D * ds * s
    du = cu.reshape(1, M * K) @ v.reshape(M * K, D)  # [1, D]
    n = stack.shape[0]

    def dv(i: slice | int) -> torch.Tensor:  # dv_i = cu_i u − cv_i v_i + p_i go, each output a tensor of its own
        return cu[:, i, None] * u - cv[:, i, None] * v[:, i] + p[:, i, None] * (go[:, None] if isinstance(i, slice) else go)

    gstack = dv(slice(0, n)).transpose(0, 1).contiguous().reshape(stack.shape).to(stack.dtype)
    # the extra rows counted from the end: a plain int index, not the symbolic n + i (which would specialise the
    # stack's row count and compile one program per block)
    ge = [dv(i - len(extra)).reshape(shape).to(e.dtype) for i, e in enumerate(extra)]
    return [gstack, (gain.to(acc) * du.reshape(D)).to(query.dtype), (query.to(acc) * du.reshape(D)).to(gain.dtype), *ge]


# ---- depthrewrite::depth_attn_partial (two-phase, phase 1) -----------------------------------------------------------


@torch.library.custom_op("depthrewrite::depth_attn_partial", mutates_args=())
def depth_attn_partial(
    sources: list[torch.Tensor], queries: torch.Tensor, gains: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if route(
        "depthrewrite::depth_attn_partial", (*sources, queries, gains), lambda: covers(sources, queries, gains)
    ):
        from . import fused

        return fused.depth_attn_partial_fwd(sources, queries, gains, eps)
    return depth_attn_partial_ref(sources, queries, gains, eps)


@depth_attn_partial.register_fake
def _(sources, queries, gains, eps):
    x = sources[0]
    acc = _acc_dtype(x)
    S = queries.shape[0]
    return x.new_empty((S, *x.shape), dtype=acc), x.new_empty((S, *x.shape[:-1]), dtype=acc)


@torch.library.custom_op("depthrewrite::depth_attn_partial_backward", mutates_args=())
def depth_attn_partial_backward(
    grad_o: torch.Tensor,
    grad_lse: torch.Tensor,
    sources: list[torch.Tensor],
    queries: torch.Tensor,
    gains: torch.Tensor,
    eps: float,
) -> list[torch.Tensor]:
    """``[grad_queries, grad_gains, *grad_sources]`` of ``depth_attn_partial``."""
    if route(
        "depthrewrite::depth_attn_partial_backward",
        (grad_o, grad_lse, *sources, queries, gains),
        lambda: covers(sources, queries, gains, grad_o, grad_lse),
    ):
        from . import fused

        return fused.depth_attn_partial_bwd(grad_o, grad_lse, sources, queries, gains, eps)
    return _partial_backward_ref(grad_o, grad_lse, sources, queries, gains, eps)


@depth_attn_partial_backward.register_fake
def _(grad_o, grad_lse, sources, queries, gains, eps):
    return [torch.empty_like(queries), torch.empty_like(gains), *[torch.empty_like(s) for s in sources]]


def _partial_setup_context(ctx, inputs, output):
    sources, queries, gains, eps = inputs
    ctx.save_for_backward(queries, gains, *sources)
    ctx.eps = eps


def _partial_backward(ctx, grad_o, grad_lse):
    queries, gains, *sources = ctx.saved_tensors
    x = sources[0]
    S = queries.shape[0]
    if grad_o is None:
        grad_o = x.new_zeros((S, *x.shape), dtype=_acc_dtype(x))
    if grad_lse is None:
        grad_lse = x.new_zeros((S, *x.shape[:-1]), dtype=_acc_dtype(x))
    gq, gg, *gs = depth_attn_partial_backward(grad_o, grad_lse, sources, queries, gains, ctx.eps)
    return list(gs), gq, gg, None


depth_attn_partial.register_autograd(_partial_backward, setup_context=_partial_setup_context)


# ---- depthrewrite::depth_attn_merge (two-phase, phase 2) -------------------------------------------------------------


@torch.library.custom_op("depthrewrite::depth_attn_merge", mutates_args=())
def depth_attn_merge(
    o: torch.Tensor,
    lse: torch.Tensor,
    last: torch.Tensor,
    query: torch.Tensor,
    gain: torch.Tensor,
    eps: float,
    scale: float,
) -> torch.Tensor:
    if route(
        "depthrewrite::depth_attn_merge", (o, lse, last, query, gain), lambda: covers_merge(o, lse, last, query, gain)
    ):
        from . import fused

        return fused.depth_attn_merge_fwd(o, lse, last, query, gain, eps, scale)
    return depth_attn_merge_ref(o, lse, last, query, gain, eps, scale)


@depth_attn_merge.register_fake
def _(o, lse, last, query, gain, eps, scale):
    return torch.empty_like(last)


@torch.library.custom_op("depthrewrite::depth_attn_merge_backward", mutates_args=())
def depth_attn_merge_backward(
    grad: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    last: torch.Tensor,
    query: torch.Tensor,
    gain: torch.Tensor,
    eps: float,
    scale: float,
) -> list[torch.Tensor]:
    """``[grad_o, grad_lse, grad_last, grad_query, grad_gain]`` of ``depth_attn_merge``."""
    if route(
        "depthrewrite::depth_attn_merge_backward",
        (grad, o, lse, last, query, gain),
        lambda: covers_merge(o, lse, last, query, gain, grad),
    ):
        from . import fused

        return fused.depth_attn_merge_bwd(grad, o, lse, last, query, gain, eps, scale)
    return _merge_backward_ref(grad, o, lse, last, query, gain, eps, scale)


@depth_attn_merge_backward.register_fake
def _(grad, o, lse, last, query, gain, eps, scale):
    return [torch.empty_like(t) for t in (o, lse, last, query, gain)]


def _merge_setup_context(ctx, inputs, output):
    o, lse, last, query, gain, eps, scale = inputs
    ctx.save_for_backward(o, lse, last, query, gain)
    ctx.eps, ctx.scale = eps, scale


def _merge_backward(ctx, grad):
    o, lse, last, query, gain = ctx.saved_tensors
    go, glse, glast, gq, gg = depth_attn_merge_backward(grad, o, lse, last, query, gain, ctx.eps, ctx.scale)
    return go, glse, glast, gq, gg, None, None


depth_attn_merge.register_autograd(_merge_backward, setup_context=_merge_setup_context)


# ---- what the kernels do, for explain() and the docs -----------------------------------------------------------------

register_kernel_info(
    KernelInfo(
        op="depthrewrite::depth_attn",
        forward="fused.depth_attn_fwd_kernel: one program per token block, whole row on chip, online softmax over "
        "the sources",
        backward="depthrewrite::depth_attn_backward -> fused.depth_attn_bwd_kernel_multi (S = 1): persistent, "
        "recomputes scores/weights from the sources, writes every source's gradient; query/gain gradients from "
        "per-program fp32 rows summed with torch",
        fuses="key RMS statistics, K scores, softmax, weighted sum and scale in one read of each source (the reference "
        "stacks the sources into an fp32 copy and reads it several times)",
        falls_back=f"fp64 or mixed-dtype sources, or a non-float query/gain; forward with D > {MAX_ROW}. (More than "
        f"{MAX_SOURCES} sources is still fused: the forward runs chunks of {MAX_SOURCES} that carry the "
        "online-softmax state through fp32 scratch; the backward computes per-token scores into [K, T] fp32 scratch, "
        "then gradients per chunk.)",
    )
)
register_kernel_info(
    KernelInfo(
        op="depthrewrite::depth_attn_stack",
        forward="fused.depth_attn_fwd_kernel on the stack's rows and the extra sources (as depth_attn)",
        backward="depthrewrite::depth_attn_stack_backward -> fused.depth_attn_bwd_kernel_multi (as depth_attn); the "
        "rows' gradients stacked",
        fuses="as depth_attn: a block program reading its earlier sources as rows of one buffer, so blocks that "
        "differ only in their count share one compiled program",
        falls_back="as depth_attn",
    )
)
register_kernel_info(
    KernelInfo(
        op="depthrewrite::depth_attn_partial",
        forward="fused.depth_attn_partial_fwd_kernel: S queries against the same sources; pass 1 reads each source "
        "once for all S scores, pass 2 re-reads the (L2-resident) token block and writes o [S, T, D] fp32 and "
        "lse [S, T]",
        backward="depthrewrite::depth_attn_partial_backward -> fused.depth_attn_bwd_kernel_multi: persistent, "
        "recomputes scores and weights, gradients flow through o and lse",
        fuses="the S per-site mixes of a block's completed sources (attnres spec §7 phase 1) in one pass",
        falls_back=f"fp64 or mixed-dtype sources, or non-float queries/gains. (More than {MAX_SOURCES} sources is "
        f"still fused: per-token scores into [S, K, T] fp32 scratch per chunk of {MAX_SOURCES}, softmax in torch, "
        "then one pass per chunk.)",
    )
)
register_kernel_info(
    KernelInfo(
        op="depthrewrite::depth_attn_merge",
        forward="fused.depth_attn_merge_fwd_kernel: whole row on chip; the last source's RMS and score, log-sum-exp merge, scale",
        backward="depthrewrite::depth_attn_merge_backward -> fused.depth_attn_merge_bwd_kernel: persistent, query/gain gradients "
        "as per-program fp32 rows in registers, summed with torch",
        fuses="the open partial sum's key norm and score with the online-softmax merge (attnres spec §7 phase 2)",
        falls_back=f"fp64 last source, o/lse not fp32; D > {MAX_ROW}",
    )
)
