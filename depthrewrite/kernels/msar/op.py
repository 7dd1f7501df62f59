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
from .reference import causal_depthwise_conv, msar_mix_ref

__all__ = ["msar_mix", "msar_mix_backward", "covers"]

def _fused(sources, query, gain, conv, phi, bias, alpha, grad=None, op: str = "depthrewrite::msar_mix") -> bool:
    """Whether to run the Triton kernels: the backend decision first (so a forced ``triton`` backend on CPU without
    the interpreter raises, as in the other ops), then the gate :func:`.limits.covers`."""
    return route(op, (grad, *sources, query, gain, *conv, phi, bias, alpha), lambda: covers(sources, query, conv))


@torch.library.custom_op("depthrewrite::msar_mix", mutates_args=())
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
) -> torch.Tensor:
    """``eps`` is the key RMSNorm ε; ``eps_mix`` the mixer's RMS ε (default 1e-6, msar.md §5; independent of ``eps``)."""
    if _fused(sources, query, gain, conv, phi, bias, alpha):
        from .fused import msar_fwd

        return msar_fwd(sources, query, gain, conv, phi, bias, alpha, eps, scale, conv_values, sigmoid_mixer,
                        eps_mix=eps_mix)
    return msar_mix_ref(sources, query, gain, conv, phi, bias, alpha, eps, scale, conv_values, sigmoid_mixer,
                        eps_mix=eps_mix)


