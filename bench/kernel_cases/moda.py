"""Benchmark cases for ``depthrewrite::moda_attn`` (MoDA's joint softmax over sequence keys and depth slots).

Shapes from the issue: B = 1, Hq = 32, Hk = 8 (G = 4), head dim 128 and 64, n = 8 depth slots, causal,
T ∈ {4096, 16384, 65536}. Implementations side by side:

- ``fused``: our Triton kernels (forced with ``kernel_backend("triton")``).
- ``reference``: the eager PyTorch reference (materialises ``[B, Hq, T, S]`` logits in fp32, so only at T = 4096).
- ``sdpa-flash``: ``F.scaled_dot_product_attention(is_causal=True)`` on the same q, k, v (the *sequence part only*;
  k/v repeated to Hq heads outside the timed call), restricted to the flash backend when PyTorch allows it. The MoDA
  overhead target is stated against this.
- ``hustvl``: ``parallel_moda`` from hustvl/MoDA's fla fork when importable (head dim <= 64 only on Hopper; GQA
  folded into time as its API requires).

The module imports without a GPU and without any peer installed; on CPU ``cases`` shrinks T to 64 so that a smoke
test can call every callable once.
"""

from __future__ import annotations

import math

import torch

from . import Call, Case, Row, randn, row

B, HQ, HK, N_SLOTS = 1, 32, 8, 8
SEQ_LENS = (4096, 16384, 65536)
HEAD_DIMS = (128, 64)
_REFERENCE_MAX_T = 4096  # the reference holds several fp32 [B, Hq, T, T] tensors


def _flops_fwd(T: int, d: int) -> int:
    """QKᵀ and PV over the causal triangle (2 FLOPs per MAC) plus the depth dots and weighted values."""
    pairs = T * (T + 1) // 2
    return 4 * B * HQ * d * pairs + 4 * B * HQ * T * N_SLOTS * d


def _bytes_fwd(T: int, d: int, esize: int) -> int:
    """q, k, v, depth K/V read once, o written once, the fp32 LSE written once."""
    q_o = 2 * B * HQ * T * d
    kv = 2 * B * HK * T * d
    depth = 2 * B * T * N_SLOTS * HK * d
    return (q_o + kv + depth) * esize + 4 * B * HQ * T


def _bytes_bwd(T: int, d: int, esize: int) -> int:
    """Forward, then q, k, v, depth K/V, o, do read and dq, dk, dv, dKd, dVd written once each."""
    inputs = B * HQ * T * d + 2 * B * HK * T * d + 2 * B * T * N_SLOTS * HK * d
    return _bytes_fwd(T, d, esize) + (2 * inputs + 2 * B * HQ * T * d) * esize


def _peer_hustvl():
    try:
        from fla.ops.moda.moda_v14 import parallel_moda  # hustvl/MoDA: libs/moda_triton
    except Exception:  # noqa: BLE001 - not installed (the usual case)
        return None
    return parallel_moda


