"""Fused Triton kernels for ``depthrewrite::msar_mix`` (forward) and ``depthrewrite::msar_mix_backward``.

Imported lazily by :mod:`.op` only when :func:`depthrewrite.kernels.dispatch.route` picks the kernel: Triton reads
``TRITON_INTERPRET`` when ``@triton.jit`` decorates, and CPU users never pay for importing Triton.

Math (see :mod:`.reference` for the one docstring of the op), per token t of a sequence, source i, stream r:

    V_i^(0) = x_i,  V_i^(r)[t] = Σ_τ W_r[:, k_r-1-τ] ⊙ x_i[t-τ]   (zeros before the start of each sequence)
    s_ir = (u_r · V_i^(r)) · rsqrt(|V_i^(r)|²/D + eps),   u_r = γ_r ⊙ w_r
    a_ir = softmax_i(s_ir),   Z_r = Σ_i a_ir Y_i^(r)        (Y = V, or x when conv_values=False)
    g = sigmoid(α · rsqrt(|Z|²/(mD) + eps_mix) · (Z_flat @ φ) + b)  (or 1/m),   h = scale · Σ_r g_r Z_r

Design (forward, ``msar_fwd_kernel``): one program per tile of ``BT`` consecutive tokens of one sequence, three
passes over D in chunks of ``BD``. The m stream views are never written to memory: every pass recomputes them from
the sources with shifted (halo) loads, ``x[t-τ]`` for τ < k_max, which hit L1/L2 after the first tap.

1. per source: Σ V², Σ V·u for every stream → logits → m softmaxes over the sources (registers, ``[BT, KP]``);
2. (sigmoid mixer only) Z chunks → |Z|² and Z·φ → g;
3. Z chunks again → h = scale Σ_r g_r Z_r, the only tensor written.

Backward: two kernels. ``msar_bwd_kernel_stats`` (same tiling) recomputes passes 1-2, then a third pass that
forms dZ_r = scale g_r dh + φ_r dp + c_z Z_r and the per-(source, stream) reductions da_ir = dZ_r · Y_i^(r); from
them the softmax backward gives per-token coefficients (a, c1 = ds·rs, c2 = -ds·dt·rs³/D) and per-token mixer
scalars (scale·g, dp, c_z), written to a small fp32 side buffer (12·KP + 9 floats per token). It also reduces
dα and db. ``msar_bwd_kernel_grad`` then works on *extended* tiles of ``ET`` rows that own the first
``ET - (k_max-1)`` of them: it recomputes the views and dV_i^(r) = c1 u_r + c2 V_i^(r) + a_ir dZ_r on all ET rows,
stages the conv-stream dV tile of one source in a per-program fp32 scratch tile (L2-resident, ``3·ET·BD`` floats)
so that the transposed conv dx[t] = Σ_τ W[τ] dV[t+τ] can read it shifted, and writes dx for the owned rows. The
parameter gradients that reduce over tokens (query, gain, conv taps, φ) are summed per program in registers over
its owned rows and added to fp32 buffers with ``tl.atomic_add`` (so their summation order is not deterministic).

Sources are one tuple argument of up to ``limits.MAX_SOURCES`` pointers (never stacked). The loops over sources are
run-time loops that select the tuple element with ``tl.where`` (no indirect loads); unrolling them made the sm_90 compile of the
K = 9, k = (4, 8, 12) kernels take minutes. Only the conv taps (``tl.static_range(k_max)``) and the m <= 4
streams (explicit variables under constexpr guards) are unrolled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_utils import pow2
from .limits import BWD_TILES, FWD_TILES, MAX_KERNEL, MAX_SOURCES, MAX_STREAMS, grad_tiles, stats_tiles

__all__ = ["MAX_SOURCES", "MAX_STREAMS", "MAX_KERNEL", "msar_fwd", "msar_bwd"]



# ----------------------------------------------------------------------------------------------------------------
# device helpers
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _pick(ptrs, i, NSRC: tl.constexpr):
    """The pointer of source ``i`` of the tuple ``ptrs`` (a run-time select: no indirect loads, and the source
    loops stay rolled, which keeps the compiled code small)."""
    p = ptrs[0]
    for j in tl.static_range(1, NSRC):
        p = tl.where(i == j, ptrs[j], p)
    return p


@triton.jit
def _load_shift(sp, rows, tpos, row_ok, cols, cm, D, tau: tl.constexpr):
    """``x[t - tau, cols]`` for the tile's tokens as fp32, zero before the start of the sequence."""
    ok = row_ok & (tpos >= tau)
    offs = (rows - tau).to(tl.int64)[:, None] * D + cols[None, :]
    return tl.load(sp + offs, mask=ok[:, None] & cm[None, :], other=0.0).to(tl.float32)


@triton.jit
def _views(
    sp, wp, rows, tpos, row_ok, cols, cm, D,
    K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr, KMAX: tl.constexpr,
):  # fmt: skip
    """x and its three causal conv views (zeros for absent streams); ``wp`` is the packed ``[3, KMAX, D]`` taps."""
    x = _load_shift(sp, rows, tpos, row_ok, cols, cm, D, 0)
    v1 = tl.zeros_like(x)
    v2 = tl.zeros_like(x)
    v3 = tl.zeros_like(x)
    for tau in tl.static_range(KMAX):
        if tau == 0:
            xs = x
        else:
            xs = _load_shift(sp, rows, tpos, row_ok, cols, cm, D, tau)
        if tau < K1:
            v1 += tl.load(wp + tau * D + cols, mask=cm, other=0.0)[None, :] * xs
        if tau < K2:
            v2 += tl.load(wp + (KMAX + tau) * D + cols, mask=cm, other=0.0)[None, :] * xs
        if tau < K3:
            v3 += tl.load(wp + (2 * KMAX + tau) * D + cols, mask=cm, other=0.0)[None, :] * xs
    return x, v1, v2, v3


@triton.jit
def _zeros4(S0: tl.constexpr, S1: tl.constexpr):
    """Four fp32 zero tiles ``[S0, S1]`` (one per stream)."""
    z = tl.zeros((S0, S1), tl.float32)
    return z, z, z, z


