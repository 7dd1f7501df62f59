"""Fused Triton kernels for the mHC site: coefficients (``mhc_coeffs``) and the two applies (``mhc_pre``,
``mhc_post``), forward and backward. Imported lazily by ``op.py`` only when ``dispatch.route`` picks the kernel.

Math and numerics: ``reference.py`` (DeepSeek-V4 numerics in paper orientation; spec shared/specs/mhc.md §8, §9).

Coefficients, per block of ``BT`` tokens (X flattened to ``[T, K]``, ``K = n·D``):

- forward (one kernel, one read of X): ``z = x @ φ`` on the tensor cores (``tl.dot`` over K-chunks) together with
  ``Σ x²``; ``r = (Σx²/K + ε)^{-1/2}``; ``mix = z·r``; the σ / 2σ of the pre / post columns; the Sinkhorn
  projection of the ``n×n`` logits on chip. Writes only pre ``[T, n]``, post ``[T, n]``, res ``[T, n, n]`` (fp32).
  The ``n²+2n`` columns of φ are gathered into two zero-padded tiles: ``PP = max(16, 2^⌈log2 2n⌉)`` pre/post
  columns and ``NP·NP`` res columns (``NP = max(4, 2^⌈log2 n⌉)``, column ``i·NP + j`` holds ``H_res[i, j]``), so the
  res accumulator reshapes to a ``[BT, NP, NP]`` tile (n = 4: 16 + 16 = 32 columns; n = 8: 16 + 64 = 80).
- backward kernel 1 (one read of X): recomputes ``z`` and ``Σx²``, back-propagates through σ / 2σ and through the
  Sinkhorn iterations (recomputed on chip, see ``_sinkhorn_bwd``), writes ``g_z = ∂L/∂z`` ``[T, PP + NP²]`` and
  the per-token scalar ``c = Σ(g_mix·mix)·r²/K`` (fp32), plus per-program partial sums for grad bias / grad α.
- backward kernel 2 (one more read of X, one write of grad X): grid over (K-chunks, token segments); each program
  holds its φ chunk, streams its tokens: ``grad x = g_z @ φᵀ − c·x`` and accumulates ``xᵀ @ g_z`` (grad φ) in
  registers; per-segment fp32 partials ``[S, K, PP + NP²]`` are summed with torch (deterministic, no atomics).

Applies (per block of tokens and D): ``u = Σ_i pre_i X_i`` and ``X' = H_res X + post ⊗ y`` read X once; their
backward kernels loop over D per token block and produce every gradient in one pass (the coefficient gradients
are per-token reductions over D, accumulated in registers; no cross-token reductions).

GEMM precision: ``tl.dot`` uses one TF32 MMA when ``torch.backends.cuda.matmul.allow_tf32`` is on (as the reference's
``x @ φ`` would) and otherwise "3xTF32" (operands split into a TF32 head and an fp32 tail, three MMAs; two when X is
bf16/fp16, whose values are exact in TF32): fp32 accuracy on the tensor cores, instead of the FMA path of
``input_precision="ieee"``, which would make these memory-bound kernels compute-bound.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_utils import num_sms
from .limits import SEG, apply_blocks, coeff_blocks, coeff_layout, coeff_x_blocks

__all__ = [
    "mhc_coeffs_fwd",
    "mhc_coeffs_bwd",
    "mhc_pre_fwd",
    "mhc_pre_bwd",
    "mhc_post_fwd",
    "mhc_post_bwd",
]

def _precision() -> str:
    """``"tf32"`` (one TF32 MMA) when PyTorch's fp32 matmuls may use TF32, else ``"3xtf32"`` (fp32-accurate)."""
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "3xtf32"



# ---------------------------------------------------------------------------------------------------------------
# Coefficients
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _norm_rows(A, eps):
    """T_r: divide each row (fixed output i) by its sum over inputs j (+eps). A: [BT, NP, NP]. A padded row sums to 0
    and stays 0 (eps may be 0: the last row normalisation with exact rows)."""
    s = tl.sum(A, axis=2)[:, :, None] + eps
    return A / tl.where(s > 0, s, 1.0)


@triton.jit
def _norm_cols(A, eps):
    """T_c: divide each column (fixed input j) by its sum over outputs i (+eps)."""
    return A / (tl.sum(A, axis=1)[:, None, :] + eps)


@triton.jit
def _pair(A, eps):
    return _norm_rows(_norm_cols(A, eps), eps)


@triton.jit
def _norm_rows_bwd(A, G, eps):
    """Gradient through Y = A / (Σ_j A + eps) given the input A and dL/dY = G: (G − Σ_j G·Y) / (Σ_j A + eps)."""
    s = tl.sum(A, axis=2)[:, :, None] + eps
    s = tl.where(s > 0, s, 1.0)
    Y = A / s
    return (G - tl.sum(G * Y, axis=2)[:, :, None]) / s


@triton.jit
def _norm_cols_bwd(A, G, eps):
    s = tl.sum(A, axis=1)[:, None, :] + eps
    Y = A / s
    return (G - tl.sum(G * Y, axis=1)[:, None, :]) / s


