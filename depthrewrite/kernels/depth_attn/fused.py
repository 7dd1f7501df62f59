"""Fused Triton kernels for the depth-attention ops (AttnRes / Block AttnRes), forward and backward.

Imported lazily by :mod:`.op`, only when :func:`depthrewrite.kernels.dispatch.route` picks the kernel (``@triton.jit``
reads ``TRITON_INTERPRET`` when it decorates, and CPU users must not pay for importing Triton).

Kernels (all statistics, softmax and accumulation in fp32; the sources are one tuple argument of up to
``limits.MAX_SOURCES`` pointers per launch, never ``torch.stack``-ed). The ops are documented in :mod:`.reference`.

- ``depth_attn_fwd_kernel`` — ``depth_attn`` forward. One program per block of ``BT`` tokens with the whole row
  (``BD = next_power_of_2(D)``) on chip; an online softmax over the sources reads each source exactly once and
  keeps the fp32 accumulator in registers. More than ``MAX_SOURCES`` sources: consecutive launches carry the
  online-softmax state (running max, denominator ``[T]`` and accumulator ``[T, D]``, fp32) through scratch.
- ``depth_attn_partial_fwd_kernel`` — ``depth_attn_partial`` forward: S queries against the same sources. D is
  processed in chunks: pass 1 reads the token block's sources once for all S queries (sum of squares and S dot
  products per source), the S softmaxes are formed on chip, pass 2 re-reads the same sources (the block is sized to
  still be in L2) and writes ``o`` and ``lse``.
- ``depth_attn_bwd_kernel_multi`` — backward of ``depth_attn_partial`` and of ``depth_attn`` (the case S = 1, no
  ``lse``). Persistent grid; pass 1 recomputes scores, weights and ``go·v`` from the sources, pass 2 writes every
  source's gradient and accumulates the query-gradient ``du = Σ_t Σ_i ds_i r_i v_i`` into one fp32 row per program
  (read-modify-write of the program's own row, no atomics); the rows are summed with torch.
- ``depth_attn_stats_kernel`` — more than ``MAX_SOURCES`` sources in the two D-chunked kernels: pass 1 per chunk of
  sources writes per-token scores (and ``go·v``) to ``[S, K, T]`` fp32 scratch; torch forms the softmax and the
  per-source coefficients on these small tensors; ``depth_attn_partial_fwd_kernel`` / ``depth_attn_bwd_kernel_multi``
  then run pass 2 per chunk (``FUSED=False``).
- ``depth_attn_merge_fwd_kernel`` / ``depth_attn_merge_bwd_kernel`` — ``depth_attn_merge``: one extra source merged
  by log-sum-exp. Whole row on chip; the backward is persistent with a per-program fp32 ``du`` row in registers.

Parameter gradients (queries, gains) are reduced over tokens as per-program fp32 partials, summed with torch
(deterministic; no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_utils import flat_rows, persistent_programs, pow2
from .limits import MAX_ROW, MAX_SOURCES, chunk_config, row_config, row_sources

__all__ = [
    "MAX_SOURCES",
    "MAX_ROW",
    "depth_attn_fwd",
    "depth_attn_bwd",
    "depth_attn_partial_fwd",
    "depth_attn_partial_bwd",
    "depth_attn_merge_fwd",
    "depth_attn_merge_bwd",
]


# ---- kernels ------------------------------------------------------------------------------------------------------


@triton.jit
def _key(q_ptr, g_ptr, offs, mask):
    """``u = gain ⊙ query`` in fp32 at ``offs``."""
    return tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(g_ptr + offs, mask=mask, other=0.0).to(
        tl.float32
    )


@triton.jit
def _row_tile(tile, T, D, BT: tl.constexpr, BD: tl.constexpr):
    """Token block ``tile`` of a whole-row kernel: ``(rows, rmask, cols, cmask, mask, offs)`` of ``[BT, BD]``."""
    rows = tile * BT + tl.arange(0, BT)
    cols = tl.arange(0, BD)
    rmask = rows < T
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    return rows, rmask, cols, cmask, mask, offs


@triton.jit
def _go_offsets(s_ar, rows, cols, T, D):
    """Offsets of ``go [S, T, D]`` for queries ``s_ar``, tokens ``rows`` and columns ``cols``: ``[SP, BT, BDC]``."""
    return (s_ar.to(tl.int64)[:, None, None] * T + rows.to(tl.int64)[None, :, None]) * D + cols[None, None, :]


@triton.jit
def depth_attn_fwd_kernel(
    xs,
    q_ptr, g_ptr, out_ptr, m_ptr, l_ptr, acc_ptr,
    T, D, eps, scale,
    NSRC: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    rows, rmask, cols, cmask, mask, offs = _row_tile(tl.program_id(0), T, D, BT, BD)
    u = _key(q_ptr, g_ptr, cols, cmask)
    if FIRST:
        m = tl.full([BT], float("-inf"), tl.float32)
        den = tl.zeros([BT], tl.float32)
        acc = tl.zeros([BT, BD], tl.float32)
    else:
        m = tl.load(m_ptr + rows, mask=rmask, other=0.0)
        den = tl.load(l_ptr + rows, mask=rmask, other=1.0)
        acc = tl.load(acc_ptr + offs, mask=mask, other=0.0)
    for j in tl.static_range(NSRC):
        src = xs[j]
        v = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(v * v, axis=1) / D + eps)
        s = tl.sum(v * u[None, :], axis=1) * r
        m_new = tl.maximum(m, s)
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        den = den * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * v
        m = m_new
    if LAST:
        h = acc * (scale / den)[:, None]
        tl.store(out_ptr + offs, h.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(m_ptr + rows, m, mask=rmask)
        tl.store(l_ptr + rows, den, mask=rmask)
        tl.store(acc_ptr + offs, acc, mask=mask)


@triton.jit
def _scores(
    xs,
    q_ptr, g_ptr, go_ptr, gscale, rows, S, T, D,
    NSRC: tl.constexpr, HAS_GO: tl.constexpr, SP: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr,
    BDC: tl.constexpr,
):  # fmt: skip
    """Pass 1 over D in chunks for one block of tokens: ``SS [BT, KP]`` (sums of squares), ``DOT [SP, BT, KP]``
    (``v_i · u_s``) and, with ``HAS_GO``, ``GV [SP, BT, KP]`` (``gscale · go_s · v_i``)."""
    s_ar = tl.arange(0, SP)
    k3 = tl.arange(0, KP)[None, None, :]
    k2 = tl.arange(0, KP)[None, :]
    rmask = rows < T
    smask = s_ar < S
    ss = tl.zeros([BT, KP], tl.float32)
    dot = tl.zeros([SP, BT, KP], tl.float32)
    gv = tl.zeros([SP, BT, KP], tl.float32)
    for d0 in range(0, D, BDC):
        cols = d0 + tl.arange(0, BDC)
        cmask = cols < D
        uoffs = s_ar[:, None] * D + cols[None, :]
        umask = smask[:, None] & cmask[None, :]
        u = _key(q_ptr, g_ptr, uoffs, umask)
        u3 = u[:, None, :]
        mask = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
        if HAS_GO:
            goffs = _go_offsets(s_ar, rows, cols, T, D)
            gmask = smask[:, None, None] & mask[None, :, :]
            go = tl.load(go_ptr + goffs, mask=gmask, other=0.0).to(tl.float32) * gscale
        for j in tl.static_range(NSRC):
            src = xs[j]
            v = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
            vb = v[None, :, :]
            ss += tl.where(k2 == j, tl.sum(v * v, axis=1)[:, None], 0.0)
            dot += tl.where(k3 == j, tl.sum(vb * u3, axis=2)[:, :, None], 0.0)
            if HAS_GO:
                gv += tl.where(k3 == j, tl.sum(vb * go, axis=2)[:, :, None], 0.0)
    return ss, dot, gv


@triton.jit
def _offs3(s_ar, rows, S, T, K_total, j0, NSRC: tl.constexpr, KP: tl.constexpr):
    """Offsets and mask of the ``[SP, BT, KP]`` tile of an ``[S, K_total, T]`` scratch (sources ``j0 …``)."""
    kk = tl.arange(0, KP)
    offs = (s_ar.to(tl.int64)[:, None, None] * K_total + j0 + kk[None, None, :]) * T + rows[None, :, None]
    mask = (s_ar < S)[:, None, None] & (rows < T)[None, :, None] & (kk < NSRC)[None, None, :]
    return offs, mask


@triton.jit
def _offs2(rows, T, j0, NSRC: tl.constexpr, KP: tl.constexpr):
    """Offsets and mask of the ``[BT, KP]`` tile of a ``[K_total, T]`` scratch (sources ``j0 …``)."""
    kk = tl.arange(0, KP)
    offs = (j0 + kk[None, :]).to(tl.int64) * T + rows[:, None]
    mask = (rows < T)[:, None] & (kk < NSRC)[None, :]
    return offs, mask


@triton.jit
def depth_attn_stats_kernel(
    xs,
    q_ptr, g_ptr, go_ptr, gscale, ss_ptr, dot_ptr, gv_ptr,
    S, T, D, K_total, j0,
    NSRC: tl.constexpr, HAS_GO: tl.constexpr, SP: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr,
    BDC: tl.constexpr,
):  # fmt: skip
    """More than MAX_SOURCES sources, pass 1 for one chunk of them: per-token statistics into fp32 scratch."""
    pid = tl.program_id(0)
    rows = pid * BT + tl.arange(0, BT)
    s_ar = tl.arange(0, SP)
    ss, dot, gv = _scores(
        xs,
        q_ptr, g_ptr, go_ptr, gscale, rows, S, T, D,
        NSRC, HAS_GO, SP, KP, BT, BDC,
    )  # fmt: skip
    offs2, mask2 = _offs2(rows, T, j0, NSRC, KP)
    tl.store(ss_ptr + offs2, ss, mask=mask2)
    offs3, mask3 = _offs3(s_ar, rows, S, T, K_total, j0, NSRC, KP)
    tl.store(dot_ptr + offs3, dot, mask=mask3)
    if HAS_GO:
        tl.store(gv_ptr + offs3, gv, mask=mask3)


@triton.jit
def depth_attn_partial_fwd_kernel(
    xs,
    q_ptr, g_ptr, o_ptr, lse_ptr, p_ptr,
    S, T, D, eps, K_total, j0,
    NSRC: tl.constexpr, FUSED: tl.constexpr, ACCUM: tl.constexpr, SP: tl.constexpr, KP: tl.constexpr,
    BT: tl.constexpr, BDC: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid * BT + tl.arange(0, BT)
    rmask = rows < T
    s_ar = tl.arange(0, SP)
    smask = s_ar < S
    k3 = tl.arange(0, KP)[None, None, :]
    if FUSED:
        ss, dot, gv = _scores(
            xs,
            q_ptr, g_ptr, q_ptr, 1.0, rows, S, T, D,
            NSRC, False, SP, KP, BT, BDC,
        )  # fmt: skip
        r = tl.rsqrt(ss / D + eps)  # [BT, KP]
        sc = tl.where(k3 < NSRC, dot * r[None, :, :], float("-inf"))  # [SP, BT, KP]
        m = tl.max(sc, axis=2)
        e = tl.exp(sc - m[:, :, None])
        den = tl.sum(e, axis=2)
        p = e / den[:, :, None]
        lse = m + tl.log(den)
        tl.store(lse_ptr + s_ar[:, None] * T + rows[None, :], lse, mask=smask[:, None] & rmask[None, :])
    else:  # weights of this chunk of sources, from the scratch filled by depth_attn_stats_kernel + torch
        offs3, mask3 = _offs3(s_ar, rows, S, T, K_total, j0, NSRC, KP)
        p = tl.load(p_ptr + offs3, mask=mask3, other=0.0)
    for d0 in range(0, D, BDC):
        cols = d0 + tl.arange(0, BDC)
        cmask = cols < D
        mask = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
        o = tl.zeros([SP, BT, BDC], tl.float32)
        for j in tl.static_range(NSRC):
            src = xs[j]
            v = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
            pj = tl.sum(tl.where(k3 == j, p, 0.0), axis=2)  # [SP, BT]
            o += pj[:, :, None] * v[None, :, :]
        ooffs = (s_ar.to(tl.int64)[:, None, None] * T + rows.to(tl.int64)[None, :, None]) * D + cols[None, None, :]
        omask = smask[:, None, None] & mask[None, :, :]
        if ACCUM:
            o += tl.load(o_ptr + ooffs, mask=omask, other=0.0)
        tl.store(o_ptr + ooffs, o, mask=omask)


@triton.jit
def depth_attn_bwd_kernel_multi(
    xs, dxs,
    q_ptr, g_ptr, go_ptr, glse_ptr, du_ptr, p_ptr, cu_ptr, cv_ptr,
    S, T, D, eps, gscale, n_tiles, K_total, j0,
    NSRC: tl.constexpr, FUSED: tl.constexpr, HAS_GLSE: tl.constexpr, SP: tl.constexpr, KP: tl.constexpr,
    BT: tl.constexpr, BDC: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    s_ar = tl.arange(0, SP)
    smask = s_ar < S
    k3 = tl.arange(0, KP)[None, None, :]
    k2 = tl.arange(0, KP)[None, :]
    for tile in range(pid, n_tiles, nprog):
        rows = tile * BT + tl.arange(0, BT)
        rmask = rows < T
        if FUSED:
            ss, dot, gv = _scores(
                xs,
                q_ptr, g_ptr, go_ptr, gscale, rows, S, T, D,
                NSRC, True, SP, KP, BT, BDC,
            )  # fmt: skip
            r = tl.rsqrt(ss / D + eps)  # [BT, KP]
            valid = k3 < NSRC
            sc = tl.where(valid, dot * r[None, :, :], float("-inf"))  # [SP, BT, KP]
            m = tl.max(sc, axis=2)
            e = tl.exp(sc - m[:, :, None])
            p = e / tl.sum(e, axis=2)[:, :, None]
            ghb = tl.sum(p * gv, axis=2)  # go_s · o_s
            if HAS_GLSE:
                glse_offs = s_ar[:, None] * T + rows[None, :]
                glse = tl.load(glse_ptr + glse_offs, mask=smask[:, None] & rmask[None, :], other=0.0)
                ds = p * (gv - ghb[:, :, None] + glse[:, :, None])
            else:
                ds = p * (gv - ghb[:, :, None])
            ds = tl.where(smask[:, None, None], ds, 0.0)
            coef_u = ds * r[None, :, :]  # [SP, BT, KP]: coefficient of u_s in dv_i, and of v_i in du_s
            coef_v = r * r / D * tl.sum(ds * tl.where(valid, sc, 0.0), axis=0)  # [BT, KP]: coefficient of -v_i
        else:  # coefficients of this chunk of sources, from the scratch filled by depth_attn_stats_kernel + torch
            offs3, mask3 = _offs3(s_ar, rows, S, T, K_total, j0, NSRC, KP)
            p = tl.load(p_ptr + offs3, mask=mask3, other=0.0)
            coef_u = tl.load(cu_ptr + offs3, mask=mask3, other=0.0)
            offs2, mask2 = _offs2(rows, T, j0, NSRC, KP)
            coef_v = tl.load(cv_ptr + offs2, mask=mask2, other=0.0)
        # pass 2: every source's gradient, and the program's du row
        for d0 in range(0, D, BDC):
            cols = d0 + tl.arange(0, BDC)
            cmask = cols < D
            mask = rmask[:, None] & cmask[None, :]
            offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
            uoffs = s_ar[:, None] * D + cols[None, :]
            umask = smask[:, None] & cmask[None, :]
            u = _key(q_ptr, g_ptr, uoffs, umask)
            goffs = _go_offsets(s_ar, rows, cols, T, D)
            go = tl.load(go_ptr + goffs, mask=smask[:, None, None] & mask[None, :, :], other=0.0).to(tl.float32)
            go = go * gscale
            du = tl.zeros([SP, BDC], tl.float32)
            for j in tl.static_range(NSRC):
                src = xs[j]
                dst = dxs[j]
                v = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
                pj = tl.sum(tl.where(k3 == j, p, 0.0), axis=2)  # [SP, BT]
                cu = tl.sum(tl.where(k3 == j, coef_u, 0.0), axis=2)  # [SP, BT]
                cv = tl.sum(tl.where(k2 == j, coef_v, 0.0), axis=1)  # [BT]
                dv = tl.sum(pj[:, :, None] * go + cu[:, :, None] * u[:, None, :], axis=0) - cv[:, None] * v
                tl.store(dst + offs, dv.to(dst.dtype.element_ty), mask=mask)
                du += tl.sum(cu[:, :, None] * v[None, :, :], axis=1)
            duoffs = (pid * SP + s_ar)[:, None] * D + cols[None, :]
            tl.store(du_ptr + duoffs, tl.load(du_ptr + duoffs, mask=umask, other=0.0) + du, mask=umask)


@triton.jit
def _merge_terms(o_ptr, lse_ptr, v_ptr, u, rows, rmask, offs, mask, D, eps):
    """One token block of the merge: the last source ``v`` and partial mix ``o`` (fp32), ``v``'s inverse RMS ``r``
    and score ``s2``, and the unnormalised weights ``a = e^{lse-m}``, ``b = e^{s2-m}`` of ``o`` and ``v``."""
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    o = tl.load(o_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(v * v, axis=1) / D + eps)
    s2 = tl.sum(v * u[None, :], axis=1) * r
    m = tl.maximum(lse, s2)
    return v, o, r, s2, tl.exp(lse - m), tl.exp(s2 - m)


@triton.jit
def depth_attn_merge_fwd_kernel(
    o_ptr, lse_ptr, v_ptr, q_ptr, g_ptr, out_ptr, T, D, eps, scale, BT: tl.constexpr, BD: tl.constexpr
):
    rows, rmask, cols, cmask, mask, offs = _row_tile(tl.program_id(0), T, D, BT, BD)
    u = _key(q_ptr, g_ptr, cols, cmask)
    v, o, r, s2, a, b = _merge_terms(o_ptr, lse_ptr, v_ptr, u, rows, rmask, offs, mask, D, eps)
    inv = scale / (a + b)
    h = (a * inv)[:, None] * o + (b * inv)[:, None] * v
    tl.store(out_ptr + offs, h.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def depth_attn_merge_bwd_kernel(
    gh_ptr, o_ptr, lse_ptr, v_ptr, q_ptr, g_ptr, go_ptr, glse_ptr, gv_ptr, du_ptr,
    T, D, eps, scale, n_tiles, BT: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BD)
    cmask = cols < D
    u = _key(q_ptr, g_ptr, cols, cmask)
    du = tl.zeros([BD], tl.float32)
    for tile in range(pid, n_tiles, nprog):
        rows, rmask, _cols, _cmask, mask, offs = _row_tile(tile, T, D, BT, BD)
        v, o, r, s2, a, b = _merge_terms(o_ptr, lse_ptr, v_ptr, u, rows, rmask, offs, mask, D, eps)
        g = tl.load(gh_ptr + offs, mask=mask, other=0.0).to(tl.float32) * scale
        w1 = a / (a + b)
        w2 = b / (a + b)
        t = w1 * w2 * tl.sum(g * (v - o), axis=1)  # d loss / d s2 (= -d loss / d lse)
        tl.store(go_ptr + offs, w1[:, None] * g, mask=mask)
        tl.store(glse_ptr + rows, -t, mask=rmask)
        cr = t * r
        dv = w2[:, None] * g + cr[:, None] * u[None, :] - (cr * s2 * r / D)[:, None] * v
        tl.store(gv_ptr + offs, dv.to(gv_ptr.dtype.element_ty), mask=mask)
        du += tl.sum(cr[:, None] * v, axis=0)
    tl.store(du_ptr + pid * D + cols, du, mask=cmask)


# ---- launchers ----------------------------------------------------------------------------------------------------


def depth_attn_fwd(
    sources: list[torch.Tensor], query: torch.Tensor, gain: torch.Tensor, eps: float, scale: float
) -> torch.Tensor:
    """``depth_attn`` forward: online softmax over the K sources, each read once.

    Args:
        sources: K tensors ``[..., D]``, one shape, dtype fp32/bf16/fp16 (any K ≥ 1; ``D ≤ MAX_ROW``).
        query: ``[D]``. gain: ``[D]`` (any float dtype; ``u = gain·query`` is formed in fp32 in the kernel).
        eps: key RMSNorm epsilon. scale: multiplies the mix.

    Returns:
        ``[..., D]`` in the sources' dtype.

    Fuses the K key RMS statistics, the K scores, the softmax, the weighted sum and the scale into one pass; per
    token it reads K·D elements and writes D. More than ``MAX_SOURCES`` sources run as consecutive launches of up
    to ``MAX_SOURCES`` each that carry (max, denominator, fp32 accumulator) through scratch (+8·D bytes per extra
    launch and token).
    """
    D = sources[0].shape[-1]
    vs = [flat_rows(s, D) for s in sources]
    T = vs[0].shape[0]
    # allocated in the result's shape (contiguous: the kernel's [T, D] rows), so the result is a tensor of its own,
    # not a view of a [T, D] buffer (a block module returning a view makes FSDP2 warn)
    out = torch.empty(sources[0].shape, device=vs[0].device, dtype=vs[0].dtype)
    if T == 0:
        return out
    q, g = query.contiguous(), gain.contiguous()
    bt, bd, nw = row_config(vs[0].device, D)
    grid = (triton.cdiv(T, bt),)
    per = row_sources(len(vs), bt, bd, nw, vs[0].element_size()) if vs[0].is_cuda else MAX_SOURCES
    chunks = [vs[i : i + per] for i in range(0, len(vs), per)]
    if len(chunks) > 1:
        m = torch.empty(T, device=out.device, dtype=torch.float32)
        den = torch.empty_like(m)
        acc = torch.empty(T, D, device=out.device, dtype=torch.float32)
    else:
        m = den = acc = out  # unused
    for c, chunk in enumerate(chunks):
        depth_attn_fwd_kernel[grid](
            tuple(chunk), q, g, out, m, den, acc, T, D, float(eps), float(scale),
            NSRC=len(chunk), FIRST=c == 0, LAST=c == len(chunks) - 1, BT=bt, BD=bd, num_warps=nw,
        )  # fmt: skip
    return out


def _chunks(vs: list[torch.Tensor]) -> list[tuple[int, list[torch.Tensor]]]:
    return [(j0, vs[j0 : j0 + MAX_SOURCES]) for j0 in range(0, len(vs), MAX_SOURCES)]


def _split_stats(vs, queries, gains, go, gscale, eps, cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """More than MAX_SOURCES sources: ``depth_attn_stats_kernel`` per chunk, then ``(r [K, T], scores [S, K, T], gv)``."""
    S, D = queries.shape
    K, T = len(vs), vs[0].shape[0]
    sp, _, bt, bdc, nw = cfg
    dev = vs[0].device
    ss = torch.empty(K, T, device=dev, dtype=torch.float32)
    dot = torch.empty(S, K, T, device=dev, dtype=torch.float32)
    gv = torch.empty_like(dot) if go is not None else None
    for j0, chunk in _chunks(vs):
        depth_attn_stats_kernel[(triton.cdiv(T, bt),)](
            tuple(chunk), queries, gains, go if go is not None else dot, float(gscale), ss, dot,
            gv if gv is not None else dot, S, T, D, K, j0,
            NSRC=len(chunk), HAS_GO=go is not None, SP=sp, KP=pow2(len(chunk)), BT=bt, BDC=bdc, num_warps=nw,
        )  # fmt: skip
    r = torch.rsqrt(ss / D + eps)
    return r, dot * r, gv


def _multi_bwd(go, glse, vs, queries, gains, eps, gscale, shapes) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Launch ``depth_attn_bwd_kernel_multi``; ``go`` ``[S, T, D]``, ``vs`` K tensors ``[T, D]``. Returns (dv list, du [S, D]):
    each dv allocated contiguous in its source's shape (``shapes``; the kernel writes it as ``[T, D]`` rows), a
    tensor of its own rather than a view of a ``[T, D]`` buffer.

    ``K ≤ MAX_SOURCES``: one fused launch. More: ``depth_attn_stats_kernel`` per chunk of sources (scores, ``go·v`` into
    ``[S, K, T]`` fp32 scratch), the softmax and the per-source coefficients with torch on those small tensors, then
    ``depth_attn_bwd_kernel_multi`` per chunk (FUSED=False) reading them.
    """
    S, D = queries.shape
    K, T = len(vs), vs[0].shape[0]
    dvs = [torch.empty(shape, device=v.device, dtype=v.dtype) for v, shape in zip(vs, shapes)]
    if T == 0:
        return dvs, torch.zeros(S, D, device=go.device, dtype=torch.float32)
    cfg = chunk_config(go.device, S, min(K, MAX_SOURCES), D, T, vs[0].element_size())
    sp, kp, bt, bdc, nw = cfg
    n_tiles = triton.cdiv(T, bt)
    nprog = persistent_programs(go.device, n_tiles, per_sm=4 if sp == 1 else 2)  # du rows: nprog·SP·D fp32
    du = torch.zeros(nprog, sp, D, device=go.device, dtype=torch.float32)
    glse_arg = glse if glse is not None else go
    if K <= MAX_SOURCES:
        depth_attn_bwd_kernel_multi[(nprog,)](
            tuple(vs), tuple(dvs), queries, gains, go, glse_arg, du, go, go, go,
            S, T, D, float(eps), float(gscale), n_tiles, K, 0,
            NSRC=K, FUSED=True, HAS_GLSE=glse is not None, SP=sp, KP=kp, BT=bt, BDC=bdc, num_warps=nw,
        )  # fmt: skip
        return dvs, du.sum(0)[:S]
    r, sc, gv = _split_stats(vs, queries, gains, go, gscale, eps, cfg)
    p = torch.softmax(sc, dim=1)  # [S, K, T]
    inner = gv - (p * gv).sum(1, keepdim=True)
    if glse is not None:
        inner = inner + glse.unsqueeze(1)
    ds = p * inner
    cu = (ds * r).contiguous()
    cv = (r * r / D * (ds * sc).sum(0)).contiguous()
    # ptxas -v, sm_90: a chunk of 16 sources on 4 warps spilled 36 B (bf16) / 652 B (fp16); on 8 warps it is clean
    nw_chunk = max(nw, 8) if go.is_cuda else nw
    for j0, chunk in _chunks(vs):
        depth_attn_bwd_kernel_multi[(nprog,)](
            tuple(chunk), tuple(dvs[j0 : j0 + len(chunk)]), queries, gains, go, glse_arg, du, p, cu, cv,
            S, T, D, float(eps), float(gscale), n_tiles, K, j0,
            NSRC=len(chunk), FUSED=False, HAS_GLSE=glse is not None, SP=sp, KP=pow2(len(chunk)), BT=bt, BDC=bdc,
            num_warps=nw_chunk,
        )  # fmt: skip
    return dvs, du.sum(0)[:S]