@triton.jit
def _zeros4v(S0: tl.constexpr):
    """Four fp32 zero vectors ``[S0]`` (one per stream)."""
    z = tl.zeros((S0,), tl.float32)
    return z, z, z, z


@triton.jit
def _values(
    sp, wp, rows, tpos, row_ok, cols, cm, D,
    K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr, KMAX: tl.constexpr, CONV_VALUES: tl.constexpr,
):  # fmt: skip
    """The value of each stream for one source and chunk: the conv views (``CONV_VALUES``) or the raw source."""
    if CONV_VALUES:
        x, v1, v2, v3 = _views(sp, wp, rows, tpos, row_ok, cols, cm, D, K1, K2, K3, KMAX)
    else:
        x = _load_shift(sp, rows, tpos, row_ok, cols, cm, D, 0)
        v1 = x
        v2 = x
        v3 = x
    return x, v1, v2, v3


@triton.jit
def _col(A, kk, i):
    """Column ``i`` of a ``[BT, KP]`` register matrix."""
    return tl.sum(tl.where(kk[None, :] == i, A, 0.0), axis=1)


@triton.jit
def _mix(
    srcs,
    A0, A1, A2, A3, kk, wp, rows, tpos, row_ok, cols, cm, D,
    NSRC: tl.constexpr, M: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr,
    KMAX: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, CONV_VALUES: tl.constexpr,
):  # fmt: skip
    """One D chunk of the retrieved states Z_r = Σ_i a_ir Y_i^(r), views recomputed."""
    Z0, Z1, Z2, Z3 = _zeros4(BT, BD)
    for i in range(NSRC):
        sp = _pick(srcs, i, NSRC)
        x, v1, v2, v3 = _values(sp, wp, rows, tpos, row_ok, cols, cm, D, K1, K2, K3, KMAX, CONV_VALUES)
        Z0 += _col(A0, kk, i)[:, None] * x
        if M > 1:
            Z1 += _col(A1, kk, i)[:, None] * v1
        if M > 2:
            Z2 += _col(A2, kk, i)[:, None] * v2
        if M > 3:
            Z3 += _col(A3, kk, i)[:, None] * v3
    return Z0, Z1, Z2, Z3