def cases(device: str, dtype: torch.dtype) -> list[Case]:
    """MoDA cases at the issue's shapes (tiny T on CPU)."""
    import torch.nn.functional as F

    from depthrewrite.kernels.dispatch import kernel_backend
    from depthrewrite.kernels.moda import moda_attn, moda_attn_ref

    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception:  # noqa: BLE001 - older torch
        SDPBackend = sdpa_kernel = None  # noqa: N806

    hustvl = _peer_hustvl()
    seq_lens = SEQ_LENS if device != "cpu" else (64,)
    G = HQ // HK
    out: list[Case] = []
    for d in HEAD_DIMS:
        for T in seq_lens:
            g = torch.Generator(device=device).manual_seed(T + d)

            def r(*shape, g=g):
                return torch.randn(*shape, device=device, dtype=dtype, generator=g)

            q, k, v = r(B, HQ, T, d), r(B, HK, T, d), r(B, HK, T, d)
            Kd, Vd = r(B, T, N_SLOTS, HK, d), r(B, T, N_SLOTS, HK, d)
            scale = 1.0 / math.sqrt(d)
            go = r(B, HQ, T, d)
            leaves = [t.requires_grad_() for t in (q, k, v, Kd, Vd)]
            kx, vx = k.detach().repeat_interleave(G, 1).requires_grad_(), v.detach().repeat_interleave(G, 1)
            vx.requires_grad_()

            def fused(q=q, k=k, v=v, Kd=Kd, Vd=Vd, scale=scale):
                with kernel_backend("triton"):
                    return moda_attn(q, k, v, None, Kd, Vd, None, scale, True, 0.0, None, 0.0)

            def fused_bwd(fused=fused, go=go, leaves=leaves):
                with kernel_backend("triton"):
                    return torch.autograd.grad(fused(), leaves, go)

            def reference(q=q, k=k, v=v, Kd=Kd, Vd=Vd, scale=scale):
                return moda_attn_ref(q, k, v, None, Kd, Vd, None, scale, True, 0.0, None, 0.0)

            def reference_bwd(reference=reference, go=go, leaves=leaves):
                return torch.autograd.grad(reference(), leaves, go)

            def sdpa(q=q, kx=kx, vx=vx, scale=scale):
                if sdpa_kernel is not None and device == "cuda":
                    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                        return F.scaled_dot_product_attention(q, kx, vx, is_causal=True, scale=scale)
                return F.scaled_dot_product_attention(q, kx, vx, is_causal=True, scale=scale)

            def sdpa_bwd(sdpa=sdpa, go=go, q=q, kx=kx, vx=vx):
                return torch.autograd.grad(sdpa(), [q, kx, vx], go)

            impls = {"fused": fused, "sdpa-flash": sdpa}
            impls_bwd = {"fused": fused_bwd, "sdpa-flash": sdpa_bwd}
            if T <= _REFERENCE_MAX_T:
                impls["reference"] = reference
                impls_bwd["reference"] = reference_bwd
            notes = ["sdpa-flash computes the sequence part only (no depth slots)"]
            if T > _REFERENCE_MAX_T:
                notes.append(f"no reference above T={_REFERENCE_MAX_T} (fp32 [B,Hq,T,T] logits)")
            if hustvl is not None and d <= 64:
                # GQA folded into time (query row t·G + j = head j of KV group), token-major [B, T·n, Hk, d] slots
                qf = q.detach().reshape(B, HK, G, T, d).permute(0, 3, 2, 1, 4).reshape(B, T * G, HK, d)
                kf, vf = k.detach().transpose(1, 2).contiguous(), v.detach().transpose(1, 2).contiguous()
                ckf = Kd.detach().reshape(B, T * N_SLOTS, HK, d)
                cvf = Vd.detach().reshape(B, T * N_SLOTS, HK, d)
                hl = [t.requires_grad_() for t in (qf, kf, vf, ckf, cvf)]
                gof = go.reshape(B, HK, G, T, d).permute(0, 3, 2, 1, 4).reshape(B, T * G, HK, d)

                def peer(hl=hl, scale=scale):
                    return hustvl(hl[0], hl[1], hl[2], cached_k=hl[3], cached_v=hl[4], scale=scale,
                                  moda_group_num=G, is_causal=True)

                def peer_bwd(peer=peer, hl=hl, gof=gof):
                    return torch.autograd.grad(peer(), hl, gof)

                impls["hustvl"] = peer
                impls_bwd["hustvl"] = peer_bwd
            esize = torch.finfo(dtype).bits // 8
            fl = _flops_fwd(T, d)
            out.append(
                Case(
                    op="moda",
                    shape=f"B={B} Hq={HQ} Hk={HK} T={T} d={d} n={N_SLOTS} causal",
                    impls=impls,
                    impls_bwd=impls_bwd,
                    bytes=_bytes_fwd(T, d, esize),
                    bytes_bwd=_bytes_bwd(T, d, esize),
                    flops=fl,
                    # FA2 accounting: backward = 2.5 × forward matmuls; our LSE recompute (+0.5) is not counted
                    flops_bwd=int(3.5 * fl),
                    note="; ".join(notes),
                )
            )
    return out