def depth_attn_bwd(grad, sources, query, gain, eps, scale) -> list[torch.Tensor]:
    """``depth_attn`` backward (any K ≥ 1; more than ``MAX_SOURCES`` sources go through the split path of
    :func:`_multi_bwd`).

    Args:
        grad: ``[..., D]``, the gradient of the output. sources, query, gain, eps, scale: as in the forward.

    Returns:
        ``[grad_query [D], grad_gain [D], *grad_sources]`` in the dtypes of query, gain and the sources.

    Nothing is saved by the forward but its inputs: the kernel recomputes the RMS statistics, scores and softmax
    weights from the sources (pass 1: reads K·D + D per token), then writes every source's gradient (pass 2: reads
    the K·D again, L2-resident, writes K·D). ``du = Σ_t Σ_i ds_i r_i v_i`` is accumulated as one fp32 row per
    program and summed with torch; ``grad_query = gain·du``, ``grad_gain = query·du``.
    """
    D = sources[0].shape[-1]
    vs = [flat_rows(s, D) for s in sources]
    go = flat_rows(grad, D).unsqueeze(0)
    dvs, du = _multi_bwd(go, None, vs, query.contiguous().view(1, D), gain.contiguous().view(1, D), eps, scale,
                         [s.shape for s in sources])
    du = du[0]
    gq = (gain.float() * du).to(query.dtype)
    gg = (query.float() * du).to(gain.dtype)
    return [gq, gg, *dvs]