@msar_mix.register_fake
def _(sources, query, gain, conv, phi, bias, alpha, eps, scale, conv_values, sigmoid_mixer, eps_mix=1e-6):
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
    """
    acc = torch.promote_types(sources[0].dtype, torch.float32)
    X = torch.stack([s.to(acc) for s in sources], dim=0)  # [K, ..., T, D]
    m, D = query.shape[0], X.shape[-1]
    T = X.shape[-2]
    u = gain.to(acc) * query.to(acc)
    V = [X] + [causal_depthwise_conv(X, conv[r - 1].to(acc)) for r in range(1, m)]
    Y = V if conv_values else [X] * m
    rs = [torch.rsqrt(v.pow(2).mean(-1) + eps) for v in V]  # [K, ..., T]
    dt = [(v * u[r]).sum(-1) for r, v in enumerate(V)]
    a = [torch.softmax(d * r_, dim=0) for d, r_ in zip(dt, rs)]
    Zs = torch.stack([(ar.unsqueeze(-1) * y).sum(0) for ar, y in zip(a, Y)], dim=-2)  # [..., T, m, D]
    gh = grad.to(acc)
    lead = tuple(range(Zs.dim() - 2))
    mix_grads = []
    if sigmoid_mixer:
        zf = Zs.flatten(-2)
        rho = torch.rsqrt(zf.pow(2).mean(-1) + eps_mix)  # [..., T]
        ph, al = phi.to(acc), alpha.to(acc).reshape(())
        p = zf @ ph  # [..., T, m]
        g = torch.sigmoid(al * rho.unsqueeze(-1) * p + bias.to(acc))
        e = scale * torch.einsum("...d,...rd->...r", gh, Zs) * g * (1 - g)
        dp = e * al * rho.unsqueeze(-1)
        cz = -al * (e * p).sum(-1) * rho.pow(3) / (m * D)
        dZ = scale * g.unsqueeze(-1) * gh.unsqueeze(-2) + (dp @ ph.t()).unflatten(-1, (m, D))
        dZ = dZ + cz[..., None, None] * Zs
        mix_grads = [
            torch.einsum("...k,...j->kj", zf, dp).to(phi.dtype),
            e.sum(lead).to(bias.dtype),
            (e * p * rho.unsqueeze(-1)).sum().reshape(alpha.shape).to(alpha.dtype),
        ]
    else:
        dZ = (scale / m) * gh.unsqueeze(-2).expand(Zs.shape)
        if phi is not None:
            mix_grads = [torch.zeros_like(phi), torch.zeros_like(bias), torch.zeros_like(alpha)]
    dX = torch.zeros_like(X)
    du = torch.zeros(m, D, dtype=acc, device=X.device)
    gconv = []
    for r in range(m):
        dZr = dZ[..., r, :]
        da = (dZr.unsqueeze(0) * Y[r]).sum(-1)
        ds = a[r] * (da - (a[r] * da).sum(0, keepdim=True))
        c1, c2 = ds * rs[r], -ds * dt[r] * rs[r].pow(3) / D
        du[r] = (c1.unsqueeze(-1) * V[r]).flatten(0, -2).sum(0)
        dV = c1.unsqueeze(-1) * u[r] + c2.unsqueeze(-1) * V[r]
        if conv_values or r == 0:
            dV = dV + a[r].unsqueeze(-1) * dZr
        else:
            dX = dX + a[r].unsqueeze(-1) * dZr
        if r == 0:
            dX = dX + dV
            continue
        w = conv[r - 1]
        k = w.shape[-1]
        # V[t] = Σ_τ W[:, k-1-τ] x[t-τ]  =>  dx[s] = Σ_τ W[:, k-1-τ] dV[s+τ] (a causal conv of the time-reversed dV)
        dX = dX + causal_depthwise_conv(dV.flip(-2), w.to(acc)).flip(-2)
        taps = []
        for j in range(k):  # tap j reads x[t - (k-1-j)]
            tau = k - 1 - j
            xs = torch.nn.functional.pad(X, (0, 0, tau, 0))[..., :T, :]
            taps.append((dV * xs).flatten(0, -2).sum(0))
        gconv.append(torch.stack(taps, dim=-1).to(w.dtype))
    gs = [dX[i].to(s.dtype, copy=True) for i, s in enumerate(sources)]  # outputs of a custom op may not alias
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
    if _fused(sources, query, gain, conv, phi, bias, alpha, grad, op="depthrewrite::msar_mix_backward"):
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
    ctx.k, ctx.n_conv = len(sources), len(conv)
    ctx.mixer = phi is not None  # the "mean" mixer has no parameters
    mixer = (phi, bias, alpha) if ctx.mixer else ()
    ctx.save_for_backward(query, gain, *mixer, *sources, *conv)
    ctx.args = (eps, scale, conv_values, sigmoid_mixer, rest[0] if rest else 1e-6)


def _backward(ctx, grad):
    n_mix = 3 if ctx.mixer else 0
    saved = ctx.saved_tensors
    q, g = saved[:2]
    p, b, a = saved[2 : 2 + n_mix] if ctx.mixer else (None, None, None)
    srcs, conv = list(saved[2 + n_mix : 2 + n_mix + ctx.k]), list(saved[2 + n_mix + ctx.k :])
    grads = torch.ops.depthrewrite.msar_mix_backward(grad, srcs, q, g, conv, p, b, a, *ctx.args)
    k, c = ctx.k, ctx.n_conv
    gs, gq, gg, gc = list(grads[:k]), grads[k], grads[k + 1], list(grads[k + 2 : k + 2 + c])
    gp, gb, ga = grads[k + 2 + c :] if ctx.mixer else (None, None, None)
    return gs, gq, gg, gc, gp, gb, ga, None, None, None, None, None


msar_mix.register_autograd(_backward, setup_context=_setup_context)

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
        op="depthrewrite::msar_mix_backward",
        forward="msar_bwd_kernel_stats (recomputes logits, softmaxes, mixer; dZ·Y reductions -> per-token "
        "coefficients) + msar_bwd_kernel_grad (extended tiles: views, dV, transposed conv via a per-program scratch "
        "tile, source grads; query/gain/conv/phi grads by fp32 atomic_add of per-program sums)",
        backward="not differentiable (no double backward)",
        fuses="the whole backward of msar_mix from its inputs: nothing of the forward is saved but the inputs",
        falls_back="as depthrewrite::msar_mix (the reference recomputation under autograd)",
    )
)