@triton.jit
def _logit_stats(
    srcs,
    u_ptr, wp, rows, tpos, row_ok, kk, D, eps,
    NSRC: tl.constexpr, M: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr,
    KMAX: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """Pass 1: per (source, stream) the key dot ``u_r · V`` (DT_r) and inverse RMS (RS_r), as ``[BT, KP]``."""
    DT0, DT1, DT2, DT3 = _zeros4(BT, KP)
    RS0, RS1, RS2, RS3 = _zeros4(BT, KP)
    for i in range(NSRC):
        sp = _pick(srcs, i, NSRC)
        ss0, ss1, ss2, ss3 = _zeros4v(BT)
        dt0, dt1, dt2, dt3 = _zeros4v(BT)
        for d0 in range(0, D, BD):
            cols = d0 + tl.arange(0, BD)
            cm = cols < D
            x, v1, v2, v3 = _views(sp, wp, rows, tpos, row_ok, cols, cm, D, K1, K2, K3, KMAX)
            ss0 += tl.sum(x * x, axis=1)
            dt0 += tl.sum(x * tl.load(u_ptr + cols, mask=cm, other=0.0)[None, :], axis=1)
            if M > 1:
                ss1 += tl.sum(v1 * v1, axis=1)
                dt1 += tl.sum(v1 * tl.load(u_ptr + D + cols, mask=cm, other=0.0)[None, :], axis=1)
            if M > 2:
                ss2 += tl.sum(v2 * v2, axis=1)
                dt2 += tl.sum(v2 * tl.load(u_ptr + 2 * D + cols, mask=cm, other=0.0)[None, :], axis=1)
            if M > 3:
                ss3 += tl.sum(v3 * v3, axis=1)
                dt3 += tl.sum(v3 * tl.load(u_ptr + 3 * D + cols, mask=cm, other=0.0)[None, :], axis=1)
        sel = kk[None, :] == i
        DT0 = tl.where(sel, dt0[:, None], DT0)
        RS0 = tl.where(sel, tl.rsqrt(ss0 / D + eps)[:, None], RS0)
        DT1 = tl.where(sel, dt1[:, None], DT1)
        RS1 = tl.where(sel, tl.rsqrt(ss1 / D + eps)[:, None], RS1)
        DT2 = tl.where(sel, dt2[:, None], DT2)
        RS2 = tl.where(sel, tl.rsqrt(ss2 / D + eps)[:, None], RS2)
        DT3 = tl.where(sel, dt3[:, None], DT3)
        RS3 = tl.where(sel, tl.rsqrt(ss3 / D + eps)[:, None], RS3)
    return DT0, DT1, DT2, DT3, RS0, RS1, RS2, RS3


@triton.jit
def _softmax(DT, RS, kk, NSRC: tl.constexpr):
    s = tl.where(kk[None, :] < NSRC, DT * RS, float("-inf"))
    e = tl.exp(s - tl.max(s, axis=1)[:, None])
    return e / tl.sum(e, axis=1)[:, None]


@triton.jit
def _zphi(Z0, Z1, Z2, Z3, phiT, cols, cm, D, j: tl.constexpr, M: tl.constexpr):
    """``Σ_r Z_r · φ[r·D + cols, j]`` over one chunk (φ passed transposed, ``[M, M·D]``)."""
    base = phiT + j * M * D
    acc = Z0 * tl.load(base + cols, mask=cm, other=0.0)[None, :]
    if M > 1:
        acc += Z1 * tl.load(base + D + cols, mask=cm, other=0.0)[None, :]
    if M > 2:
        acc += Z2 * tl.load(base + 2 * D + cols, mask=cm, other=0.0)[None, :]
    if M > 3:
        acc += Z3 * tl.load(base + 3 * D + cols, mask=cm, other=0.0)[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _dz(gh, Zr, gsr, dp0, dp1, dp2, dp3, cz, phiT, cols, cm, D, r: tl.constexpr, M: tl.constexpr,
        SIGMOID: tl.constexpr):  # fmt: skip
    """dZ_r = scale·g_r·dh (+ Σ_j dp_j φ[r·D + c, j] + c_z Z_r with the sigmoid mixer) for one chunk."""
    dz = gsr[:, None] * gh
    if r >= M:
        dz = tl.zeros_like(gh)
    elif SIGMOID:
        dz += cz[:, None] * Zr
        dz += dp0[:, None] * tl.load(phiT + r * D + cols, mask=cm, other=0.0)[None, :]
        if M > 1:
            dz += dp1[:, None] * tl.load(phiT + M * D + r * D + cols, mask=cm, other=0.0)[None, :]
        if M > 2:
            dz += dp2[:, None] * tl.load(phiT + 2 * M * D + r * D + cols, mask=cm, other=0.0)[None, :]
        if M > 3:
            dz += dp3[:, None] * tl.load(phiT + 3 * M * D + r * D + cols, mask=cm, other=0.0)[None, :]
    return dz


@triton.jit
def _mix_chunk(
    srcs, A0, A1, A2, A3, kk, wp, rows, tpos, row_ok, d0, D,
    NSRC: tl.constexpr, M: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr,
    KMAX: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, CONV_VALUES: tl.constexpr,
):  # fmt: skip
    """The D chunk at ``d0``: its columns, their mask and :func:`_mix` on it."""
    cols = d0 + tl.arange(0, BD)
    cm = cols < D
    Z0, Z1, Z2, Z3 = _mix(
        srcs, A0, A1, A2, A3, kk, wp, rows, tpos, row_ok, cols, cm, D, NSRC, M, K1, K2, K3, KMAX, BT, BD, CONV_VALUES
    )
    return cols, cm, Z0, Z1, Z2, Z3


@triton.jit
def _grad_mix(
    srcs, gh, A0, A1, A2, A3, kk, wp, rows, tpos, row_ok, cols, cm, D,
    NSRC: tl.constexpr, M: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr,
    KMAX: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, CONV_VALUES: tl.constexpr, SIGMOID: tl.constexpr,
):  # fmt: skip
    """The backward's Z_r chunk: recomputed with the sigmoid mixer (its gradient needs Z), else unused (``gh``)."""
    if SIGMOID:
        Z0, Z1, Z2, Z3 = _mix(
            srcs, A0, A1, A2, A3, kk, wp, rows, tpos, row_ok, cols, cm, D,
            NSRC, M, K1, K2, K3, KMAX, BT, BD, CONV_VALUES,
        )  # fmt: skip
    else:
        Z0 = gh
        Z1 = gh
        Z2 = gh
        Z3 = gh
    return Z0, Z1, Z2, Z3


@triton.jit
def _dzs(gh, Z0, Z1, Z2, Z3, gs0, gs1, gs2, gs3, dp0, dp1, dp2, dp3, cz, phiT, cols, cm, D, M: tl.constexpr,
         SIGMOID: tl.constexpr):  # fmt: skip
    """dZ_r of every stream for one chunk (:func:`_dz`)."""
    dZ0 = _dz(gh, Z0, gs0, dp0, dp1, dp2, dp3, cz, phiT, cols, cm, D, 0, M, SIGMOID)
    dZ1 = _dz(gh, Z1, gs1, dp0, dp1, dp2, dp3, cz, phiT, cols, cm, D, 1, M, SIGMOID)
    dZ2 = _dz(gh, Z2, gs2, dp0, dp1, dp2, dp3, cz, phiT, cols, cm, D, 2, M, SIGMOID)
    dZ3 = _dz(gh, Z3, gs3, dp0, dp1, dp2, dp3, cz, phiT, cols, cm, D, 3, M, SIGMOID)
    return dZ0, dZ1, dZ2, dZ3


@triton.jit
def _mixer_stats(
    srcs,
    A0, A1, A2, A3, kk, wp, phiT, gh_ptr, rows, tpos, row_ok, D, eps,
    NSRC: tl.constexpr, M: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr,
    KMAX: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, CONV_VALUES: tl.constexpr, WITH_GRAD: tl.constexpr,
):  # fmt: skip
    """Pass 2: rsqrt(|Z|²/(mD)+eps) (the caller passes eps_mix), p_j = Z_flat·φ[:, j], and (backward) dh·Z_r."""
    zz = tl.zeros((BT,), tl.float32)
    p0, p1, p2, p3 = _zeros4v(BT)
    q0, q1, q2, q3 = _zeros4v(BT)
    for d0 in range(0, D, BD):
        cols, cm, Z0, Z1, Z2, Z3 = _mix_chunk(
            srcs, A0, A1, A2, A3, kk, wp, rows, tpos, row_ok, d0, D, NSRC, M, K1, K2, K3, KMAX, BT, BD, CONV_VALUES
        )
        zz += tl.sum(Z0 * Z0, axis=1)
        if M > 1:
            zz += tl.sum(Z1 * Z1, axis=1)
        if M > 2:
            zz += tl.sum(Z2 * Z2, axis=1)
        if M > 3:
            zz += tl.sum(Z3 * Z3, axis=1)
        p0 += _zphi(Z0, Z1, Z2, Z3, phiT, cols, cm, D, 0, M)
        if M > 1:
            p1 += _zphi(Z0, Z1, Z2, Z3, phiT, cols, cm, D, 1, M)
        if M > 2:
            p2 += _zphi(Z0, Z1, Z2, Z3, phiT, cols, cm, D, 2, M)
        if M > 3:
            p3 += _zphi(Z0, Z1, Z2, Z3, phiT, cols, cm, D, 3, M)
        if WITH_GRAD:
            gofs = rows.to(tl.int64)[:, None] * D + cols[None, :]
            gh = tl.load(gh_ptr + gofs, mask=row_ok[:, None] & cm[None, :], other=0.0).to(tl.float32)
            q0 += tl.sum(gh * Z0, axis=1)
            q1 += tl.sum(gh * Z1, axis=1)
            q2 += tl.sum(gh * Z2, axis=1)
            q3 += tl.sum(gh * Z3, axis=1)
    rho = tl.rsqrt(zz / (M * D) + eps)
    return rho, p0, p1, p2, p3, q0, q1, q2, q3


@triton.jit
def _tile_attn(
    srcs, u_ptr, wp, T, D, eps,
    NSRC: tl.constexpr, M: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr,
    KMAX: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """The program's ``BT`` tokens of one sequence, pass 1 (:func:`_logit_stats`) and the m depth softmaxes."""
    pid = tl.program_id(0)
    n_t = tl.cdiv(T, BT)
    seq = pid // n_t
    tpos = (pid % n_t) * BT + tl.arange(0, BT)
    row_ok = tpos < T
    rows = seq * T + tpos
    kk = tl.arange(0, KP)
    DT0, DT1, DT2, DT3, RS0, RS1, RS2, RS3 = _logit_stats(
        srcs, u_ptr, wp, rows, tpos, row_ok, kk, D, eps, NSRC, M, K1, K2, K3, KMAX, KP, BT, BD,
    )  # fmt: skip
    A0 = _softmax(DT0, RS0, kk, NSRC)
    A1 = _softmax(DT1, RS1, kk, NSRC)
    A2 = _softmax(DT2, RS2, kk, NSRC)
    A3 = _softmax(DT3, RS3, kk, NSRC)
    return tpos, row_ok, rows, kk, DT0, DT1, DT2, DT3, RS0, RS1, RS2, RS3, A0, A1, A2, A3


@triton.jit
def _gates(rho, p0, p1, p2, p3, alpha_ptr, b_ptr, M: tl.constexpr):
    """The sigmoid mixer's gates g_r = σ(α ρ p_r + b_r) (streams r >= M read a valid bias and are unused)."""
    al = tl.load(alpha_ptr)
    g0 = tl.sigmoid(al * rho * p0 + tl.load(b_ptr))
    g1 = tl.sigmoid(al * rho * p1 + tl.load(b_ptr + 1 % M))
    g2 = tl.sigmoid(al * rho * p2 + tl.load(b_ptr + 2 % M))
    g3 = tl.sigmoid(al * rho * p3 + tl.load(b_ptr + 3 % M))
    return al, g0, g1, g2, g3


@triton.jit
def _stream_grad(
    st_ptr, rows64, row_ok, own2, A, kk, dZ, u, v, i,
    r: tl.constexpr, KP: tl.constexpr, CONV_VALUES: tl.constexpr,
):  # fmt: skip
    """Source i, stream r: dV = c1·u_r + c2·V (+ a·dZ_r on the value path when ``CONV_VALUES``); returns
    ``(dV, the value-path term for dx otherwise (zeros when CONV_VALUES), du_r over the owned rows)``."""
    c1 = _coef(st_ptr, rows64, row_ok, 1, r, i, KP)
    dv = c1[:, None] * u + _coef(st_ptr, rows64, row_ok, 2, r, i, KP)[:, None] * v
    du = tl.sum(tl.where(own2, c1[:, None] * v, 0.0), axis=0)
    val = _col(A, kk, i)[:, None] * dZ
    if CONV_VALUES:
        dv += val
        dx = tl.zeros_like(v)
    else:
        dx = val
    return dv, dx, du


# ----------------------------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def msar_fwd_kernel(
    srcs,
    u_ptr, wp, phiT, b_ptr, alpha_ptr, out_ptr,
    T, D, eps, eps_mix, scale,
    NSRC: tl.constexpr, M: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr,
    KMAX: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    CONV_VALUES: tl.constexpr, SIGMOID: tl.constexpr,
):  # fmt: skip
    tpos, row_ok, rows, kk, DT0, DT1, DT2, DT3, RS0, RS1, RS2, RS3, A0, A1, A2, A3 = _tile_attn(
        srcs, u_ptr, wp, T, D, eps, NSRC, M, K1, K2, K3, KMAX, KP, BT, BD,
    )  # fmt: skip
    if SIGMOID:
        rho, p0, p1, p2, p3, q0, q1, q2, q3 = _mixer_stats(
            srcs,
            A0, A1, A2, A3, kk, wp, phiT, out_ptr, rows, tpos, row_ok, D, eps_mix,
            NSRC, M, K1, K2, K3, KMAX, BT, BD, CONV_VALUES, False,
        )  # fmt: skip
        _, g0, g1, g2, g3 = _gates(rho, p0, p1, p2, p3, alpha_ptr, b_ptr, M)
        g0 = g0 * scale
        g1 = g1 * scale
        g2 = g2 * scale
        g3 = g3 * scale
    else:
        g0 = tl.zeros((BT,), tl.float32) + scale / M
        g1 = g0
        g2 = g0
        g3 = g0
    for d0 in range(0, D, BD):
        cols, cm, Z0, Z1, Z2, Z3 = _mix_chunk(
            srcs, A0, A1, A2, A3, kk, wp, rows, tpos, row_ok, d0, D, NSRC, M, K1, K2, K3, KMAX, BT, BD, CONV_VALUES
        )
        h = g0[:, None] * Z0
        if M > 1:
            h += g1[:, None] * Z1
        if M > 2:
            h += g2[:, None] * Z2
        if M > 3:
            h += g3[:, None] * Z3
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
        tl.store(out_ptr + offs, h.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & cm[None, :])


# ----------------------------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def msar_bwd_kernel_stats(
    srcs,
    gh_ptr, u_ptr, wp, phiT, b_ptr, alpha_ptr, st_ptr, tk_ptr, db_ptr, dalpha_ptr,
    T, D, eps, eps_mix, scale,
    NSRC: tl.constexpr, M: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr,
    KMAX: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    CONV_VALUES: tl.constexpr, SIGMOID: tl.constexpr,
):  # fmt: skip
    tpos, row_ok, rows, kk, DT0, DT1, DT2, DT3, RS0, RS1, RS2, RS3, A0, A1, A2, A3 = _tile_attn(
        srcs, u_ptr, wp, T, D, eps, NSRC, M, K1, K2, K3, KMAX, KP, BT, BD,
    )  # fmt: skip
    rows64 = rows.to(tl.int64)
    zero = tl.zeros((BT,), tl.float32)
    if SIGMOID:
        rho, p0, p1, p2, p3, q0, q1, q2, q3 = _mixer_stats(
            srcs,
            A0, A1, A2, A3, kk, wp, phiT, gh_ptr, rows, tpos, row_ok, D, eps_mix,
            NSRC, M, K1, K2, K3, KMAX, BT, BD, CONV_VALUES, True,
        )  # fmt: skip
        al, g0, g1, g2, g3 = _gates(rho, p0, p1, p2, p3, alpha_ptr, b_ptr, M)
        # d(pre-sigmoid) per stream; masked rows contribute nothing to the parameter sums
        e0 = tl.where(row_ok, scale * q0 * g0 * (1.0 - g0), 0.0)
        e1 = tl.where(row_ok, scale * q1 * g1 * (1.0 - g1), 0.0)
        e2 = tl.where(row_ok, scale * q2 * g2 * (1.0 - g2), 0.0)
        e3 = tl.where(row_ok, scale * q3 * g3 * (1.0 - g3), 0.0)
        tl.atomic_add(db_ptr, tl.sum(e0, axis=0))
        ea = e0 * p0
        if M > 1:
            tl.atomic_add(db_ptr + 1, tl.sum(e1, axis=0))
            ea += e1 * p1
        if M > 2:
            tl.atomic_add(db_ptr + 2, tl.sum(e2, axis=0))
            ea += e2 * p2
        if M > 3:
            tl.atomic_add(db_ptr + 3, tl.sum(e3, axis=0))
            ea += e3 * p3
        tl.atomic_add(dalpha_ptr, tl.sum(ea * rho, axis=0))
        drho = ea * al
        dp0 = e0 * al * rho
        dp1 = e1 * al * rho
        dp2 = e2 * al * rho
        dp3 = e3 * al * rho
        cz = -drho * rho * rho * rho / (M * D)
        gs0 = g0 * scale
        gs1 = g1 * scale
        gs2 = g2 * scale
        gs3 = g3 * scale
    else:
        gs0 = zero + scale / M
        gs1 = gs0
        gs2 = gs0
        gs3 = gs0
        dp0 = zero
        dp1 = zero
        dp2 = zero
        dp3 = zero
        cz = zero
    # pass 3: da_ir = dZ_r · Y_i^(r)
    DA0, DA1, DA2, DA3 = _zeros4(BT, KP)
    for d0 in range(0, D, BD):
        cols = d0 + tl.arange(0, BD)
        cm = cols < D
        gofs = rows64[:, None] * D + cols[None, :]
        gh = tl.load(gh_ptr + gofs, mask=row_ok[:, None] & cm[None, :], other=0.0).to(tl.float32)
        Z0, Z1, Z2, Z3 = _grad_mix(
            srcs, gh, A0, A1, A2, A3, kk, wp, rows, tpos, row_ok, cols, cm, D,
            NSRC, M, K1, K2, K3, KMAX, BT, BD, CONV_VALUES, SIGMOID,
        )  # fmt: skip
        dZ0, dZ1, dZ2, dZ3 = _dzs(gh, Z0, Z1, Z2, Z3, gs0, gs1, gs2, gs3, dp0, dp1, dp2, dp3, cz, phiT, cols, cm, D,
                                  M, SIGMOID)  # fmt: skip
        for i in range(NSRC):
            sp = _pick(srcs, i, NSRC)
            x, v1, v2, v3 = _values(sp, wp, rows, tpos, row_ok, cols, cm, D, K1, K2, K3, KMAX, CONV_VALUES)
            sel = kk[None, :] == i
            DA0 += tl.where(sel, tl.sum(dZ0 * x, axis=1)[:, None], 0.0)
            if M > 1:
                DA1 += tl.where(sel, tl.sum(dZ1 * v1, axis=1)[:, None], 0.0)
            if M > 2:
                DA2 += tl.where(sel, tl.sum(dZ2 * v2, axis=1)[:, None], 0.0)
            if M > 3:
                DA3 += tl.where(sel, tl.sum(dZ3 * v3, axis=1)[:, None], 0.0)
    # softmax and key-norm backward -> per-(source, stream) coefficients; layout st[token, which, r, k]
    sbase = st_ptr + rows64[:, None] * (12 * KP) + kk[None, :]
    smask = row_ok[:, None] & (kk[None, :] < KP)
    _store_coefs(sbase, smask, A0, DA0, DT0, RS0, D, KP, 0)
    if M > 1:
        _store_coefs(sbase, smask, A1, DA1, DT1, RS1, D, KP, 1)
    if M > 2:
        _store_coefs(sbase, smask, A2, DA2, DT2, RS2, D, KP, 2)
    if M > 3:
        _store_coefs(sbase, smask, A3, DA3, DT3, RS3, D, KP, 3)
    tb = tk_ptr + rows64 * 9
    tl.store(tb + 0, gs0, mask=row_ok)
    tl.store(tb + 1, gs1, mask=row_ok)
    tl.store(tb + 2, gs2, mask=row_ok)
    tl.store(tb + 3, gs3, mask=row_ok)
    tl.store(tb + 4, dp0, mask=row_ok)
    tl.store(tb + 5, dp1, mask=row_ok)
    tl.store(tb + 6, dp2, mask=row_ok)
    tl.store(tb + 7, dp3, mask=row_ok)
    tl.store(tb + 8, cz, mask=row_ok)


@triton.jit
def _store_coefs(sbase, smask, A, DA, DT, RS, D, KP: tl.constexpr, r: tl.constexpr):
    DS = A * (DA - tl.sum(A * DA, axis=1)[:, None])
    tl.store(sbase + r * KP, A, mask=smask)
    tl.store(sbase + (4 + r) * KP, DS * RS, mask=smask)
    tl.store(sbase + (8 + r) * KP, -DS * DT * RS * RS * RS / D, mask=smask)


@triton.jit
def _coef(st_ptr, rows64, row_ok, which: tl.constexpr, r: tl.constexpr, i, KP: tl.constexpr):
    return tl.load(st_ptr + rows64 * (12 * KP) + (which * 4 + r) * KP + i, mask=row_ok, other=0.0)


@triton.jit
def msar_bwd_kernel_grad(
    srcs, dsts,
    gh_ptr, u_ptr, wp, phiT, st_ptr, tk_ptr, du_ptr, dw_ptr, dphiT_ptr, scr_ptr,
    T, D, BTO,
    NSRC: tl.constexpr, M: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr,
    KMAX: tl.constexpr, KMAXP: tl.constexpr, KP: tl.constexpr, ET: tl.constexpr, BD: tl.constexpr,
    CONV_VALUES: tl.constexpr, SIGMOID: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    n_t = tl.cdiv(T, BTO)
    seq = pid // n_t
    e = tl.arange(0, ET)
    tpos = (pid % n_t) * BTO + e
    row_ok = tpos < T
    own = row_ok & (e < BTO)
    rows = seq * T + tpos
    rows64 = rows.to(tl.int64)
    kk = tl.arange(0, KP)
    tt = tl.arange(0, KMAXP)
    bd = tl.arange(0, BD)
    # per-token scalars (loop invariant)
    tb = tk_ptr + rows64 * 9
    gs0 = tl.load(tb + 0, mask=row_ok, other=0.0)
    gs1 = tl.load(tb + 1, mask=row_ok, other=0.0)
    gs2 = tl.load(tb + 2, mask=row_ok, other=0.0)
    gs3 = tl.load(tb + 3, mask=row_ok, other=0.0)
    dp0 = tl.load(tb + 4, mask=row_ok, other=0.0)
    dp1 = tl.load(tb + 5, mask=row_ok, other=0.0)
    dp2 = tl.load(tb + 6, mask=row_ok, other=0.0)
    dp3 = tl.load(tb + 7, mask=row_ok, other=0.0)
    cz = tl.load(tb + 8, mask=row_ok, other=0.0)
    amask = row_ok[:, None] & (kk[None, :] < NSRC)
    abase = st_ptr + rows64[:, None] * (12 * KP) + kk[None, :]
    A0 = tl.load(abase, mask=amask, other=0.0)
    A1 = tl.load(abase + KP, mask=amask, other=0.0)  # st is zero for absent streams
    A2 = tl.load(abase + 2 * KP, mask=amask, other=0.0)
    A3 = tl.load(abase + 3 * KP, mask=amask, other=0.0)
    scr = scr_ptr + pid.to(tl.int64) * (3 * ET * BD) + e[:, None] * BD + bd[None, :]
    for d0 in range(0, D, BD):
        cols = d0 + bd
        cm = cols < D
        m2 = row_ok[:, None] & cm[None, :]
        own2 = own[:, None] & cm[None, :]
        gh = tl.load(gh_ptr + rows64[:, None] * D + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        Z0, Z1, Z2, Z3 = _grad_mix(
            srcs, gh, A0, A1, A2, A3, kk, wp, rows, tpos, row_ok, cols, cm, D,
            NSRC, M, K1, K2, K3, KMAX, ET, BD, CONV_VALUES, SIGMOID,
        )  # fmt: skip
        if SIGMOID:
            # dφ[r·D + c, j] += Σ_t Z_r[t, c] dp_j[t] over the owned rows
            _dphi_add(dphiT_ptr, Z0, dp0, dp1, dp2, dp3, own, cols, cm, D, 0, M)
            if M > 1:
                _dphi_add(dphiT_ptr, Z1, dp0, dp1, dp2, dp3, own, cols, cm, D, 1, M)
            if M > 2:
                _dphi_add(dphiT_ptr, Z2, dp0, dp1, dp2, dp3, own, cols, cm, D, 2, M)
            if M > 3:
                _dphi_add(dphiT_ptr, Z3, dp0, dp1, dp2, dp3, own, cols, cm, D, 3, M)
        dZ0, dZ1, dZ2, dZ3 = _dzs(gh, Z0, Z1, Z2, Z3, gs0, gs1, gs2, gs3, dp0, dp1, dp2, dp3, cz, phiT, cols, cm, D,
                                  M, SIGMOID)  # fmt: skip
        u0 = tl.load(u_ptr + cols, mask=cm, other=0.0)[None, :]
        u1 = tl.load(u_ptr + D + cols, mask=cm, other=0.0)[None, :]  # u is padded to 4 streams
        u2 = tl.load(u_ptr + 2 * D + cols, mask=cm, other=0.0)[None, :]
        u3 = tl.load(u_ptr + 3 * D + cols, mask=cm, other=0.0)[None, :]
        du0, du1, du2, du3 = _zeros4v(BD)
        DW1 = tl.zeros((KMAXP, BD), tl.float32)
        DW2 = tl.zeros((KMAXP, BD), tl.float32)
        DW3 = tl.zeros((KMAXP, BD), tl.float32)
        for i in range(NSRC):
            sp = _pick(srcs, i, NSRC)
            x, v1, v2, v3 = _views(sp, wp, rows, tpos, row_ok, cols, cm, D, K1, K2, K3, KMAX)
            # stream 0: no conv, value always the raw source
            dx, val, d = _stream_grad(st_ptr, rows64, row_ok, own2, A0, kk, dZ0, u0, x, i, 0, KP, False)
            dx += val
            du0 += d
            dv1 = tl.zeros_like(x)
            dv2 = tl.zeros_like(x)
            dv3 = tl.zeros_like(x)
            if M > 1:
                dv1, val, d = _stream_grad(st_ptr, rows64, row_ok, own2, A1, kk, dZ1, u1, v1, i, 1, KP, CONV_VALUES)
                dx += val
                du1 += d
            if M > 2:
                dv2, val, d = _stream_grad(st_ptr, rows64, row_ok, own2, A2, kk, dZ2, u2, v2, i, 2, KP, CONV_VALUES)
                dx += val
                du2 += d
            if M > 3:
                dv3, val, d = _stream_grad(st_ptr, rows64, row_ok, own2, A3, kk, dZ3, u3, v3, i, 3, KP, CONV_VALUES)
                dx += val
                du3 += d
            if M > 1:
                # conv taps: dW_r[τ, c] += Σ_t dV_r[t, c] x[t-τ, c] over the owned rows
                for tau in tl.static_range(KMAX):
                    xs = _load_shift(sp, rows, tpos, own, cols, cm, D, tau)
                    sel = tt[:, None] == tau
                    if tau < K1:
                        DW1 = tl.where(sel, DW1 + tl.sum(dv1 * xs, axis=0)[None, :], DW1)
                    if tau < K2:
                        DW2 = tl.where(sel, DW2 + tl.sum(dv2 * xs, axis=0)[None, :], DW2)
                    if tau < K3:
                        DW3 = tl.where(sel, DW3 + tl.sum(dv3 * xs, axis=0)[None, :], DW3)
                # transposed conv through the scratch tile: dx[t] += Σ_τ W_r[τ] dV_r[t+τ]
                tl.store(scr, dv1)
                if M > 2:
                    tl.store(scr + ET * BD, dv2)
                if M > 3:
                    tl.store(scr + 2 * ET * BD, dv3)
                tl.debug_barrier()
                for tau in tl.static_range(KMAX):
                    sh = ((e + tau) < ET)[:, None] & (bd[None, :] < BD)
                    if tau < K1:
                        w1 = tl.load(wp + tau * D + cols, mask=cm, other=0.0)[None, :]
                        dx += w1 * tl.load(scr + tau * BD, mask=sh, other=0.0)
                    if tau < K2:
                        w2 = tl.load(wp + (KMAX + tau) * D + cols, mask=cm, other=0.0)[None, :]
                        dx += w2 * tl.load(scr + ET * BD + tau * BD, mask=sh, other=0.0)
                    if tau < K3:
                        w3 = tl.load(wp + (2 * KMAX + tau) * D + cols, mask=cm, other=0.0)[None, :]
                        dx += w3 * tl.load(scr + 2 * ET * BD + tau * BD, mask=sh, other=0.0)
                tl.debug_barrier()
            dxp = _pick(dsts, i, NSRC)
            tl.store(dxp + rows64[:, None] * D + cols[None, :], dx.to(dxp.dtype.element_ty), mask=own2)
        tl.atomic_add(du_ptr + cols, du0, mask=cm)
        if M > 1:
            tl.atomic_add(du_ptr + D + cols, du1, mask=cm)
            wmask = cm[None, :] & (tt[:, None] < K1)
            tl.atomic_add(dw_ptr + tt[:, None] * D + cols[None, :], DW1, mask=wmask)
        if M > 2:
            tl.atomic_add(du_ptr + 2 * D + cols, du2, mask=cm)
            wmask = cm[None, :] & (tt[:, None] < K2)
            tl.atomic_add(dw_ptr + (KMAX + tt[:, None]) * D + cols[None, :], DW2, mask=wmask)
        if M > 3:
            tl.atomic_add(du_ptr + 3 * D + cols, du3, mask=cm)
            wmask = cm[None, :] & (tt[:, None] < K3)
            tl.atomic_add(dw_ptr + (2 * KMAX + tt[:, None]) * D + cols[None, :], DW3, mask=wmask)


@triton.jit
def _dphi_add(dphiT_ptr, Zr, dp0, dp1, dp2, dp3, own, cols, cm, D, r: tl.constexpr, M: tl.constexpr):
    Zo = tl.where(own[:, None], Zr, 0.0)
    tl.atomic_add(dphiT_ptr + r * D + cols, tl.sum(Zo * dp0[:, None], axis=0), mask=cm)
    if M > 1:
        tl.atomic_add(dphiT_ptr + M * D + r * D + cols, tl.sum(Zo * dp1[:, None], axis=0), mask=cm)
    if M > 2:
        tl.atomic_add(dphiT_ptr + 2 * M * D + r * D + cols, tl.sum(Zo * dp2[:, None], axis=0), mask=cm)
    if M > 3:
        tl.atomic_add(dphiT_ptr + 3 * M * D + r * D + cols, tl.sum(Zo * dp3[:, None], axis=0), mask=cm)


# ----------------------------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------------------------


class _Prep:
    """Contiguous inputs, packed fp32 parameters and the compile-time configuration shared by fwd and bwd."""

    def __init__(self, sources, query, gain, conv, phi, bias, alpha, sigmoid_mixer):
        self.src = [s.contiguous() for s in sources]
        s0 = self.src[0]
        self.shape = s0.shape
        self.T, self.D = int(s0.shape[-2]), int(s0.shape[-1])
        self.N = s0.numel() // (self.T * self.D)
        self.ntok = self.N * self.T
        self.K = len(sources)
        self.M = int(query.shape[0])
        self.ks = [int(w.shape[-1]) for w in conv]
        self.KMAX = max([1, *self.ks])
        self.KS = (self.ks + [0, 0, 0])[:3]
        self.KP = max(2, pow2(self.K))
        dev = s0.device
        f32 = torch.float32
        self.u = torch.zeros(4, self.D, device=dev, dtype=f32)  # [4, D], zero rows for absent streams
        self.u[: self.M] = gain.to(f32) * query.to(f32)
        wp = torch.zeros(3, self.KMAX, self.D, device=dev, dtype=f32)
        for r, w in enumerate(conv):  # wp[r, τ, c] = W_r[c, k_r - 1 - τ]: tap τ reads x[t - τ]
            wp[r, : w.shape[-1]] = w.to(f32).flip(-1).t()
        self.wp = wp
        self.sigmoid = bool(sigmoid_mixer) and phi is not None
        if self.sigmoid:
            self.phiT = phi.to(f32).t().contiguous()  # [M, M·D]
            self.b = bias.to(f32).contiguous().reshape(-1)
            self.alpha = alpha.to(f32).reshape(1).contiguous()
        else:
            self.phiT = self.b = self.alpha = self.u  # unused placeholders
        self.ptrs = tuple(self.src)  # one tuple argument

    def consts(self, conv_values: bool) -> dict:
        return dict(
            NSRC=self.K, M=self.M, K1=self.KS[0], K2=self.KS[1], K3=self.KS[2], KMAX=self.KMAX, KP=self.KP,
            CONV_VALUES=bool(conv_values), SIGMOID=self.sigmoid,
        )  # fmt: skip


def msar_fwd(
    sources, query, gain, conv, phi, bias, alpha, eps, scale, conv_values=True, sigmoid_mixer=True, *, eps_mix=1e-6,
    block_t: int = FWD_TILES["block_t"], block_d: int = FWD_TILES["block_d"], num_warps: int = FWD_TILES["num_warps"],
) -> torch.Tensor:  # fmt: skip
    """Fused MSAR forward: conv views, m per-stream depth softmaxes, mixer and weighted sum in one kernel.

    Arguments and result: those of :func:`.reference.msar_mix_ref` (the op's one docstring; no ``left`` context),
    within :mod:`.limits` (K <= MAX_SOURCES, m <= MAX_STREAMS, k_r <= MAX_KERNEL). One program per ``block_t``
    consecutive tokens of one sequence; three passes over D in ``block_d`` chunks (logits; mixer statistics, skipped
    for the mean mixer; output), recomputing the causal conv views from shifted source loads each time. Only ``h``
    is written (all math in fp32). ``block_t``, ``block_d``, ``num_warps``: tiling (powers of two for the blocks;
    defaults :data:`.limits.FWD_TILES`).
    """
    p = _Prep(sources, query, gain, conv, phi, bias, alpha, sigmoid_mixer)
    out = torch.empty(p.shape, dtype=p.src[0].dtype, device=p.src[0].device)
    grid = (p.N * triton.cdiv(p.T, block_t),)
    msar_fwd_kernel[grid](
        p.ptrs, p.u, p.wp, p.phiT, p.b, p.alpha, out, p.T, p.D, float(eps), float(eps_mix),
        float(scale),
        BT=block_t, BD=block_d, num_warps=num_warps, **p.consts(conv_values),
    )  # fmt: skip
    return out


def msar_bwd(
    grad, sources, query, gain, conv, phi, bias, alpha, eps, scale, conv_values=True, sigmoid_mixer=True, *,
    eps_mix=1e-6, block_t: int | None = None, block_d: int | None = None, ext_t: int | None = None,
    block_d2: int | None = None, num_warps: int = BWD_TILES["num_warps"], grad_warps: int | None = None,
) -> list[torch.Tensor]:  # fmt: skip
    """Fused MSAR backward: every gradient of :func:`msar_fwd`, recomputing the forward from the inputs.

    Kernel 1 (``block_t`` tokens per program, ``block_d`` chunks) recomputes the logits, softmaxes and mixer
    statistics and a third pass of dZ·Y reductions, and writes per-token coefficients (``12·KP + 9`` fp32 per
    token) plus dα, db (fp32 ``tl.atomic_add`` of per-program sums). Kernel 2 (extended tiles of ``ext_t`` rows,
    owning ``ext_t - (k_max - 1)``, ``block_d2`` chunks) recomputes the views and dV, applies the transposed conv
    through a per-program scratch tile, writes the source gradients and adds per-program partial sums of the query,
    gain, conv-tap and φ gradients to fp32 buffers with ``tl.atomic_add``.

    Args:
        grad: ``[..., T, D]`` gradient of ``h`` (any strides; made contiguous). The rest: as :func:`msar_fwd`;
            tiling defaults :data:`.limits.BWD_TILES` (``ext_t`` must exceed k_max - 1); ``block_d2`` and
            ``grad_warps`` (kernel 2's warps) default to :func:`.limits.grad_tiles`, ``block_t`` and ``block_d`` to
            :func:`.limits.stats_tiles` (per arch).

    Returns:
        As :func:`.op.msar_mix_backward`: ``[*d_sources, d_query, d_gain, *d_conv]`` then ``[d_phi, d_bias,
        d_alpha]`` when ``phi`` is given, each in its input's dtype and shape.
    """
    p = _Prep(sources, query, gain, conv, phi, bias, alpha, sigmoid_mixer)
    dev, f32 = p.src[0].device, torch.float32
    gh = grad.contiguous()
    st = torch.zeros(p.ntok, 12, p.KP, device=dev, dtype=f32)
    tk = torch.zeros(p.ntok, 9, device=dev, dtype=f32)
    db = torch.zeros(4, device=dev, dtype=f32)
    dalpha = torch.zeros(1, device=dev, dtype=f32)
    consts = p.consts(conv_values)
    bt0, bd0 = stats_tiles(dev, p.sigmoid)
    block_t, block_d = block_t or bt0, block_d or bd0
    grid = (p.N * triton.cdiv(p.T, block_t),)
    msar_bwd_kernel_stats[grid](
        p.ptrs, gh, p.u, p.wp, p.phiT, p.b, p.alpha, st, tk, db, dalpha, p.T, p.D, float(eps),
        float(eps_mix), float(scale),
        BT=block_t, BD=block_d, num_warps=num_warps, **consts,
    )  # fmt: skip
    halo = p.KMAX - 1
    ET = ext_t or BWD_TILES["ext_t"]  # 32 rows own 21 with the default k_max = 12; 64 spills registers on sm_90 (ptxas -v)
    if ET <= halo:
        ET = pow2(halo + 1)
    d2, gw, gs = grad_tiles(dev)
    BD2 = block_d2 or d2
    gw = grad_warps or gw
    BTO = ET - halo
    n_prog = p.N * triton.cdiv(p.T, BTO)
    dx = [torch.empty_like(s) for s in p.src]  # separate tensors: outputs of a custom op may not alias
    du = torch.zeros(4, p.D, device=dev, dtype=f32)
    dw = torch.zeros(3, p.KMAX, p.D, device=dev, dtype=f32)
    dphiT = torch.zeros(p.M, p.M * p.D, device=dev, dtype=f32) if p.sigmoid else du
    scratch = torch.empty(n_prog * 3 * ET * BD2, device=dev, dtype=f32)
    msar_bwd_kernel_grad[(n_prog,)](
        p.ptrs, tuple(dx), gh, p.u, p.wp, p.phiT, st, tk, du, dw, dphiT, scratch,
        p.T, p.D, BTO,
        KMAXP=pow2(p.KMAX), ET=ET, BD=BD2, num_warps=gw, num_stages=gs, **consts,
    )  # fmt: skip
    du = du[: p.M]
    out = list(dx)
    out.append((du * gain.to(f32)).to(query.dtype))
    out.append((du * query.to(f32)).to(gain.dtype))
    for r, w in enumerate(conv):
        out.append(dw[r, : w.shape[-1]].t().flip(-1).to(w.dtype).contiguous())
    if phi is not None:
        if p.sigmoid:
            out += [
                dphiT.t().to(phi.dtype).contiguous(),
                db[: p.M].to(bias.dtype, copy=True),  # copies: tensors of their own, not views of the buffers
                dalpha.reshape(alpha.shape).to(alpha.dtype, copy=True),
            ]
        else:
            out += [torch.zeros_like(phi), torch.zeros_like(bias), torch.zeros_like(alpha)]
    return out