def depth_attn_partial_fwd(
    sources: list[torch.Tensor], queries: torch.Tensor, gains: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``depth_attn_partial`` forward: S queries against the same K sources (any K ≥ 1).

    Args:
        sources: K tensors ``[..., D]`` (fp32/bf16/fp16). queries, gains: ``[S, D]``. eps: key RMSNorm epsilon.

    Returns:
        ``(o [S, ..., D] fp32, lse [S, ...] fp32)``.

    One program per block of tokens; D in chunks. Pass 1 reads each source of the block once for all S queries
    (sum of squares + S dot products); the S softmaxes are formed on chip; pass 2 re-reads the block's sources
    (L2-resident) and writes ``o`` (S·D fp32 per token) and ``lse``. More than ``MAX_SOURCES`` sources:
    ``depth_attn_stats_kernel`` per chunk of sources writes the scores to ``[S, K, T]`` fp32 scratch, torch forms the softmax
    and ``lse`` on those small tensors, and ``depth_attn_partial_fwd_kernel`` per chunk (FUSED=False) accumulates ``o``.
    """
    D = sources[0].shape[-1]
    S = queries.shape[0]
    lead = tuple(sources[0].shape[:-1])
    vs = [flat_rows(s, D) for s in sources]
    T = vs[0].shape[0]
    K = len(vs)
    # allocated in the results' shapes (contiguous: the kernel's [S, T, D] and [S, T]): tensors of their own
    o = torch.empty(S, *lead, D, device=vs[0].device, dtype=torch.float32)
    lse = torch.empty(S, *lead, device=vs[0].device, dtype=torch.float32)
    if T == 0:
        return o, lse
    qs, gs = queries.contiguous(), gains.contiguous()
    cfg = chunk_config(vs[0].device, S, min(K, MAX_SOURCES), D, T, vs[0].element_size())
    sp, kp, bt, bdc, nw = cfg
    grid = (triton.cdiv(T, bt),)
    if K <= MAX_SOURCES:
        depth_attn_partial_fwd_kernel[grid](
            tuple(vs), qs, gs, o, lse, o, S, T, D, float(eps), K, 0,
            NSRC=K, FUSED=True, ACCUM=False, SP=sp, KP=kp, BT=bt, BDC=bdc, num_warps=nw,
        )  # fmt: skip
        return o, lse
    _, sc, _ = _split_stats(vs, qs, gs, None, 1.0, eps, cfg)
    lse = torch.logsumexp(sc.reshape(S, K, *lead), dim=1)  # [S, ...]: the kernel reads it as [S, T]
    p = torch.softmax(sc, dim=1).contiguous()
    for j0, chunk in _chunks(vs):
        depth_attn_partial_fwd_kernel[grid](
            tuple(chunk), qs, gs, o, lse, p, S, T, D, float(eps), K, j0,
            NSRC=len(chunk), FUSED=False, ACCUM=j0 > 0, SP=sp, KP=pow2(len(chunk)), BT=bt, BDC=bdc, num_warps=nw,
        )  # fmt: skip
    return o, lse


def depth_attn_partial_bwd(grad_o, grad_lse, sources, queries, gains, eps) -> list[torch.Tensor]:
    """``depth_attn_partial`` backward (any K ≥ 1; see :func:`_multi_bwd` for more than ``MAX_SOURCES``).

    Args:
        grad_o: ``[S, ..., D]``. grad_lse: ``[S, ...]``. sources, queries, gains, eps: as in the forward.

    Returns:
        ``[grad_queries [S, D], grad_gains [S, D], *grad_sources]`` in the inputs' dtypes.

    Recomputes scores and weights from the sources (nothing but the inputs is saved); with
    ``ds_{s,i} = p_{s,i}(go_s·v_i − go_s·o_s + glse_s)``, writes
    ``dv_i = Σ_s p_{s,i} go_s + r_i Σ_s ds_{s,i} u_s − (r_i²/D) (Σ_s ds_{s,i} s_{s,i}) v_i`` and reduces
    ``du_s = Σ_t Σ_i ds_{s,i} r_i v_i`` as per-program fp32 rows summed with torch.
    """
    S, D = queries.shape
    vs = [flat_rows(s, D) for s in sources]
    T = vs[0].shape[0]
    go = grad_o.contiguous().view(S, T, D)
    glse = grad_lse.to(torch.float32).contiguous().view(S, T)
    dvs, du = _multi_bwd(go, glse, vs, queries.contiguous(), gains.contiguous(), eps, 1.0, [s.shape for s in sources])
    gq = (gains.float() * du).to(queries.dtype)
    gg = (queries.float() * du).to(gains.dtype)
    return [gq, gg, *dvs]


def depth_attn_merge_fwd(o, lse, last, query, gain, eps, scale) -> torch.Tensor:
    """``depth_attn_merge`` forward (``D ≤ MAX_ROW``).

    Args:
        o: ``[..., D]`` fp32. lse: ``[...]`` fp32. last: ``[..., D]`` (fp32/bf16/fp16). query, gain: ``[D]``.
        eps: key RMSNorm epsilon. scale: multiplies the mix.

    Returns:
        ``[..., D]`` in ``last``'s dtype.

    Fuses the last source's RMS statistic and score, the log-sum-exp merge and the scale: per token reads
    ``o`` (4·D bytes), ``last`` (D elements) and ``lse``, writes D elements.
    """
    D = last.shape[-1]
    v = flat_rows(last, D)
    T = v.shape[0]
    out = torch.empty(last.shape, device=v.device, dtype=v.dtype)  # contiguous [T, D] rows; a tensor of its own
    if T > 0:
        bt, bd, nw = row_config(v.device, D)
        depth_attn_merge_fwd_kernel[(triton.cdiv(T, bt),)](
            flat_rows(o, D), lse.contiguous().view(-1), v, query.contiguous(), gain.contiguous(), out,
            T, D, float(eps), float(scale), BT=bt, BD=bd, num_warps=nw,
        )  # fmt: skip
    return out


def depth_attn_merge_bwd(grad, o, lse, last, query, gain, eps, scale) -> list[torch.Tensor]:
    """``depth_attn_merge`` backward (``D ≤ MAX_ROW``).

    Args:
        grad: ``[..., D]``, the gradient of the output. The rest: as in the forward.

    Returns:
        ``[grad_o (fp32), grad_lse (fp32), grad_last, grad_query, grad_gain]`` in the inputs' dtypes.

    Persistent grid; recomputes the last source's RMS statistic, score and the two merge weights ``w1, w2``; per
    token reads ``grad``, ``o``, ``last``, ``lse`` and writes ``grad_o = scale·w1·grad``, ``grad_lse = −t``,
    ``grad_last = scale·w2·grad + t·r·(u − s2·r·v/D)`` with ``t = w1·w2·scale·grad·(v − o)``;
    ``du = Σ_t t·r·v`` stays in registers per program (one fp32 row each), summed with torch.
    """
    D = last.shape[-1]
    v = flat_rows(last, D)
    T = v.shape[0]
    # allocated in the inputs' shapes (contiguous: the kernel's [T, D] / [T] rows): tensors of their own, not views
    g_o = torch.empty(o.shape, device=v.device, dtype=torch.float32)
    g_lse = torch.empty(lse.shape, device=v.device, dtype=torch.float32)
    g_v = torch.empty(last.shape, device=v.device, dtype=v.dtype)
    if T > 0:
        bt, bd, nw = row_config(v.device, D)
        n_tiles = triton.cdiv(T, bt)
        nprog = persistent_programs(v.device, n_tiles)
        du = torch.empty(nprog, D, device=v.device, dtype=torch.float32)
        depth_attn_merge_bwd_kernel[(nprog,)](
            flat_rows(grad, D), flat_rows(o, D), lse.contiguous().view(-1), v, query.contiguous(), gain.contiguous(),
            g_o, g_lse, g_v, du, T, D, float(eps), float(scale), n_tiles, BT=bt, BD=bd, num_warps=nw,
        )  # fmt: skip
        du = du.sum(0)
    else:
        du = torch.zeros(D, device=v.device, dtype=torch.float32)
    gq = (gain.float() * du).to(query.dtype)
    gg = (query.float() * du).to(gain.dtype)
    return [g_o.to(o.dtype), g_lse.to(lse.dtype), g_v, gq, gg]
