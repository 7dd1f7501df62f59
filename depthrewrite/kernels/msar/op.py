"""``depthrewrite::msar_mix``: the MSAR site as one registered op, and ``depthrewrite::msar_mix_backward``, its
backward as a second op (one opaque node per site in a compiled backward graph).

Both dispatch with :func:`~depthrewrite.kernels.dispatch.route` and the gate :func:`.limits.covers`: the fused
Triton kernels of :mod:`.fused` (imported lazily, only then) or the PyTorch reference (:mod:`.reference`; the backward recomputes it from the saved
inputs under autograd). Cases the kernels do not cover fall back to the reference inside the op (see ``falls_back``
in the registered :class:`~depthrewrite.kernels.dispatch.KernelInfo`).
"""

from __future__ import annotations

import torch

from ..dispatch import KernelInfo, register_kernel_info, route
from .limits import MAX_KERNEL, MAX_SOURCES, MAX_STREAMS, covers
from .reference import msar_mix_ref

__all__ = ["msar_mix", "msar_mix_backward", "msar_mix_stack", "covers"]

def _fused(sources, query, gain, conv, phi, bias, alpha, grad=None, op: str = "depthrewrite::msar_mix") -> bool:
    """Whether to run the Triton kernels: the backend decision first (so a forced ``triton`` backend on CPU without
    the interpreter raises, as in the other ops), then the gate :func:`.limits.covers`."""
    return route(op, (grad, *sources, query, gain, *conv, phi, bias, alpha), lambda: covers(sources, query, conv))


_MIX_SCHEMA = (  # written out: ``Tensor[]? left`` (an optional list) is not inferred from the annotations
    "(Tensor[] sources, Tensor query, Tensor gain, Tensor[] conv, Tensor? phi, Tensor? bias, Tensor? alpha, float eps, "
    "float scale, bool conv_values, bool sigmoid_mixer, float eps_mix=1e-06, Tensor[]? left=None) -> Tensor"
)