@triton.jit
def _sinkhorn_start(L, valid, eps):
    """softmax over outputs (axis 1) of the valid entries, +eps; padded entries are 0. Returns (A0, p)."""
    Lm = tl.where(valid, L, -1.0e30)
    m = tl.max(Lm, axis=1)
    e = tl.exp(Lm - m[:, None, :])
    p = e / tl.sum(e, axis=1)[:, None, :]
    p = tl.where(valid, p, 0.0)
    A0 = tl.where(valid, p + eps, 0.0)
    return A0, p


@triton.jit
def _sinkhorn_fwd(L, valid, eps, reps, P):
    """B0 = T_r(A0), B_{p+1} = T_r(T_c(B_p)) for p < P; the last T_r adds reps (eps, or 0 for exact rows)."""
    A0, p = _sinkhorn_start(L, valid, eps)
    B = _norm_rows(A0, tl.where(P == 0, reps, eps))
    for _p in range(P):
        B = _norm_rows(_norm_cols(B, eps), tl.where(_p == P - 1, reps, eps))
    return B


@triton.jit
def _sinkhorn_bwd(L, G, valid, eps, reps, P, SEG: tl.constexpr):
    """dL/dlogits of the Sinkhorn projection, recomputing the iterates on chip.

    The forward is B0 = T_r(A0), B_{p+1} = T_r(T_c(B_p)) for p < P = max(iters − 1, 0). Backward walks the pairs in reverse
    in segments of SEG pairs: each segment start is recomputed from B0, each pair input from its segment start, so
    the cost is about P·(P/SEG + SEG)/2 pair evaluations instead of P²/2, with two live [BT, NP, NP] tiles.
    """
    A0, p = _sinkhorn_start(L, valid, eps)
    B0 = _norm_rows(A0, eps)
    G = tl.where(valid, G, 0.0)
    nseg = (P + SEG - 1) // SEG
    for gi in range(nseg):
        start = (nseg - 1 - gi) * SEG
        Bs = B0
        for _s in range(start):
            Bs = _pair(Bs, eps)
        cnt = tl.minimum(start + SEG, P) - start
        for qi in range(cnt):
            Bp = Bs
            for _q in range(cnt - 1 - qi):
                Bp = _pair(Bp, eps)
            C = _norm_cols(Bp, eps)
            last = start + cnt - 1 - qi == P - 1  # the last pair's T_r adds reps
            G = tl.where(valid, _norm_rows_bwd(C, G, tl.where(last, reps, eps)), 0.0)
            G = tl.where(valid, _norm_cols_bwd(Bp, G, eps), 0.0)
    G = tl.where(valid, _norm_rows_bwd(A0, G, tl.where(P == 0, reps, eps)), 0.0)
    # softmax over outputs (axis 1): dL/dlogit = p·(G − Σ_i G·p); the +eps has unit derivative
    return tl.where(valid, p * (G - tl.sum(G * p, axis=1)[:, None, :]), 0.0)


