"""Fused Triton kernels for ``depthrewrite::moda_attn`` (MoDA's joint softmax over sequence keys and depth slots).

Imported lazily by ``op.py`` only when :func:`depthrewrite.kernels.dispatch.route` picks the kernel, because
``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates and CPU users must never pay for importing Triton.

Layout (spec: shared/specs/moda.md §2, §4, §5, §8 Q8)
-------------------------------------------------------
GQA is folded into the rows of a program, as in the MoDA authors' kernel: a program owns ``BMT`` query tokens of
one batch row and **all G query heads of one KV head**, i.e. ``BM = BMT · GP`` rows (``GP`` = G rounded up to a power
of two; rows ``tt · GP + j`` with ``j >= G`` are masked). Each K/V tile loaded from HBM is therefore used by the G
heads that share it, and each token's ``n`` depth slots (token-major ``[B, T, n, Hk, d]``) are read by exactly one
program, which lets the backward write the depth gradients without atomics.

Forward (``moda_attn_fwd_kernel``, grid ``(cdiv(T, BMT), B·Hk)``): one fp32 online-softmax state ``(m, l, acc)`` per row.
First the ``n`` depth slots of the row's token (a per-slot CUDA-core dot ``q·Kd_i`` on ``[BM, d]`` tiles, weighted by
``λ`` through ``log λ`` added to the logit, so λ = 0 stays exact), then the sequence keys in ``BN`` blocks with
``tl.dot`` for QKᵀ and PV: fully visible blocks without masks, then the causal diagonal / ragged tail with masks.
Logit soft-capping (``c·tanh(x/c)``) applies to both parts; a boolean or additive mask (any broadcast of
``[B, Hq, T, S]``, read through its strides, never materialised) to the sequence part only. Writes ``o`` in SDPA's
layout and the per-row LSE (natural log, fp32, ``[B, Hq, T]``; 4 bytes per row, 1/64 of ``o`` at bf16 d = 128).

Backward: ``δ = rowsum(o ⊙ do)`` (torch, fp32); ``moda_attn_fwd_kernel`` in ``STATS_ONLY`` mode recomputes the LSE (the public
op's schema returns ``o`` only, so the LSE cannot be saved across the autograd boundary — one extra QKᵀ pass:
10 [T×S]-sized matmul passes for forward+backward instead of FlashAttention-2's 9, about +11 %); ``moda_attn_bwd_kernel_dq`` (query-block parallel, same folded rows) recomputes P and writes
dQ (sequence + depth), the depth gradients ``dKd``/``dVd`` (the G heads of a group reduced in registers), per-row
partials of dλ (summed over tokens with torch: deterministic, no atomics) and, when an additive mask needs a
gradient, ``dS`` into an fp32 ``[B, Hq, T, S]`` buffer that torch reduces to the mask's shape;
``moda_attn_bwd_kernel_dkdv`` (key-block parallel) accumulates dK/dV over every query row of the group (G heads folded).
All reductions are per-program; no atomics anywhere, so the backward is deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_utils import dot_precision
from .limits import block_config

__all__ = ["moda_attn_fwd", "moda_attn_bwd", "block_config"]

# ----------------------------------------------------------------------------------------------------------------
# shared device helpers


@triton.jit
def _rows(pid_m, kvh, G, T, BMT: tl.constexpr, GP: tl.constexpr):
    """Folded rows of a program: token index, query head, validity (``BM = BMT · GP`` rows)."""
    r = tl.arange(0, BMT * GP)
    tok = pid_m * BMT + r // GP
    j = r % GP
    head = kvh * G + j
    ok = (tok < T) & (j < G)
    return tok, head, ok


@triton.jit
def _query_tile(Q, sqb, sqh, sqt, sqd, Hk, G, T, d, BMT: tl.constexpr, GP: tl.constexpr, BD: tl.constexpr):
    """The program's folded query rows (grid ``(cdiv(T, BMT), B·Hk)``) and their ``q`` tile ``[BMT·GP, BD]``.

    Returns ``(pid_m, b64, kvh, tok, head, row_ok, offs_d, d_ok, ld, q)``; ``ld`` masks the valid rows and head
    dims."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hk
    kvh = pid_bh % Hk
    b64 = b.to(tl.int64)
    tok, head, row_ok = _rows(pid_m, kvh, G, T, BMT, GP)
    tok64 = tok.to(tl.int64)
    head64 = head.to(tl.int64)
    offs_d = tl.arange(0, BD)
    d_ok = offs_d < d
    ld = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b64 * sqb + head64[:, None] * sqh + tok64[:, None] * sqt + offs_d[None, :] * sqd, mask=ld, other=0.0)
    return pid_m, b64, kvh, tok, head, row_ok, offs_d, d_ok, ld, q