@torch.library.custom_op("depthrewrite::msar_mix", mutates_args=(), schema=_MIX_SCHEMA)
def msar_mix(
    sources: list[torch.Tensor],
    query: torch.Tensor,
    gain: torch.Tensor,
    conv: list[torch.Tensor],
    phi: torch.Tensor | None,
    bias: torch.Tensor | None,
    alpha: torch.Tensor | None,
    eps: float,
    scale: float,
    conv_values: bool,
    sigmoid_mixer: bool,
    eps_mix: float = 1e-6,
    left: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """``eps`` is the key RMSNorm ε; ``eps_mix`` the mixer's RMS ε (default 1e-6, msar.md §5; independent of ``eps``).
    ``left``: per source, the k_max−1 positions before its first (a decoding step's conv history, ``[..., k_max−1,
    D]``); the convs read them as left context and the result covers the sources' own positions only (None: zeros,
    the start of a sequence). With ``left`` the op runs the reference (a decoding step: a few positions)."""
    if left is not None:
        route("depthrewrite::msar_mix", (*sources, query), lambda: "left context (a decoding step) runs the reference")
        return msar_mix_ref(sources, query, gain, conv, phi, bias, alpha, eps, scale, conv_values, sigmoid_mixer,
                            left=left, eps_mix=eps_mix)
    if _fused(sources, query, gain, conv, phi, bias, alpha):
        from .fused import msar_fwd

        return msar_fwd(sources, query, gain, conv, phi, bias, alpha, eps, scale, conv_values, sigmoid_mixer,
                        eps_mix=eps_mix)
    return msar_mix_ref(sources, query, gain, conv, phi, bias, alpha, eps, scale, conv_values, sigmoid_mixer,
                        eps_mix=eps_mix)


@msar_mix.register_fake
def _(sources, query, gain, conv, phi, bias, alpha, eps, scale, conv_values, sigmoid_mixer, eps_mix=1e-6, left=None):
    return torch.empty_like(sources[0])


def _backward_ref(grad, sources, query, gain, conv, phi, bias, alpha, eps, scale, conv_values, sigmoid_mixer,
                  eps_mix=1e-6):
    """Every gradient of :func:`msar_mix_ref`, written out (the op body runs below autograd, so the reference cannot
    be differentiated there). Same flat output layout as the fused backward; fp32 math (fp64 for fp64 sources).

    With s_ir = (u_r·V_i^(r))·rs_ir, rs = rsqrt(|V|²/D + eps), a = softmax_i(s), Z_r = Σ_i a_ir Y_i^(r),
    ρ = rsqrt(|Z|²/(mD) + eps_mix), p = Z_flat φ, g = σ(α ρ p + b), h = c Σ_r g_r Z_r:
    e_r = c (dh·Z_r) g_r (1-g_r); db = Σ e; dα = Σ_r e_r ρ p_r; dp = e α ρ; c_z = -α (Σ_r e_r p_r) ρ³/(mD);
    dφ = Σ_tokens Z_flat ⊗ dp; dZ_r = c g_r dh + φ_r dp + c_z Z_r; da_ir = dZ_r·Y_i^(r);
    ds = a (da - Σ_i a da); dV_i^(r) = ds rs u_r - ds (u_r·V) rs³/D V_i^(r) (+ a_ir dZ_r on the value path);
    du_r = Σ ds rs V, dw = γ du, dγ = w du; the conv's transpose and tap gradients from dV^(r).

    Batched like the reference: every stream works on the stacked sources ``[K·B, T, D]`` at once; the conv's
    transpose and tap gradients are one ``convolution_backward`` per stream (shifted multiply-adds while compiling).
    """
    # helpers shared with the forward reference (the stack, the padded stack, the views, the scores)
    from .reference import _conv_padded_backward, _scores, _stream_views, _weighted

    from .reference import _count

    acc = torch.promote_types(sources[0].dtype, torch.float32)
    lead, (T, D) = sources[0].shape[:-2], sources[0].shape[-2:]
    K, m = _count(sources), query.shape[0]
    u = gain.to(acc) * query.to(acc)  # [m, D]
    X, Xp, V = _stream_views(sources, conv, acc)  # [K·B, T, D] each
    Y = V if conv_values else [X] * m
    st = [_scores(V[r], u[r], eps, K) for r in range(m)]  # (rs, u·V, a), each [K, B·T]
    Zs = torch.stack([_weighted(a, y) for (_, _, a), y in zip(st, Y)], dim=-2)  # [B·T, m, D]
    gh = grad.to(acc).reshape(-1, D)  # [B·T, D]
    mix_grads = []
    if sigmoid_mixer:
        zf = Zs.flatten(-2)
        rho = torch.rsqrt(zf.pow(2).mean(-1) + eps_mix)  # [B·T]
        ph, al = phi.to(acc), alpha.to(acc).reshape(())
        p = zf @ ph  # [B·T, m]
        g = torch.sigmoid(al * rho.unsqueeze(-1) * p + bias.to(acc))
        e = scale * (Zs @ gh.unsqueeze(-1)).squeeze(-1) * g * (1 - g)
        dp = e * al * rho.unsqueeze(-1)
        cz = -al * (e * p).sum(-1) * rho.pow(3) / (m * D)
        dZ = scale * g.unsqueeze(-1) * gh.unsqueeze(-2) + (dp @ ph.t()).unflatten(-1, (m, D))
        dZ = dZ + cz[..., None, None] * Zs
        mix_grads = [
            (zf.t() @ dp).to(phi.dtype),
            e.sum(0).to(bias.dtype),
            (e * p * rho.unsqueeze(-1)).sum().reshape(alpha.shape).to(alpha.dtype),
        ]
    else:
        dZ = (scale / m) * gh.unsqueeze(-2).expand(Zs.shape)
        if phi is not None:
            mix_grads = [torch.zeros_like(phi), torch.zeros_like(bias), torch.zeros_like(alpha)]
    dX = None  # [K, B·T, D]
    du, gconv = [], []
    for r in range(m):
        rs, dt, a = st[r]
        dZr = dZ[:, r]  # [B·T, D]
        Vr = V[r].reshape(K, -1, D)
        da = (Y[r].reshape(K, -1, D) * dZr).sum(-1)  # [K, B·T]
        ds = a * (da - (a * da).sum(0, keepdim=True))
        c1, c2 = ds * rs, -ds * dt * rs.pow(3) / D
        du.append(c1.reshape(1, -1) @ V[r].reshape(-1, D))  # [1, D]
        dV = c2.unsqueeze(-1) * Vr  # [K, B·T, D]
        dV = torch.addcmul(dV, c1.unsqueeze(-1), u[r])  # functional throughout: traced as a decomposition
        if conv_values or r == 0:
            dV = torch.addcmul(dV, a.unsqueeze(-1), dZr)
        else:
            dX = torch.addcmul(dX, a.unsqueeze(-1), dZr)
        if r == 0:
            dX = dV
            continue
        w = conv[r - 1]
        gx, gw = _conv_padded_backward(dV.reshape(-1, T, D), Xp, w.to(acc))
        dX = dX + gx.reshape(dX.shape)
        gconv.append(gw.to(w.dtype))
    dX = dX.reshape(K, *lead, T, D)
    if isinstance(sources, torch.Tensor):  # stacked (msar_mix_stack's decomposition): one gradient
        gs = [dX.to(sources.dtype, copy=True)]
    else:
        gs = [dX[i].to(s.dtype, copy=True) for i, s in enumerate(sources)]  # outputs of a custom op may not alias
    du = torch.cat(du, dim=0)  # [m, D]
    gq = (du * gain.to(acc)).to(query.dtype)
    gg = (du * query.to(acc)).to(gain.dtype)
    return [*gs, gq, gg, *gconv, *mix_grads]


@torch.library.custom_op("depthrewrite::msar_mix_backward", mutates_args=())
def msar_mix_backward(
    grad: torch.Tensor,
    sources: list[torch.Tensor],
    query: torch.Tensor,
    gain: torch.Tensor,
    conv: list[torch.Tensor],
    phi: torch.Tensor | None,
    bias: torch.Tensor | None,
    alpha: torch.Tensor | None,
    eps: float,
    scale: float,
    conv_values: bool,
    sigmoid_mixer: bool,
    eps_mix: float = 1e-6,
) -> list[torch.Tensor]:
    """Every gradient of :func:`msar_mix`, recomputed from its inputs.

    Returns:
        Flat list ``[*d_sources, d_query, d_gain, *d_conv]`` then ``[d_phi, d_bias, d_alpha]`` when ``phi`` is
        not None (zeros where the input does not influence the output, e.g. φ with the mean mixer).
    """
    args = (grad, sources, query, gain, conv, phi, bias, alpha, eps, scale, conv_values, sigmoid_mixer)
    fused = _fused(sources, query, gain, conv, phi, bias, alpha, grad, op="depthrewrite::msar_mix_backward")
    return _gradients(fused, args, eps_mix)


def _gradients(fused: bool, args: tuple, eps_mix: float) -> list[torch.Tensor]:
    """``msar_mix_backward``'s gradients of ``args`` (its arguments up to ``eps_mix``): the fused kernels or the
    written-out reference, as routed."""
    if fused:
        from .fused import msar_bwd

        return msar_bwd(*args, eps_mix=eps_mix)
    return _backward_ref(*args, eps_mix=eps_mix)


@msar_mix_backward.register_fake
def _(grad, sources, query, gain, conv, phi, bias, alpha, eps, scale, conv_values, sigmoid_mixer, eps_mix=1e-6):
    out = [torch.empty_like(s) for s in sources] + [torch.empty_like(query), torch.empty_like(gain)]
    out += [torch.empty_like(w) for w in conv]
    if phi is not None:
        out += [torch.empty_like(phi), torch.empty_like(bias), torch.empty_like(alpha)]
    return out


def _setup_context(ctx, inputs, output):
    sources, query, gain, conv, phi, bias, alpha, eps, scale, conv_values, sigmoid_mixer, *rest = inputs
    left = rest[1] if len(rest) > 1 else None
    ctx.k, ctx.n_conv, ctx.left = len(sources), len(conv), left is not None
    ctx.mixer = phi is not None  # the "mean" mixer has no parameters
    mixer = (phi, bias, alpha) if ctx.mixer else ()
    ctx.save_for_backward(query, gain, *mixer, *sources, *conv, *(left or ()))
    ctx.args = (eps, scale, conv_values, sigmoid_mixer, rest[0] if rest else 1e-6)


def _backward(ctx, grad):
    n_mix = 3 if ctx.mixer else 0
    saved = ctx.saved_tensors
    q, g = saved[:2]
    p, b, a = saved[2 : 2 + n_mix] if ctx.mixer else (None, None, None)
    k, c = ctx.k, ctx.n_conv
    srcs, conv = list(saved[2 + n_mix : 2 + n_mix + k]), list(saved[2 + n_mix + k : 2 + n_mix + k + c])
    left = list(saved[2 + n_mix + k + c :]) if ctx.left else None
    if left is not None:
        # the op with left context is the op on [left, source] with only the sources' positions kept: the same
        # backward there, with a zero gradient for the left positions' outputs, split back into left and source
        k1 = max((w.shape[-1] for w in conv), default=1) - 1  # the forward reads each history's last k1 positions
        srcs = [torch.cat([x[..., x.shape[-2] - k1 :, :].to(s.dtype), s], dim=-2) for x, s in zip(left, srcs)]
        grad = torch.nn.functional.pad(grad, (0, 0, k1, 0))
    grads = torch.ops.depthrewrite.msar_mix_backward(grad, srcs, q, g, conv, p, b, a, *ctx.args)
    gs, gq, gg, gc = list(grads[:k]), grads[k], grads[k + 1], list(grads[k + 2 : k + 2 + c])
    gp, gb, ga = grads[k + 2 + c :] if ctx.mixer else (None, None, None)
    gl = None
    if left is not None:
        gl = []
        for i, x in enumerate(left):
            gl.append(torch.nn.functional.pad(gs[i][..., :k1, :], (0, 0, x.shape[-2] - k1, 0)).to(x.dtype))
            gs[i] = gs[i][..., k1:, :]
    return gs, gq, gg, gc, gp, gb, ga, None, None, None, None, None, gl


msar_mix.register_autograd(_backward, setup_context=_setup_context)


# ---- depthrewrite::msar_mix_stack: the same mix, its earlier sources one stacked tensor -----------------------------
#
# As depthrewrite::depth_attn_stack (depth_attn/op.py): a block program reads its block's earlier sources as the
# rows of one tensor ``stack`` ``[n, ..., T, D]`` and its own as ``extra``, so blocks that differ only in ``n`` share
# one program. ``msar_mix_stack(stack, extra, ..., scale, per_source, ...)`` equals ``msar_mix([*stack, *extra], ...,
# scale · K if per_source else scale, ...)``, K = n + len(extra). Eager, it runs msar_mix's kernel or reference on
# the rows (the same bits); its decomposition is the reference on the stacked tensor (no loop over n).

_STACK_SCHEMA = (
    "(Tensor stack, Tensor[] extra, Tensor query, Tensor gain, Tensor[] conv, Tensor? phi, Tensor? bias, "
    "Tensor? alpha, float eps, float scale, bool per_source, bool conv_values, bool sigmoid_mixer, "
    "float eps_mix=1e-06) -> Tensor"
)


def _stack_scale(stack: torch.Tensor, extra: list, scale: float, per_source: bool) -> float:
    return scale * (stack.shape[0] + len(extra)) if per_source else scale


def _stack_fused(stack, extra, query, gain, conv, phi, bias, alpha, grad=None,
                 op: str = "depthrewrite::msar_mix_stack") -> bool:
    """:func:`_fused` of a stacked call, routed before the stack is split into its rows: the decomposition table
    probes this routing on the traced call (:func:`~depthrewrite.kernels.dispatch.would_fuse`), and listing the rows
    there would fix the stack's dynamic row count, compiling one program per block again."""
    def gate() -> str | None:  # asked only where the kernel backend picks Triton: one row stands for the stack
        return covers([stack[0], *extra] if stack.shape[0] else extra, query, conv, count=stack.shape[0] + len(extra))

    return route(op, (grad, stack, *extra, query, gain, *conv, phi, bias, alpha), gate)


@torch.library.custom_op("depthrewrite::msar_mix_stack", mutates_args=(), schema=_STACK_SCHEMA)
def msar_mix_stack(stack, extra, query, gain, conv, phi, bias, alpha, eps, scale, per_source, conv_values,
                   sigmoid_mixer, eps_mix=1e-6):
    c = _stack_scale(stack, extra, scale, per_source)
    fused = _stack_fused(stack, extra, query, gain, conv, phi, bias, alpha)
    sources = [*stack.unbind(0), *extra]
    if fused:
        from .fused import msar_fwd

        return msar_fwd(sources, query, gain, conv, phi, bias, alpha, eps, c, conv_values, sigmoid_mixer,
                        eps_mix=eps_mix)
    return msar_mix_ref(sources, query, gain, conv, phi, bias, alpha, eps, c, conv_values, sigmoid_mixer,
                        eps_mix=eps_mix)


@msar_mix_stack.register_fake
def _(stack, extra, query, gain, conv, phi, bias, alpha, eps, scale, per_source, conv_values, sigmoid_mixer,
      eps_mix=1e-6):
    return stack.new_empty(stack.shape[1:])


@torch.library.custom_op("depthrewrite::msar_mix_stack_backward", mutates_args=())
def msar_mix_stack_backward(grad: torch.Tensor, stack: torch.Tensor, extra: list[torch.Tensor], query: torch.Tensor,
                            gain: torch.Tensor, conv: list[torch.Tensor], phi: torch.Tensor | None,
                            bias: torch.Tensor | None, alpha: torch.Tensor | None, eps: float, scale: float,
                            per_source: bool, conv_values: bool, sigmoid_mixer: bool,
                            eps_mix: float = 1e-6) -> list[torch.Tensor]:
    """``[d_stack, d_query, d_gain, *d_conv, (d_phi, d_bias, d_alpha), *d_extra]`` of ``msar_mix_stack``."""
    fused = _stack_fused(stack, extra, query, gain, conv, phi, bias, alpha, grad,
                         op="depthrewrite::msar_mix_stack_backward")
    n = stack.shape[0]
    args = (grad, [*stack.unbind(0), *extra], query, gain, conv, phi, bias, alpha, eps,
            _stack_scale(stack, extra, scale, per_source), conv_values, sigmoid_mixer)
    grads = _gradients(fused, args, eps_mix)
    k = n + len(extra)
    return [torch.stack(grads[:n]) if n else torch.zeros_like(stack), *grads[k:], *grads[n:k]]


@msar_mix_stack_backward.register_fake
def _(grad, stack, extra, query, gain, conv, phi, bias, alpha, eps, scale, per_source, conv_values, sigmoid_mixer,
      eps_mix=1e-6):
    out = [torch.empty_like(stack), torch.empty_like(query), torch.empty_like(gain), *[torch.empty_like(w) for w in conv]]
    if phi is not None:
        out += [torch.empty_like(phi), torch.empty_like(bias), torch.empty_like(alpha)]
    return out + [torch.empty_like(e) for e in extra]


def _stack_setup_context(ctx, inputs, output):
    stack, extra, query, gain, conv, phi, bias, alpha, *args = inputs
    ctx.n_extra, ctx.n_conv, ctx.mixer = len(extra), len(conv), phi is not None
    mixer = (phi, bias, alpha) if ctx.mixer else ()
    ctx.save_for_backward(stack, query, gain, *mixer, *conv, *extra)
    ctx.args = tuple(args) + ((1e-6,) if len(args) == 5 else ())


def _stack_backward(ctx, grad):
    saved = list(ctx.saved_tensors)
    stack, query, gain = saved[:3]
    n_mix = 3 if ctx.mixer else 0
    phi, bias, alpha = saved[3:6] if ctx.mixer else (None, None, None)
    conv = saved[3 + n_mix : 3 + n_mix + ctx.n_conv]
    extra = saved[3 + n_mix + ctx.n_conv :]
    grads = torch.ops.depthrewrite.msar_mix_stack_backward(grad, stack, extra, query, gain, conv, phi, bias, alpha,
                                                           *ctx.args)
    gstack, gq, gg = grads[:3]
    gc = list(grads[3 : 3 + ctx.n_conv])
    gp, gb, ga = grads[3 + ctx.n_conv : 6 + ctx.n_conv] if ctx.mixer else (None, None, None)
    ge = list(grads[3 + ctx.n_conv + n_mix :])
    return gstack, ge, gq, gg, gc, gp, gb, ga, None, None, None, None, None, None


msar_mix_stack.register_autograd(_stack_backward, setup_context=_stack_setup_context)


def msar_mix_stack_ref(stack, extra, query, gain, conv, phi, bias, alpha, eps, scale, per_source, conv_values,
                       sigmoid_mixer, eps_mix=1e-6):
    """:func:`msar_mix_ref` on ``stack`` with ``extra`` as its next rows (tensor operations only: what the compile
    backend traces for inductor)."""
    X = torch.cat([stack, torch.stack(extra)]) if extra else stack
    return msar_mix_ref(X, query, gain, conv, phi, bias, alpha, eps, _stack_scale(stack, extra, scale, per_source),
                        conv_values, sigmoid_mixer, eps_mix=eps_mix)


def _stack_backward_ref(grad, stack, extra, query, gain, conv, phi, bias, alpha, eps, scale, per_source,
                        conv_values, sigmoid_mixer, eps_mix=1e-6) -> list[torch.Tensor]:
    """Gradients of :func:`msar_mix_stack_ref`, in :func:`msar_mix_stack_backward`'s layout."""
    n = stack.shape[0]
    X = torch.cat([stack, torch.stack(extra)]) if extra else stack
    gX, *rest = _backward_ref(grad, X, query, gain, conv, phi, bias, alpha, eps,
                              _stack_scale(stack, extra, scale, per_source), conv_values, sigmoid_mixer, eps_mix)
    # the extra rows counted from the end (a plain int index; n + i would fix the dynamic row count n)
    return [gX[:n].clone() if extra else gX, *rest, *(gX[i - len(extra)].clone() for i in range(len(extra)))]


register_kernel_info(
    KernelInfo(
        op="depthrewrite::msar_mix",
        forward="msar_fwd_kernel (one program per 16 tokens of a sequence; 3 passes over D chunks, 2 with the mean "
        "mixer)",
        backward="depthrewrite::msar_mix_backward: msar_bwd_kernel_stats + msar_bwd_kernel_grad",
        fuses="causal conv stream expansion + m per-stream key RMSNorm/logits/depth softmaxes + weighted sums + "
        "RMS/sigmoid (or mean) mixer + final combination; the m stream views and Z are never written, only h",
        falls_back=f"more than {MAX_SOURCES} sources, more than {MAX_STREAMS} streams, a conv filter longer than "
        f"{MAX_KERNEL} taps or len(conv) != m-1, float64 or mixed-dtype/shape sources, empty inputs, bf16 CPU "
        "tensors (the interpreter has no bf16)",
    )
)
register_kernel_info(
    KernelInfo(
        op="depthrewrite::msar_mix_stack",
        forward="msar_fwd_kernel on the stack's rows and the extra sources (as msar_mix)",
        backward="depthrewrite::msar_mix_stack_backward: msar_mix_backward's kernels on the rows; their gradients "
        "stacked",
        fuses="as msar_mix: a block program reading its earlier sources as rows of one buffer, so blocks that differ "
        "only in their count share one compiled program",
        falls_back="as msar_mix",
    )
)
register_kernel_info(
    KernelInfo(
        op="depthrewrite::msar_mix_backward",
        forward="msar_bwd_kernel_stats (recomputes logits, softmaxes, mixer; dZ·Y reductions -> per-token "
        "coefficients) + msar_bwd_kernel_grad (extended tiles: views, dV, transposed conv via a per-program scratch "
        "tile, source grads; query/gain/conv/phi grads by fp32 atomic_add of per-program sums)",
        backward="not differentiable (no double backward)",
        fuses="the whole backward of msar_mix from its inputs: nothing of the forward is saved but the inputs",
        falls_back="as depthrewrite::msar_mix (the reference recomputation under autograd)",
    )
)