def rows(scale: str = "bench") -> list[Row]:
    """The shapes as data: ``"bench"`` (what :func:`cases` times: causal, no mask), ``"aot"`` (the bench head dims at
    T = 4096 plus the mask kinds, soft-capping and a non-power-of-two group, which are other constexpr branches) or
    ``"test"`` (small shapes for the parity tests, one stressed axis each)."""
    base = dict(B=B, Hq=HQ, Hk=HK)
    if scale == "bench":
        return [row("moda_attn", **base, T=T, S=T, n=N_SLOTS, d=d, causal=True, mask="none", lam=False, cap=0.0)
                for d in HEAD_DIMS for T in SEQ_LENS]
    if scale == "aot":
        T = SEQ_LENS[0]
        return [row("moda_attn", **base, T=T, S=T, n=N_SLOTS, d=d, causal=True, mask="none", lam=True, cap=0.0)
                for d in HEAD_DIMS] + [
            row("moda_attn", **base, T=T, S=T, n=N_SLOTS, d=64, causal=False, mask="bool", lam=True, cap=30.0),
            row("moda_attn", B=B, Hq=24, Hk=8, T=T, S=T, n=N_SLOTS, d=128, causal=True, mask="add", lam=True, cap=0.0),
        ]
    return [
        row("moda_attn", "one depth slot, MHA, causal", B=1, Hq=2, Hk=2, T=9, S=9, n=1, d=8, causal=True, mask="none",
            lam=False, cap=0.0),
        row("moda_attn", "GQA G = 2, S > T, odd head dim, bool mask, λ", B=2, Hq=4, Hk=2, T=7, S=11, n=3, d=5,
            causal=False, mask="bool", lam=True, cap=0.0),
        row("moda_attn", "G = 3 (not a power of two), learned additive mask, soft-cap", B=1, Hq=6, Hk=2, T=9, S=9, n=2,
            d=12, causal=True, mask="add", lam=True, cap=4.0),
        row("moda_attn", "many depth slots (n = 33), MQA", B=1, Hq=4, Hk=1, T=6, S=6, n=33, d=16, causal=True,
            mask="none", lam=False, cap=0.0),
        row("moda_attn", "S < T causal (no key for early rows but the depth slots)", B=1, Hq=2, Hk=1, T=10, S=4, n=2,
            d=8, causal=True, mask="none", lam=True, cap=0.0),
    ]


def call(r: Row, device: str, dtype: torch.dtype, seed: int = 0) -> Call:
    """``moda_attn`` on random inputs (q, k, v, depth slots in ``dtype``; λ fp32, some entries negative)."""
    dm = r.d
    g = torch.Generator().manual_seed(seed)
    b, hq, hk, T, S, n, d = (dm[k] for k in ("B", "Hq", "Hk", "T", "S", "n", "d"))
    kw = dict(device=device, dtype=dtype)
    q, k, v = randn(g, b, hq, T, d, **kw), randn(g, b, hk, S, d, **kw), randn(g, b, hk, S, d, **kw)
    Kd, Vd = randn(g, b, T, n, hk, d, **kw), randn(g, b, T, n, hk, d, **kw)
    ts = [q, k, v, Kd, Vd]
    mask = dm["mask"]
    if mask == "bool":
        ts.append((torch.rand(b, 1, T, S, generator=g) > 0.3).to(device))
    elif mask == "add":
        ts.append(randn(g, T, S, **kw))
    if dm["lam"]:
        ts.append(randn(g, hq, device=device, dtype=torch.float32, scale=0.5, shift=0.5))
    scale, causal, cap = d**-0.5, dm["causal"], float(dm["cap"])

    def fn(*t):
        m = t[5] if mask != "none" else None
        lam = t[-1] if dm["lam"] else None
        return torch.ops.depthrewrite.moda_attn(t[0], t[1], t[2], m, t[3], t[4], lam, scale, causal, 0.0, None, cap)

    return Call(fn, ts, [randn(g, b, hq, T, d, **kw, grad=False)])