@triton.jit
def _tanh(x):
    # no libdevice: tanh(x) = 1 - 2 / (exp(2x) + 1), exact limits at ±inf
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _seq_logits(
    s,
    tok,
    head,
    row_ok,
    offs_n,
    b64,
    S,
    MASK,
    smb,
    smh,
    smt,
    sms,
    softcap,
    SOFTCAP: tl.constexpr,
    MASK_KIND: tl.constexpr,
    CAUSAL: tl.constexpr,
    CHECK: tl.constexpr,
):
    """Soft-cap, then the sequence masks (causal, bool or additive tensor, ragged tail) on a ``[BM, BN]`` tile."""
    if SOFTCAP:
        s = softcap * _tanh(s / softcap)
    if MASK_KIND != 0:
        mptr = (
            MASK
            + b64 * smb
            + head.to(tl.int64)[:, None] * smh
            + tok.to(tl.int64)[:, None] * smt
            + offs_n.to(tl.int64)[None, :] * sms
        )
        inb = row_ok[:, None] & (offs_n[None, :] < S)
        mv = tl.load(mptr, mask=inb, other=0)
        if MASK_KIND == 1:
            s = tl.where(mv != 0, s, float("-inf"))
        else:
            s = s + mv.to(tl.float32)
    if CHECK:
        keep = offs_n[None, :] < S
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= tok[:, None])
        s = tl.where(keep, s, float("-inf"))
    return s


# ----------------------------------------------------------------------------------------------------------------
# forward