@triton.jit
def _tf32_hi(a):
    """a with its mantissa truncated to TF32's 10 bits (exactly representable in TF32); a − hi is exact in fp32."""
    return (a.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _mma(a, b, acc, PREC: tl.constexpr, A_EXACT: tl.constexpr):
    """acc + a @ b for fp32 tiles on the tensor cores.

    PREC = "tf32": one TF32 MMA (what PyTorch does when TF32 is allowed). PREC = "3xtf32": split each operand into a
    TF32 head and an fp32 tail, hi·hi + hi·lo + lo·hi (the tail·tail term is below fp32 rounding), accurate to about
    fp32 at three MMAs instead of the slow FMA path of ``input_precision="ieee"``; A_EXACT (a holds bf16/fp16 values,
    exact in TF32) drops the a-tail term. The kernels are memory-bound, so the extra MMAs are free.
    """
    if PREC == "3xtf32":
        b_hi = _tf32_hi(b)
        b_lo = b - b_hi
        if A_EXACT:
            acc = tl.dot(a, b_lo, acc, input_precision="tf32")
            acc = tl.dot(a, b_hi, acc, input_precision="tf32")
        else:
            a_hi = _tf32_hi(a)
            a_lo = a - a_hi
            acc = tl.dot(a_lo, b_hi, acc, input_precision="tf32")
            acc = tl.dot(a_hi, b_lo, acc, input_precision="tf32")
            acc = tl.dot(a_hi, b_hi, acc, input_precision="tf32")
    else:
        acc = tl.dot(a, b, acc, input_precision=PREC)
    return acc


@triton.jit
def _coeffs_gemm(X, PHI, rows, rmask, T, K, M, cpp, cpp_ok, cr_col, cr_ok,
                 BT: tl.constexpr, BK: tl.constexpr, PP: tl.constexpr, NP: tl.constexpr, PREC: tl.constexpr,
                 XEXACT: tl.constexpr):
    """z = x @ φ for a token block (two padded column tiles) and Σ x², streaming X once over K."""
    acc_pp = tl.zeros([BT, PP], dtype=tl.float32)
    acc_r = tl.zeros([BT, NP * NP], dtype=tl.float32)
    ss = tl.zeros([BT], dtype=tl.float32)
    xrow = X + rows.to(tl.int64)[:, None] * K
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        kmask = ks < K
        x = tl.load(xrow + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        ss += tl.sum(x * x, axis=1)
        prow = PHI + ks.to(tl.int64)[:, None] * M
        p1 = tl.load(prow + cpp[None, :], mask=kmask[:, None] & cpp_ok[None, :], other=0.0).to(tl.float32)
        p2 = tl.load(prow + cr_col[None, :], mask=kmask[:, None] & cr_ok[None, :], other=0.0).to(tl.float32)
        acc_pp = _mma(x, p1, acc_pp, PREC, XEXACT)
        acc_r = _mma(x, p2, acc_r, PREC, XEXACT)
    return acc_pp, acc_r, ss


@triton.jit
def _coeff_columns(N: tl.constexpr, NP: tl.constexpr, PP: tl.constexpr):
    """The padded column layout: pre/post columns ``cpp`` (valid ``< 2N``) and res columns ``cr = i·NP + j`` (valid
    for ``i, j < N``) with their φ / bias column ``cr_col = 2N + i·N + j``."""
    cpp = tl.arange(0, PP)
    cpp_ok = cpp < 2 * N
    cr = tl.arange(0, NP * NP)
    ri = cr // NP
    rj = cr % NP
    cr_ok = (ri < N) & (rj < N)
    cr_col = 2 * N + ri * N + rj
    return cpp, cpp_ok, cr, cr_ok, cr_col


@triton.jit
def _coeffs_tile(X, PHI, ALPHA, T, K, M, eps, N: tl.constexpr, NP: tl.constexpr, PP: tl.constexpr, BT: tl.constexpr,
                 BK: tl.constexpr, PREC: tl.constexpr, XEXACT: tl.constexpr):
    """The program's ``BT`` tokens: the padded column layout, ``x @ φ`` (pre/post and res parts), the inverse RMS
    ``r`` and the three α. Returns ``(rows, rmask, cpp, cpp_ok, cr_ok, cr_col, acc_pp, acc_r, r, a0, a1, a2)``."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    rmask = rows < T
    cpp, cpp_ok, cr, cr_ok, cr_col = _coeff_columns(N, NP, PP)
    acc_pp, acc_r, ss = _coeffs_gemm(X, PHI, rows, rmask, T, K, M, cpp, cpp_ok, cr_col, cr_ok, BT, BK, PP, NP, PREC, XEXACT)
    r = 1.0 / tl.sqrt(ss / K + eps)
    a0 = tl.load(ALPHA).to(tl.float32)
    a1 = tl.load(ALPHA + 1).to(tl.float32)
    a2 = tl.load(ALPHA + 2).to(tl.float32)
    return rows, rmask, cpp, cpp_ok, cr_ok, cr_col, acc_pp, acc_r, r, a0, a1, a2


@triton.jit(do_not_specialize=["P"])
def mhc_coeffs_fwd_kernel(X, PHI, BIAS, ALPHA, PRE, POST, RES, T, K, M, eps, reps, P,
                       N: tl.constexpr, NP: tl.constexpr, PP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                       PREC: tl.constexpr, XEXACT: tl.constexpr):
    rows, rmask, cpp, cpp_ok, cr_ok, cr_col, acc_pp, acc_r, r, a0, a1, a2 = _coeffs_tile(
        X, PHI, ALPHA, T, K, M, eps, N, NP, PP, BT, BK, PREC, XEXACT
    )
    # pre / post
    b_pp = tl.load(BIAS + cpp, mask=cpp_ok, other=0.0).to(tl.float32)
    is_pre = cpp < N
    scale = tl.where(is_pre, a0, a1)
    s = tl.sigmoid(scale[None, :] * (acc_pp * r[:, None]) + b_pp[None, :])
    r64 = rows.to(tl.int64)
    tl.store(PRE + r64[:, None] * N + cpp[None, :], s + eps, mask=rmask[:, None] & is_pre[None, :])
    tl.store(POST + r64[:, None] * N + (cpp[None, :] - N), 2.0 * s,
             mask=rmask[:, None] & (cpp_ok & (cpp >= N))[None, :])
    # res: Sinkhorn on chip
    b_r = tl.load(BIAS + cr_col, mask=cr_ok, other=0.0).to(tl.float32)
    L = tl.reshape(a2 * (acc_r * r[:, None]) + b_r[None, :], BT, NP, NP)
    i3 = tl.arange(0, NP)[None, :, None]
    j3 = tl.arange(0, NP)[None, None, :]
    valid = (i3 < N) & (j3 < N)
    H = _sinkhorn_fwd(L, valid, eps, reps, P)
    rows3 = r64[:, None, None]
    tl.store(RES + rows3 * (N * N) + i3 * N + j3, H, mask=(rows3 < T) & valid)


@triton.jit(do_not_specialize=["P"])
def mhc_coeffs_bwd_kernel_coef(X, PHI, BIAS, ALPHA, GPRE, GPOST, GRES, GZ, CX, GB_PART, GA_PART, T, K, M, eps, reps, P,
                            N: tl.constexpr, NP: tl.constexpr, PP: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr,
                            BK: tl.constexpr, PREC: tl.constexpr, SEG: tl.constexpr, XEXACT: tl.constexpr):
    rows, rmask, cpp, cpp_ok, cr_ok, cr_col, acc_pp, acc_r, r, a0, a1, a2 = _coeffs_tile(
        X, PHI, ALPHA, T, K, M, eps, N, NP, PP, BT, BK, PREC, XEXACT
    )
    pid = tl.program_id(0)
    r64 = rows.to(tl.int64)
    cr = tl.arange(0, NP * NP)
    # pre / post: d/dz of σ(scale·mix + b) (+eps) and 2σ(·)
    mix_pp = acc_pp * r[:, None]
    b_pp = tl.load(BIAS + cpp, mask=cpp_ok, other=0.0).to(tl.float32)
    is_pre = cpp < N
    is_post = cpp_ok & (cpp >= N)
    scale = tl.where(is_pre, a0, a1)
    s = tl.sigmoid(scale[None, :] * mix_pp + b_pp[None, :])
    g_pre = tl.load(GPRE + r64[:, None] * N + cpp[None, :], mask=rmask[:, None] & is_pre[None, :], other=0.0)
    g_post = tl.load(GPOST + r64[:, None] * N + (cpp[None, :] - N), mask=rmask[:, None] & is_post[None, :], other=0.0)
    g_arg = (g_pre + 2.0 * g_post) * s * (1.0 - s)  # grad of the σ argument; zero on padding and masked rows
    gmix_pp = g_arg * scale[None, :]
    # res: Sinkhorn backward on chip
    mix_r = acc_r * r[:, None]
    b_r = tl.load(BIAS + cr_col, mask=cr_ok, other=0.0).to(tl.float32)
    L = tl.reshape(a2 * mix_r + b_r[None, :], BT, NP, NP)
    i3 = tl.arange(0, NP)[None, :, None]
    j3 = tl.arange(0, NP)[None, None, :]
    valid = (i3 < N) & (j3 < N)
    rows3 = r64[:, None, None]
    G = tl.load(GRES + rows3 * (N * N) + i3 * N + j3, mask=(rows3 < T) & valid, other=0.0)
    gL = tl.reshape(_sinkhorn_bwd(L, G, valid, eps, reps, P, SEG), BT, NP * NP)
    gmix_r = a2 * gL
    # RMS-after-GEMM: g_z = g_mix·r, c = Σ(g_mix·mix)·r²/K
    c = (tl.sum(gmix_pp * mix_pp, axis=1) + tl.sum(gmix_r * mix_r, axis=1)) * r * r / K
    gz_row = GZ + r64[:, None] * MP
    tl.store(gz_row + cpp[None, :], gmix_pp * r[:, None], mask=rmask[:, None])
    tl.store(gz_row + PP + cr[None, :], gmix_r * r[:, None], mask=rmask[:, None])
    tl.store(CX + r64, c, mask=rmask)
    # per-program partials for grad bias [MP] and grad α [4]
    tl.store(GB_PART + pid * MP + cpp, tl.sum(g_arg, axis=0))
    tl.store(GB_PART + pid * MP + PP + cr, tl.sum(gL, axis=0))
    t_pp = tl.sum(g_arg * mix_pp, axis=0)
    ga0 = tl.sum(tl.where(is_pre, t_pp, 0.0), axis=0)
    ga1 = tl.sum(tl.where(is_post, t_pp, 0.0), axis=0)
    ga2 = tl.sum(tl.sum(gL * mix_r, axis=1), axis=0)
    q = tl.arange(0, 4)
    tl.store(GA_PART + pid * 4 + q, tl.where(q == 0, ga0, tl.where(q == 1, ga1, tl.where(q == 2, ga2, 0.0))))


@triton.jit
def mhc_coeffs_bwd_kernel_x(X, PHI, GZ, CX, GX, GPHI_PART, T, K, M, blocks_per_seg,
                         N: tl.constexpr, NP: tl.constexpr, PP: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr,
                         BK: tl.constexpr, PREC: tl.constexpr, XEXACT: tl.constexpr):
    kb = tl.program_id(0)
    seg = tl.program_id(1)
    ks = kb * BK + tl.arange(0, BK)
    kmask = ks < K
    cpp, cpp_ok, cr, cr_ok, cr_col = _coeff_columns(N, NP, PP)
    prow = PHI + ks.to(tl.int64)[:, None] * M
    p1 = tl.load(prow + cpp[None, :], mask=kmask[:, None] & cpp_ok[None, :], other=0.0).to(tl.float32)
    p2 = tl.load(prow + cr_col[None, :], mask=kmask[:, None] & cr_ok[None, :], other=0.0).to(tl.float32)
    p1t = tl.trans(p1)
    p2t = tl.trans(p2)
    g1 = tl.zeros([BK, PP], dtype=tl.float32)
    g2 = tl.zeros([BK, NP * NP], dtype=tl.float32)
    nblk = tl.cdiv(T, BT)
    b0 = seg * blocks_per_seg
    b1 = tl.minimum(b0 + blocks_per_seg, nblk)
    for tb in range(b0, b1):
        rows = tb * BT + tl.arange(0, BT)
        rmask = rows < T
        r64 = rows.to(tl.int64)
        m2 = rmask[:, None] & kmask[None, :]
        x = tl.load(X + r64[:, None] * K + ks[None, :], mask=m2, other=0.0).to(tl.float32)
        gz1 = tl.load(GZ + r64[:, None] * MP + cpp[None, :], mask=rmask[:, None], other=0.0)
        gz2 = tl.load(GZ + r64[:, None] * MP + PP + cr[None, :], mask=rmask[:, None], other=0.0)
        c = tl.load(CX + r64, mask=rmask, other=0.0)
        gx = _mma(gz1, p1t, tl.zeros([BT, BK], dtype=tl.float32), PREC, False)
        gx = _mma(gz2, p2t, gx, PREC, False)
        gx = gx - c[:, None] * x
        tl.store(GX + r64[:, None] * K + ks[None, :], gx, mask=m2)
        xt = tl.trans(x)
        g1 = _mma(xt, gz1, g1, PREC, XEXACT)
        g2 = _mma(xt, gz2, g2, PREC, XEXACT)
    out = GPHI_PART + seg.to(tl.int64) * K * MP + ks.to(tl.int64)[:, None] * MP
    tl.store(out + cpp[None, :], g1, mask=kmask[:, None])
    tl.store(out + PP + cr[None, :], g2, mask=kmask[:, None])


_COLMAPS: dict[tuple[int, str], torch.Tensor] = {}


def _colmap(n: int, device: torch.device) -> torch.Tensor:
    """Index into the padded kernel column layout for each of the n²+2n φ columns."""
    key = (n, str(device))
    if key not in _COLMAPS:
        PP, NP = coeff_layout(n)
        idx = list(range(2 * n)) + [PP + i * NP + j for i in range(n) for j in range(n)]
        _COLMAPS[key] = torch.tensor(idx, dtype=torch.long, device=device)
    return _COLMAPS[key]


def mhc_coeffs_fwd(
    X: torch.Tensor, phi: torch.Tensor, bias: torch.Tensor, alpha: torch.Tensor, iters: int, eps: float,
    exact_rows: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused mHC coefficients (RMS of the flattened state, projection, σ / 2σ, Sinkhorn) in one kernel.

    Args:
        X: the n-stream state ``[..., n, D]`` (fp32/bf16/fp16).
        phi: ``[n·D, n²+2n]``; bias: ``[n²+2n]``; alpha: ``[3]`` (any of the three dtypes; read as fp32).
        iters: Sinkhorn iterations; eps: RMS epsilon, H_pre floor and Sinkhorn epsilon.
        exact_rows: the last Sinkhorn row normalisation without eps (rows of H_res sum to 1).

    Returns:
        (pre ``[..., n]``, post ``[..., n]``, res ``[..., n, n]``), fp32. X is read once; only these are written.
    """
    n, D = X.shape[-2], X.shape[-1]
    lead = X.shape[:-2]
    x = X.contiguous().reshape(-1, n * D)
    T, K = x.shape
    phi_c, bias_c, alpha_c = phi.contiguous(), bias.contiguous(), alpha.contiguous()
    M = n * n + 2 * n
    # outputs in their final shapes (contiguous: the kernel's flat [T, ...] indexing), not views of [T, ...] buffers
    pre = torch.empty(*lead, n, device=X.device, dtype=torch.float32)
    post = torch.empty(*lead, n, device=X.device, dtype=torch.float32)
    res = torch.empty(*lead, n, n, device=X.device, dtype=torch.float32)
    PP, NP = coeff_layout(n)
    BT, BK = coeff_blocks(T, n, X.device)
    mhc_coeffs_fwd_kernel[(triton.cdiv(T, BT),)](
        x, phi_c, bias_c, alpha_c, pre, post, res, T, K, M, float(eps), 0.0 if exact_rows else float(eps), max(int(iters) - 1, 0),
        N=n, NP=NP, PP=PP, BT=BT, BK=BK, PREC=_precision(), XEXACT=X.dtype != torch.float32,
        num_warps=4, num_stages=3,
    )
    return pre, post, res


def mhc_coeffs_bwd(
    X: torch.Tensor, phi: torch.Tensor, bias: torch.Tensor, alpha: torch.Tensor,
    gpre: torch.Tensor, gpost: torch.Tensor, gres: torch.Tensor, iters: int, eps: float,
    exact_rows: bool = False, segments: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`mhc_coeffs_fwd`: two kernels, two reads of X, one write of grad X.

    Kernel 1 (per token block) recomputes ``x @ φ``, ``Σ x²`` and the Sinkhorn iterates on chip and writes the
    per-token ``∂L/∂(xφ)`` (fp32 ``[T, PP+NP²]``) and RMS coefficient (fp32 ``[T]``), plus per-program fp32
    partials of grad bias / grad α (summed with torch). Kernel 2 (grid: K-chunks × token segments) writes grad X
    and per-segment fp32 partials of grad φ ``[S, K, PP+NP²]``, summed with torch — no atomics, deterministic.

    Args:
        X, phi, bias, alpha, iters, eps, exact_rows: as :func:`mhc_coeffs_fwd`.
        gpre, gpost: ``[..., n]``; gres: ``[..., n, n]`` — gradients of the three outputs.
        segments: token segments of kernel 2 (default: enough programs to fill the GPU twice).

    Returns:
        (grad X ``[..., n, D]`` in X's dtype, grad φ, grad bias, grad α in their own dtypes).
    """
    n, D = X.shape[-2], X.shape[-1]
    x = X.contiguous().reshape(-1, n * D)
    T, K = x.shape
    M = n * n + 2 * n
    phi_c, bias_c, alpha_c = phi.contiguous(), bias.contiguous(), alpha.contiguous()
    gpre_c = gpre.contiguous().reshape(T, n).float()
    gpost_c = gpost.contiguous().reshape(T, n).float()
    gres_c = gres.contiguous().reshape(T, n, n).float()
    PP, NP = coeff_layout(n)
    MP = PP + NP * NP
    BT, BK = coeff_blocks(T, n, X.device)
    nblk = triton.cdiv(T, BT)
    dev = X.device
    gz = torch.empty(T, MP, device=dev, dtype=torch.float32)
    cx = torch.empty(T, device=dev, dtype=torch.float32)
    gb_part = torch.empty(nblk, MP, device=dev, dtype=torch.float32)
    ga_part = torch.empty(nblk, 4, device=dev, dtype=torch.float32)
    prec = _precision()
    mhc_coeffs_bwd_kernel_coef[(nblk,)](
        x, phi_c, bias_c, alpha_c, gpre_c, gpost_c, gres_c, gz, cx, gb_part, ga_part, T, K, M, float(eps),
        0.0 if exact_rows else float(eps), max(int(iters) - 1, 0),
        N=n, NP=NP, PP=PP, MP=MP, BT=BT, BK=BK, PREC=prec, SEG=SEG, XEXACT=X.dtype != torch.float32,
        num_warps=4, num_stages=3,
    )
    # kernel 2: K-chunks of BK2 (a [BT2, BK2] slice of X per token block, limits.coeff_x_blocks), split into S segments
    BT2, BK2, nw2, ns2 = coeff_x_blocks(dev)
    nk, nblk2 = triton.cdiv(K, BK2), triton.cdiv(T, BT2)
    S = segments or max(1, min(nblk2, triton.cdiv(2 * num_sms(dev), nk)))
    S = max(1, min(int(S), nblk2))
    bps = triton.cdiv(nblk2, S)
    S = triton.cdiv(nblk2, bps)
    gx = torch.empty(X.shape, device=dev, dtype=X.dtype)  # X's shape, contiguous: the kernel's [T, K] layout
    gphi_part = torch.empty(S, K, MP, device=dev, dtype=torch.float32)
    mhc_coeffs_bwd_kernel_x[(nk, S)](
        x, phi_c, gz, cx, gx, gphi_part, T, K, M, bps,
        N=n, NP=NP, PP=PP, MP=MP, BT=BT2, BK=BK2, PREC=prec, XEXACT=X.dtype != torch.float32,
        num_warps=nw2, num_stages=ns2,
    )
    cols = _colmap(n, dev)
    gphi = gphi_part.sum(0).index_select(1, cols).to(phi.dtype)
    gbias = gb_part.sum(0).index_select(0, cols).to(bias.dtype)
    galpha = ga_part.sum(0)[:3].to(alpha.dtype, copy=True)  # a tensor of its own, not a slice of the sum
    return gx, gphi, gbias, galpha


# ---------------------------------------------------------------------------------------------------------------
# Applies
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def mhc_pre_fwd_kernel(X, PRE, U, T, D, N: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    ds = tl.program_id(1) * BD + tl.arange(0, BD)
    i = tl.arange(0, NP)
    r64 = rows.to(tl.int64)
    rmask = rows < T
    m3 = rmask[:, None, None] & (i < N)[None, :, None] & (ds < D)[None, None, :]
    x = tl.load(X + r64[:, None, None] * (N * D) + i[None, :, None] * D + ds[None, None, :], mask=m3, other=0.0)
    w = tl.load(PRE + r64[:, None] * N + i[None, :], mask=rmask[:, None] & (i < N)[None, :], other=0.0)
    u = tl.sum(w.to(tl.float32)[:, :, None] * x.to(tl.float32), axis=1)
    tl.store(U + r64[:, None] * D + ds[None, :], u, mask=rmask[:, None] & (ds < D)[None, :])


@triton.jit
def mhc_pre_bwd_kernel(X, PRE, GU, GX, GPRE, T, D, N: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr,
                    BD: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    i = tl.arange(0, NP)
    r64 = rows.to(tl.int64)
    rmask = rows < T
    imask = i < N
    w = tl.load(PRE + r64[:, None] * N + i[None, :], mask=rmask[:, None] & imask[None, :], other=0.0).to(tl.float32)
    gw = tl.zeros([BT, NP], dtype=tl.float32)
    for d0 in range(0, D, BD):
        ds = d0 + tl.arange(0, BD)
        dmask = ds < D
        gu = tl.load(GU + r64[:, None] * D + ds[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
        gu = gu.to(tl.float32)
        m3 = rmask[:, None, None] & imask[None, :, None] & dmask[None, None, :]
        off3 = r64[:, None, None] * (N * D) + i[None, :, None] * D + ds[None, None, :]
        x = tl.load(X + off3, mask=m3, other=0.0).to(tl.float32)
        tl.store(GX + off3, w[:, :, None] * gu[:, None, :], mask=m3)
        gw += tl.sum(gu[:, None, :] * x, axis=2)
    tl.store(GPRE + r64[:, None] * N + i[None, :], gw, mask=rmask[:, None] & imask[None, :])


@triton.jit
def mhc_post_fwd_kernel(X, RES, POST, Y, OUT, T, D, N: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr,
                     BD: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    ds = tl.program_id(1) * BD + tl.arange(0, BD)
    i = tl.arange(0, NP)
    r64 = rows.to(tl.int64)
    rmask = rows < T
    imask = i < N
    dmask = ds < D
    m3 = rmask[:, None, None] & imask[None, :, None] & dmask[None, None, :]
    m2 = rmask[:, None] & dmask[None, :]
    x = tl.load(X + r64[:, None, None] * (N * D) + i[None, :, None] * D + ds[None, None, :], mask=m3, other=0.0)
    x = x.to(tl.float32)
    y = tl.load(Y + r64[:, None] * D + ds[None, :], mask=m2, other=0.0).to(tl.float32)
    for j in tl.static_range(N):
        rj = tl.load(RES + r64[:, None] * (N * N) + j * N + i[None, :], mask=rmask[:, None] & imask[None, :], other=0.0)
        pj = tl.load(POST + r64 * N + j, mask=rmask, other=0.0).to(tl.float32)
        o = tl.sum(rj.to(tl.float32)[:, :, None] * x, axis=1) + pj[:, None] * y
        tl.store(OUT + r64[:, None] * (N * D) + j * D + ds[None, :], o, mask=m2)


@triton.jit
def mhc_post_bwd_kernel(X, RES, POST, Y, GO, GX, GRES, GPOST, GY, T, D, N: tl.constexpr, NP: tl.constexpr,
                     BT: tl.constexpr, BD: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    i = tl.arange(0, NP)
    r64 = rows.to(tl.int64)
    rmask = rows < T
    imask = i < N
    jj = tl.arange(0, NP)[None, :, None]
    gres = tl.zeros([BT, NP, NP], dtype=tl.float32)
    gpost = tl.zeros([BT, NP], dtype=tl.float32)
    for d0 in range(0, D, BD):
        ds = d0 + tl.arange(0, BD)
        dmask = ds < D
        m2 = rmask[:, None] & dmask[None, :]
        m3 = rmask[:, None, None] & imask[None, :, None] & dmask[None, None, :]
        off3 = r64[:, None, None] * (N * D) + i[None, :, None] * D + ds[None, None, :]
        x = tl.load(X + off3, mask=m3, other=0.0).to(tl.float32)
        y = tl.load(Y + r64[:, None] * D + ds[None, :], mask=m2, other=0.0).to(tl.float32)
        gx = tl.zeros([BT, NP, BD], dtype=tl.float32)
        gy = tl.zeros([BT, BD], dtype=tl.float32)
        for j in tl.static_range(N):
            go = tl.load(GO + r64[:, None] * (N * D) + j * D + ds[None, :], mask=m2, other=0.0).to(tl.float32)
            rj = tl.load(RES + r64[:, None] * (N * N) + j * N + i[None, :], mask=rmask[:, None] & imask[None, :],
                         other=0.0).to(tl.float32)
            pj = tl.load(POST + r64 * N + j, mask=rmask, other=0.0).to(tl.float32)
            gx += rj[:, :, None] * go[:, None, :]
            gy += pj[:, None] * go
            gres += tl.where(jj == j, tl.sum(go[:, None, :] * x, axis=2)[:, None, :], 0.0)
            gpost += tl.where(i[None, :] == j, tl.sum(go * y, axis=1)[:, None], 0.0)
        tl.store(GX + off3, gx, mask=m3)
        tl.store(GY + r64[:, None] * D + ds[None, :], gy, mask=m2)
    j3 = tl.arange(0, NP)[None, None, :]
    rows3 = r64[:, None, None]
    tl.store(GRES + rows3 * (N * N) + jj * N + j3, gres, mask=(rows3 < T) & (jj < N) & (j3 < N))
    tl.store(GPOST + r64[:, None] * N + i[None, :], gpost, mask=rmask[:, None] & imask[None, :])


def _pre_inputs(X: torch.Tensor, pre: torch.Tensor):
    """``(n, D, T, x [T, n, D], pre [T, n])``, contiguous, for the apply kernels."""
    n, D = X.shape[-2], X.shape[-1]
    x = X.contiguous().reshape(-1, n, D)
    T = x.shape[0]
    return n, D, T, x, pre.contiguous().reshape(T, n)


def _post_inputs(X: torch.Tensor, res: torch.Tensor, post: torch.Tensor, y: torch.Tensor):
    """``(n, D, T, x [T, n, D], res [T, n, n], post [T, n], y [T, D])``, contiguous, for the apply kernels."""
    n, D, T, x, p = _pre_inputs(X, post)
    return n, D, T, x, res.contiguous().reshape(T, n, n), p, y.contiguous().reshape(T, D)


def mhc_pre_fwd(X: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """u = Σ_i pre_i X_i, one read of X.

    Args:
        X: ``[..., n, D]``; pre: ``[..., n]`` (any of fp32/bf16/fp16; fp32 accumulation).

    Returns:
        u ``[..., D]`` in X's dtype.
    """
    n, D, T, x, w = _pre_inputs(X, pre)
    u = torch.empty(*X.shape[:-2], D, device=X.device, dtype=X.dtype)  # final shape: no view of a [T, D] buffer
    NP, BT, BD = apply_blocks(T, D, n)
    mhc_pre_fwd_kernel[(triton.cdiv(T, BT), triton.cdiv(D, BD))](x, w, u, T, D, N=n, NP=NP, BT=BT, BD=BD, num_warps=4)
    return u


def mhc_pre_bwd(X: torch.Tensor, pre: torch.Tensor, gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of :func:`mhc_pre_fwd` in one pass over D per token block (reads X, grad u once).

    Args:
        X: ``[..., n, D]``; pre: ``[..., n]``; gu: ``[..., D]`` (grad of u).

    Returns:
        (grad X = pre ⊗ gu in X's dtype, grad pre = ⟨gu, X_i⟩ in pre's dtype); per-token reductions over D.
    """
    n, D, T, x, w = _pre_inputs(X, pre)
    g = gu.contiguous().reshape(T, D)
    gx = torch.empty(X.shape, device=X.device, dtype=X.dtype)
    gw = torch.empty(pre.shape, device=X.device, dtype=torch.float32)
    NP, BT, BD = apply_blocks(T, D, n)
    mhc_pre_bwd_kernel[(triton.cdiv(T, BT),)](x, w, g, gx, gw, T, D, N=n, NP=NP, BT=BT, BD=BD, num_warps=4)
    return gx, gw.to(pre.dtype)


def mhc_post_fwd(X: torch.Tensor, res: torch.Tensor, post: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """X' = H_res X + post ⊗ y (the residual merge), one read of X and y, one write of X'.

    Args:
        X: ``[..., n, D]``; res: ``[..., n, n]`` ([out, in]); post: ``[..., n]``; y: ``[..., D]``.

    Returns:
        X' ``[..., n, D]`` in X's dtype (fp32 accumulation).
    """
    n, D, T, x, r, p, yy = _post_inputs(X, res, post, y)
    out = torch.empty(X.shape, device=X.device, dtype=X.dtype)
    NP, BT, BD = apply_blocks(T, D, n)
    mhc_post_fwd_kernel[(triton.cdiv(T, BT), triton.cdiv(D, BD))](
        x, r, p, yy, out, T, D, N=n, NP=NP, BT=BT, BD=BD, num_warps=4
    )
    return out


def mhc_post_bwd(
    X: torch.Tensor, res: torch.Tensor, post: torch.Tensor, y: torch.Tensor, gout: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`mhc_post_fwd` in one pass over D per token block (reads X, y, grad X' once).

    Args:
        X: ``[..., n, D]``; res: ``[..., n, n]``; post: ``[..., n]``; y: ``[..., D]``; gout: ``[..., n, D]`` (grad X').

    Returns:
        (grad X = H_resᵀ gX' in X's dtype, grad res ``[j, i] = ⟨gX'_j, X_i⟩``, grad post ``[j] = ⟨gX'_j, y⟩``,
        grad y = Σ_j post_j gX'_j), each in its input's dtype; the coefficient grads are per-token reductions over D.
    """
    n, D, T, x, r, p, yy = _post_inputs(X, res, post, y)
    go = gout.contiguous().reshape(T, n, D)
    gx = torch.empty(X.shape, device=X.device, dtype=X.dtype)  # final shapes, contiguous (the kernels' flat layout)
    gy = torch.empty(y.shape, device=X.device, dtype=y.dtype)
    gr = torch.empty(res.shape, device=X.device, dtype=torch.float32)
    gp = torch.empty(post.shape, device=X.device, dtype=torch.float32)
    NP, BT, BD = apply_blocks(T, D, n)
    mhc_post_bwd_kernel[(triton.cdiv(T, BT),)](x, r, p, yy, go, gx, gr, gp, gy, T, D, N=n, NP=NP, BT=BT, BD=BD,
                                             num_warps=4)
    return gx, gr.to(res.dtype), gp.to(post.dtype), gy