@triton.jit
def moda_attn_fwd_kernel(
    Q, K, V, KD, VD, LAM, MASK, O, LSE,
    sqb, sqh, sqt, sqd,
    skb, skh, sks, skd,
    svb, svh, svs, svd,
    sdb, sdt, sdn, sdh, sdd,
    seb, set_, sen, seh, sed,
    smb, smh, smt, sms,
    sob, soh, sot, sod,
    Hq, Hk, G, T, S, NSLOT, d, dv,
    scale, softcap,
    BMT: tl.constexpr, GP: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    HAS_LAM: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr,
    STATS_ONLY: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_m, b64, kvh, tok, head, row_ok, offs_d, d_ok, ld, q = _query_tile(
        Q, sqb, sqh, sqt, sqd, Hk, G, T, d, BMT, GP, BD
    )
    tok64 = tok.to(tl.int64)
    head64 = head.to(tl.int64)
    qf = q.to(tl.float32)
    offs_v = tl.arange(0, BDV)  # value head dims (MLA: narrower than the query/key head dim)
    v_ok = offs_v < dv
    ldv = row_ok[:, None] & v_ok[None, :]

    m_i = tl.full([BMT * GP], float("-inf"), tl.float32)
    l_i = tl.zeros([BMT * GP], tl.float32)
    acc = tl.zeros([BMT * GP, BDV], tl.float32)

    # λ enters as log λ on the depth logits (λ clamped at 0: log 0 = -inf drops the depth part exactly)
    if HAS_LAM:
        lam = tl.load(LAM + head, mask=row_ok, other=1.0).to(tl.float32)
        lam = tl.maximum(lam, 0.0)
        loglam = tl.where(lam > 0.0, tl.log(tl.maximum(lam, 1e-30)), float("-inf"))
    else:
        loglam = tl.zeros([BMT * GP], tl.float32)

    # ---- depth part: the n slots of the row's own token (same online state) ----
    kd_base = KD + b64 * sdb + tok64[:, None] * sdt + kvh.to(tl.int64) * sdh + offs_d[None, :] * sdd
    vd_base = VD + b64 * seb + tok64[:, None] * set_ + kvh.to(tl.int64) * seh + offs_v[None, :] * sed
    for i in range(0, NSLOT):
        kd = tl.load(kd_base + i * sdn, mask=ld, other=0.0).to(tl.float32)
        s = tl.sum(qf * kd, axis=1) * scale
        if SOFTCAP:
            s = softcap * _tanh(s / softcap)
        s = s + loglam
        m_new = tl.maximum(m_i, s)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use)
        l_i = l_i * alpha + p
        if not STATS_ONLY:
            vd = tl.load(vd_base + i * sen, mask=ldv, other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + p[:, None] * vd
        m_i = m_new

    # ---- sequence part: full blocks without masks, then the causal diagonal / ragged tail ----
    t0 = pid_m * BMT
    if CAUSAL:
        hi = tl.minimum(S, t0 + BMT)
        full = (tl.minimum(t0, S) // BN) * BN
    else:
        hi = S
        full = (S // BN) * BN
    offs_n0 = tl.arange(0, BN)
    k_base = K + b64 * skb + kvh.to(tl.int64) * skh + offs_d[:, None] * skd
    v_base = V + b64 * svb + kvh.to(tl.int64) * svh + offs_v[None, :] * svd
    for phase in tl.static_range(2):
        if phase == 0:
            lo_p = 0
            hi_p = full
        else:
            lo_p = full
            hi_p = hi
        for start_n in range(lo_p, hi_p, BN):
            offs_n = start_n + offs_n0
            n_ok = offs_n < S
            kt = tl.load(k_base + offs_n.to(tl.int64)[None, :] * sks, mask=d_ok[:, None] & n_ok[None, :], other=0.0)
            s = tl.dot(q, kt, input_precision=DOT_PREC) * scale
            s = _seq_logits(s, tok, head, row_ok, offs_n, b64, S, MASK, smb, smh, smt, sms, softcap,
                            SOFTCAP, MASK_KIND, CAUSAL, phase == 1)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_use)
            p = tl.exp(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if not STATS_ONLY:
                vt = tl.load(v_base + offs_n.to(tl.int64)[:, None] * svs, mask=n_ok[:, None] & v_ok[None, :], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PREC)
            m_i = m_new

    lse = m_i + tl.log(l_i)
    tl.store(LSE + (b64 * Hq + head64) * T + tok64, lse, mask=row_ok)
    if not STATS_ONLY:
        # a row with nothing visible (no sequence key, λ = 0: a pad query row under a padding mask) outputs 0, as
        # SDPA does, not 0/0 (the next layer's masked keys would carry the NaN into every real row through P·V)
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            O + b64 * sob + head64[:, None] * soh + tok64[:, None] * sot + offs_v[None, :] * sod,
            o.to(O.dtype.element_ty),
            mask=ldv,
        )


# ----------------------------------------------------------------------------------------------------------------
# backward


@triton.jit
def _bwd_lse(LSE, row, row_ok):
    """The rows' joint LSE for the backward: +inf where the forward found nothing visible (lse = -inf), so that every
    probability ``exp(s − lse)`` of such a row is 0 (its output is 0 and gets no gradient), not ``exp(-inf + inf)``."""
    lse = tl.load(LSE + row, mask=row_ok, other=0.0)
    return tl.where(lse == float("-inf"), float("inf"), lse)


@triton.jit
def moda_attn_bwd_kernel_dq(
    Q, K, V, KD, VD, LAM, MASK, DO, LSE, DELTA,
    DQ, DKD, DVD, DLAM, DS,
    sqb, sqh, sqt, sqd,
    skb, skh, sks, skd,
    svb, svh, svs, svd,
    sdb, sdt, sdn, sdh, sdd,
    seb, set_, sen, seh, sed,
    smb, smh, smt, sms,
    sgb, sgh, sgt, sgd,
    Hq, Hk, G, T, S, NSLOT, d, dv,
    scale, softcap,
    BMT: tl.constexpr, GP: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    HAS_LAM: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr,
    STORE_DS: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_m, b64, kvh, tok, head, row_ok, offs_d, d_ok, ld, q = _query_tile(
        Q, sqb, sqh, sqt, sqd, Hk, G, T, d, BMT, GP, BD
    )
    tok64 = tok.to(tl.int64)
    head64 = head.to(tl.int64)
    kvh64 = kvh.to(tl.int64)
    offs_v = tl.arange(0, BDV)
    v_ok = offs_v < dv
    ldv = row_ok[:, None] & v_ok[None, :]
    do = tl.load(DO + b64 * sgb + head64[:, None] * sgh + tok64[:, None] * sgt + offs_v[None, :] * sgd, mask=ldv,
                 other=0.0)
    qf = q.to(tl.float32)
    dof = do.to(tl.float32)
    row = (b64 * Hq + head64) * T + tok64
    lse = _bwd_lse(LSE, row, row_ok)
    delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
    dq = tl.zeros([BMT * GP, BD], tl.float32)

    if HAS_LAM:
        lam = tl.load(LAM + head, mask=row_ok, other=1.0).to(tl.float32)
        lam = tl.maximum(lam, 0.0)
        loglam = tl.where(lam > 0.0, tl.log(tl.maximum(lam, 1e-30)), float("-inf"))
    else:
        loglam = tl.zeros([BMT * GP], tl.float32)
    dlam = tl.zeros([BMT * GP], tl.float32)

    # ---- depth part: dq, dKd / dVd per (token, slot) with the G heads of the group reduced in registers ----
    t0 = pid_m * BMT
    offs_t = t0 + tl.arange(0, BMT)
    t_ok = offs_t < T
    st = t_ok[:, None] & d_ok[None, :]
    stv = t_ok[:, None] & v_ok[None, :]
    kd_base = KD + b64 * sdb + tok64[:, None] * sdt + kvh64 * sdh + offs_d[None, :] * sdd
    vd_base = VD + b64 * seb + tok64[:, None] * set_ + kvh64 * seh + offs_v[None, :] * sed
    # dKd / dVd are contiguous [B, T, n, Hk, d] and [B, T, n, Hk, dv] (allocated by the launcher)
    gd_base = (((b64 * T + offs_t.to(tl.int64)[:, None]) * NSLOT) * Hk + kvh64) * d + offs_d[None, :]
    gv_base = (((b64 * T + offs_t.to(tl.int64)[:, None]) * NSLOT) * Hk + kvh64) * dv + offs_v[None, :]
    for i in range(0, NSLOT):
        kd = tl.load(kd_base + i * sdn, mask=ld, other=0.0).to(tl.float32)
        vd = tl.load(vd_base + i * sen, mask=ldv, other=0.0).to(tl.float32)
        s = tl.sum(qf * kd, axis=1) * scale
        if SOFTCAP:
            s = softcap * _tanh(s / softcap)
        # exp-weight without λ (dλ's; finite where λ = 0 leaves a row's mass at ~1e-38 under a finfo.min mask), and
        # with λ, as e^{s + log λ − lse}: exactly 0 at λ = 0, never 0·∞
        e = tl.where(row_ok, tl.minimum(tl.exp(s - lse), 3.4028234663852886e38), 0.0)
        p = tl.where(row_ok, tl.exp(s + loglam - lse), 0.0)
        dp = tl.sum(dof * vd, axis=1)
        dlam += e * (dp - delta)
        ds = p * (dp - delta)
        if SOFTCAP:
            t_ = s / softcap
            ds = ds * (1.0 - t_ * t_)
        dq += ds[:, None] * kd
        dkd = tl.sum(tl.reshape(ds[:, None] * qf, (BMT, GP, BD)), axis=1) * scale
        dvd = tl.sum(tl.reshape(p[:, None] * dof, (BMT, GP, BDV)), axis=1)
        tl.store(DKD + gd_base + i * (Hk * d), dkd.to(DKD.dtype.element_ty), mask=st)
        tl.store(DVD + gv_base + i * (Hk * dv), dvd.to(DVD.dtype.element_ty), mask=stv)
    if HAS_LAM:
        tl.store(DLAM + row, dlam, mask=row_ok)

    # ---- sequence part ----
    if CAUSAL:
        hi = tl.minimum(S, t0 + BMT)
        full = (tl.minimum(t0, S) // BN) * BN
    else:
        hi = S
        full = (S // BN) * BN
    offs_n0 = tl.arange(0, BN)
    k_base = K + b64 * skb + kvh64 * skh
    v_base = V + b64 * svb + kvh64 * svh
    for phase in tl.static_range(2):
        if phase == 0:
            lo_p = 0
            hi_p = full
        else:
            lo_p = full
            hi_p = hi
        for start_n in range(lo_p, hi_p, BN):
            offs_n = start_n + offs_n0
            n_ok = offs_n < S
            kn = tl.load(k_base + offs_n.to(tl.int64)[:, None] * sks + offs_d[None, :] * skd,
                         mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            vt = tl.load(v_base + offs_n.to(tl.int64)[None, :] * svs + offs_v[:, None] * svd,
                         mask=v_ok[:, None] & n_ok[None, :], other=0.0)
            s_raw = tl.dot(q, tl.trans(kn), input_precision=DOT_PREC) * scale
            s = _seq_logits(s_raw, tok, head, row_ok, offs_n, b64, S, MASK, smb, smh, smt, sms, softcap,
                            SOFTCAP, MASK_KIND, CAUSAL, phase == 1)
            p = tl.where(row_ok[:, None], tl.exp(s - lse[:, None]), 0.0)
            dp = tl.dot(do, vt, input_precision=DOT_PREC)
            ds = p * (dp - delta[:, None])
            if STORE_DS:
                tl.store(
                    DS + ((b64 * Hq + head64[:, None]) * T + tok64[:, None]) * S + offs_n.to(tl.int64)[None, :],
                    ds,
                    mask=row_ok[:, None] & n_ok[None, :],
                )
            if SOFTCAP:
                t_ = _tanh(s_raw / softcap)
                ds = ds * (1.0 - t_ * t_)
            dq += tl.dot(ds.to(kn.dtype), kn, input_precision=DOT_PREC)

    dq = dq * scale
    tl.store(DQ + ((b64 * Hq + head64[:, None]) * T + tok64[:, None]) * d + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=ld)


@triton.jit
def moda_attn_bwd_kernel_dkdv(
    Q, K, V, MASK, DO, LSE, DELTA, DK, DV,
    sqb, sqh, sqt, sqd,
    skb, skh, sks, skd,
    svb, svh, svs, svd,
    smb, smh, smt, sms,
    sgb, sgh, sgt, sgd,
    Hq, Hk, G, T, S, d, dv,
    scale, softcap,
    BMT: tl.constexpr, GP: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hk
    kvh = pid_bh % Hk
    b64 = b.to(tl.int64)
    kvh64 = kvh.to(tl.int64)
    n0 = pid_n * BN
    offs_n = n0 + tl.arange(0, BN)
    n_ok = offs_n < S
    offs_d = tl.arange(0, BD)
    d_ok = offs_d < d
    ldn = n_ok[:, None] & d_ok[None, :]
    offs_v = tl.arange(0, BDV)
    v_ok = offs_v < dv
    ldnv = n_ok[:, None] & v_ok[None, :]
    kn = tl.load(K + b64 * skb + kvh64 * skh + offs_n.to(tl.int64)[:, None] * sks + offs_d[None, :] * skd,
                 mask=ldn, other=0.0)
    vn = tl.load(V + b64 * svb + kvh64 * svh + offs_n.to(tl.int64)[:, None] * svs + offs_v[None, :] * svd,
                 mask=ldnv, other=0.0)
    dk = tl.zeros([BN, BD], tl.float32)
    dv_acc = tl.zeros([BN, BDV], tl.float32)

    if CAUSAL:
        m_lo = (n0 // BMT) * BMT  # the first query token that can see key n0 is n0 (top-left aligned)
    else:
        m_lo = 0
    for t0 in range(m_lo, T, BMT):
        tok, head, row_ok = _rows(t0 // BMT, kvh, G, T, BMT, GP)
        tok64 = tok.to(tl.int64)
        head64 = head.to(tl.int64)
        ld = row_ok[:, None] & d_ok[None, :]
        q = tl.load(Q + b64 * sqb + head64[:, None] * sqh + tok64[:, None] * sqt + offs_d[None, :] * sqd,
                    mask=ld, other=0.0)
        do = tl.load(DO + b64 * sgb + head64[:, None] * sgh + tok64[:, None] * sgt + offs_v[None, :] * sgd,
                     mask=row_ok[:, None] & v_ok[None, :], other=0.0)
        row = (b64 * Hq + head64) * T + tok64
        lse = _bwd_lse(LSE, row, row_ok)
        delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
        s_raw = tl.dot(q, tl.trans(kn), input_precision=DOT_PREC) * scale
        # the causal diagonal and the ragged tail are checked on every tile (elementwise; loops start at the diagonal)
        s = _seq_logits(s_raw, tok, head, row_ok, offs_n, b64, S, MASK, smb, smh, smt, sms, softcap,
                        SOFTCAP, MASK_KIND, CAUSAL, True)
        p = tl.where(row_ok[:, None], tl.exp(s - lse[:, None]), 0.0)
        dv_acc += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PREC)
        dp = tl.dot(do, tl.trans(vn), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            t_ = _tanh(s_raw / softcap)
            ds = ds * (1.0 - t_ * t_)
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT_PREC)

    dk = dk * scale
    base = ((b64 * Hk + kvh64) * S + offs_n.to(tl.int64)[:, None]) * d + offs_d[None, :]
    tl.store(DK + base, dk.to(DK.dtype.element_ty), mask=ldn)
    base_v = ((b64 * Hk + kvh64) * S + offs_n.to(tl.int64)[:, None]) * dv + offs_v[None, :]
    tl.store(DV + base_v, dv_acc.to(DV.dtype.element_ty), mask=ldnv)


# ----------------------------------------------------------------------------------------------------------------
# launchers


def _mask_args(attn_mask: torch.Tensor | None, B: int, Hq: int, T: int, S: int, ref: torch.Tensor):
    """(tensor, kind, strides): the mask broadcast to ``[B, Hq, T, S]`` as a strided view (never materialised)."""
    if attn_mask is None:
        return ref, 0, (0, 0, 0, 0)
    m = attn_mask
    kind = 1 if m.dtype == torch.bool else 2
    if kind == 1:
        m = m.view(torch.uint8)
    m = m.expand(B, Hq, T, S)
    return m, kind, tuple(m.stride())


def _reduce_to(ds: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``ds`` summed to ``like``'s (broadcastable) shape as a tensor of its own: ``sum_to_size`` returns a view when
    it drops leading dimensions; summing those away first (keepdim=False) does not."""
    lead = ds.dim() - like.dim()
    if lead > 0:
        ds = ds.sum(dim=tuple(range(lead)))
    return ds.sum_to_size(like.shape)


def moda_attn_fwd(
    q, k, v, attn_mask, depth_k, depth_v, depth_weight, scale: float, is_causal: bool, softcap: float,
    stats_only: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor]:  # fmt: skip
    """MoDA forward in one kernel: sequence attention and the same-token depth slots in one online softmax.

    Arguments: those of :func:`.reference.moda_attn_ref` (the op's one docstring) without dropout, within
    :func:`.limits.covers` (q may have any strides; the mask is read through broadcast strides, never
    materialised). ``stats_only``: compute only the LSE (the backward's recomputation); ``o`` is then None.

    Returns:
        ``(o, lse)``: ``o`` ``[B, Hq, T, d]`` in q's dtype with SDPA's memory layout (``[B, T, Hq, d]`` underneath);
        ``lse`` ``[B, Hq, T]`` fp32, the natural-log normaliser of the joint softmax (λ included).

    Fused: QKᵀ, masks, soft-cap, online softmax, PV for the sequence part and the per-token depth dot products and
    their weighted values, all in one pass; no logits or probabilities reach HBM.
    """
    B, Hq, T, d = q.shape
    Hk, S, dv = k.shape[1], k.shape[2], v.shape[3]
    n = depth_k.shape[2]
    G = Hq // Hk
    cfg = block_config(G, d, q.dtype, torch.cuda.get_device_capability(q.device)[0] if q.is_cuda else 9, dv=dv)
    lse = torch.empty(B, Hq, T, device=q.device, dtype=torch.float32)
    if stats_only:
        o = None
        o_arg, so = lse, (0, 0, 0, 0)
    else:
        # SDPA's layout, allocated as such (not a transposed view of a [B, T, Hq, dv] buffer: a tensor of its own)
        o = torch.empty_strided((B, Hq, T, dv), (T * Hq * dv, dv, Hq * dv, 1), device=q.device, dtype=q.dtype)
        o_arg, so = o, tuple(o.stride())
    mask, kind, sm = _mask_args(attn_mask, B, Hq, T, S, q)
    lam = depth_weight.contiguous() if depth_weight is not None else lse
    grid = (triton.cdiv(T, cfg["fwd_BMT"]), B * Hk)
    moda_attn_fwd_kernel[grid](
        q, k, v, depth_k, depth_v, lam, mask, o_arg, lse,
        *q.stride(), *k.stride(), *v.stride(), *depth_k.stride(), *depth_v.stride(), *sm, *so,
        Hq, Hk, G, T, S, n, d, dv,
        float(scale), float(softcap) if softcap > 0 else 1.0,
        BMT=cfg["fwd_BMT"], GP=cfg["GP"], BN=cfg["fwd_BN"], BD=cfg["BD"], BDV=cfg["BDV"],
        HAS_LAM=depth_weight is not None, MASK_KIND=kind, CAUSAL=bool(is_causal), SOFTCAP=softcap > 0,
        STATS_ONLY=stats_only, DOT_PREC=dot_precision(q.dtype),
        num_warps=cfg["fwd_warps"], num_stages=cfg["fwd_stages"],
    )
    return o, lse


def moda_attn_bwd(
    grad, q, k, v, attn_mask, depth_k, depth_v, depth_weight, out, scale: float, is_causal: bool, softcap: float,
    mask_grad: bool,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """MoDA backward: recompute the LSE, then dQ/depth gradients and dK/dV in two kernels (no atomics).

    Args:
        grad: ``[B, Hq, T, d]`` gradient of the output (any strides, stride 0 included). ``out``: the forward output
            ``o`` (for ``δ = rowsum(o ⊙ do)``). The rest: as :func:`moda_attn_fwd`.
        mask_grad: also return the gradient of an additive float mask (materialises an fp32 ``[B, Hq, T, S]``
            buffer of dS, then reduces it to the mask's shape with torch, as the reference's autograd would).

    Returns:
        ``(dq, dk, dv, dmask, dKd, dVd, dλ)`` in the inputs' dtypes and shapes (dq/dk/dv/dKd/dVd contiguous);
        ``dmask`` is None unless ``mask_grad``; ``dλ`` is None when ``depth_weight`` is None. ``dλ`` passes the
        clamp straight through (``Σ_rows Σ_i e_i (dP_i − δ)``, per-row fp32 partials summed with torch).

    Recomputed: the LSE (:func:`moda_attn_fwd` in stats mode), then P for the sequence blocks and the depth slots in
    both backward kernels; nothing but ``o`` and the inputs is kept from the forward.
    """
    B, Hq, T, d = q.shape
    Hk, S, dv = k.shape[1], k.shape[2], v.shape[3]
    n = depth_k.shape[2]
    G = Hq // Hk
    cfg = block_config(G, d, q.dtype, torch.cuda.get_device_capability(q.device)[0] if q.is_cuda else 9, dv=dv)
    _, lse = moda_attn_fwd(q, k, v, attn_mask, depth_k, depth_v, depth_weight, scale, is_causal, softcap, True)
    delta = (out.float() * grad.float()).sum(-1).contiguous()  # [B, Hq, T]
    mask, kind, sm = _mask_args(attn_mask, B, Hq, T, S, q)
    dq = torch.empty(B, Hq, T, d, device=q.device, dtype=q.dtype)
    dk = torch.empty(B, Hk, S, d, device=q.device, dtype=k.dtype)
    dv_ = torch.empty(B, Hk, S, dv, device=q.device, dtype=v.dtype)
    dkd = torch.empty(B, T, n, Hk, d, device=q.device, dtype=depth_k.dtype)
    dvd = torch.empty(B, T, n, Hk, dv, device=q.device, dtype=depth_v.dtype)
    has_lam = depth_weight is not None
    dlam_rows = torch.empty(B, Hq, T, device=q.device, dtype=torch.float32) if has_lam else lse
    store_ds = bool(mask_grad and kind == 2)
    # zeros: the causal part above the diagonal is never visited by the kernel
    ds = torch.zeros(B, Hq, T, S, device=q.device, dtype=torch.float32) if store_ds else lse
    lam = depth_weight.contiguous() if has_lam else lse
    common = dict(MASK_KIND=kind, CAUSAL=bool(is_causal), SOFTCAP=softcap > 0, DOT_PREC=dot_precision(q.dtype))
    cap = float(softcap) if softcap > 0 else 1.0
    moda_attn_bwd_kernel_dq[(triton.cdiv(T, cfg["dq_BMT"]), B * Hk)](
        q, k, v, depth_k, depth_v, lam, mask, grad, lse, delta,
        dq, dkd, dvd, dlam_rows, ds,
        *q.stride(), *k.stride(), *v.stride(), *depth_k.stride(), *depth_v.stride(), *sm, *grad.stride(),
        Hq, Hk, G, T, S, n, d, dv,
        float(scale), cap,
        BMT=cfg["dq_BMT"], GP=cfg["GP"], BN=cfg["dq_BN"], BD=cfg["BD"], BDV=cfg["BDV"], HAS_LAM=has_lam,
        STORE_DS=store_ds,
        num_warps=cfg["dq_warps"], num_stages=cfg["dq_stages"], **common,
    )
    moda_attn_bwd_kernel_dkdv[(triton.cdiv(S, cfg["kv_BN"]), B * Hk)](
        q, k, v, mask, grad, lse, delta, dk, dv_,
        *q.stride(), *k.stride(), *v.stride(), *sm, *grad.stride(),
        Hq, Hk, G, T, S, d, dv,
        float(scale), cap,
        BMT=cfg["kv_BMT"], GP=cfg["GP"], BN=cfg["kv_BN"], BD=cfg["BD"], BDV=cfg["BDV"],
        num_warps=cfg["kv_warps"], num_stages=cfg["kv_stages"], **common,
    )
    dmask = _reduce_to(ds, attn_mask).to(attn_mask.dtype) if store_ds else None
    dlam = dlam_rows.sum(dim=(0, 2)).to(depth_weight.dtype) if has_lam else None
    return dq, dk, dv_, dmask, dkd, dvd, dlam

