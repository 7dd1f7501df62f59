"""Benchmark cases for ``depthrewrite::depth_attn`` and the two-phase pair (``depth_attn_partial`` + ``depth_attn_merge``).

Shapes (the kernel issue): d ∈ {2048, 4096, 8192}, K = 9 sources (K3's output site), tokens ∈ {8192, 32768}; the
two-phase case mixes S = 4 sites of one block: K − 1 = 8 completed sources shared by all sites plus each site's open
partial sum.

Implementations: ``fused`` (our Triton kernels), ``reference`` (the eager PyTorch reference, forced with
``kernel_backend("reference")``), and when importable ``liger`` (``LigerAttnResFunction``) and ``fla``
(``fla.ops.attnres.fused_attnres``). Inputs are built lazily, one shape at a time, so importing this module and
calling :func:`cases` allocate nothing; it needs neither a GPU nor the peers to import.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from depthrewrite.kernels.depth_attn import depth_attn, depth_attn_merge, depth_attn_partial
from depthrewrite.kernels.dispatch import kernel_backend

from . import Call, Case, Row, randn, row

try:  # Liger-Kernel's AttnRes op (stacked sources [N, B, T, D])
    from liger_kernel.ops.attn_res import LigerAttnResFunction
except Exception:  # noqa: BLE001 - any import failure means "peer not available"
    LigerAttnResFunction = None
try:  # flash-linear-attention's AttnRes op (list of sources)
    from fla.ops.attnres import fused_attnres
except Exception:  # noqa: BLE001
    fused_attnres = None

D_SIZES = (2048, 4096, 8192)
TOKENS = (8192, 32768)
K = 9
S = 4
EPS = 1e-6


@functools.lru_cache(maxsize=1)  # one shape's tensors alive at a time
def _inputs(device: str, dtype: torch.dtype, T: int, D: int) -> dict[str, object]:
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dt).requires_grad_(True)

    srcs = [rnd(T, D) for _ in range(K)]
    return {
        "srcs": srcs,
        "stacked": torch.stack([s.detach() for s in srcs]).unsqueeze(1).requires_grad_(True),  # [K, 1, T, D]
        "q": rnd(D, dt=torch.float32),
        "gain": rnd(D, dt=torch.float32),
        "qs": rnd(S, D, dt=torch.float32),
        "gains": rnd(S, D, dt=torch.float32),
        "grad": torch.randn(T, D, generator=g).to(device=device, dtype=dtype),
    }


def _backend(mode: str, fn: Callable[[], object]) -> Callable[[], object]:
    def run():
        with kernel_backend(mode):
            return fn()

    return run


def _fwd_bwd(fwd: Callable[[], object], leaves: Callable[[], list[torch.Tensor]], grad: Callable[[], object]):
    """A forward+backward callable: ``torch.autograd.grad`` of ``fwd()`` w.r.t. ``leaves()`` (no ``.grad`` buildup)."""

    def run():
        out = fwd()
        outs = out if isinstance(out, tuple) else (out,)
        gr = grad()
        grads = gr if isinstance(gr, tuple) else (gr,)
        return torch.autograd.grad(outs, leaves(), grads, allow_unused=True)

    return run


def _single_cases(device: str, dtype: torch.dtype) -> list[Case]:
    out = []
    elt = torch.tensor([], dtype=dtype).element_size()
    for r in rows("bench"):
        if r.op != "depth_attn":
            continue
        T, D = r.d["T"], r.d["D"]
        x = functools.partial(_inputs, device, dtype, T, D)

        def ours(x=x):
            i = x()
            return depth_attn(i["srcs"], i["q"], i["gain"], EPS, float(K))

        def leaves(x=x):
            i = x()
            return [*i["srcs"], i["q"], i["gain"]]

        def grad(x=x):
            return x()["grad"]

        impls = {"fused": _backend("triton", ours), "reference": _backend("reference", ours)}
        impls_bwd = {
            "fused": _backend("triton", _fwd_bwd(ours, leaves, grad)),
            "reference": _backend("reference", _fwd_bwd(ours, leaves, grad)),
        }
        if LigerAttnResFunction is not None:

            def liger(x=x):
                i = x()
                return LigerAttnResFunction.apply(i["stacked"], i["q"], i["gain"], EPS)

            def liger_leaves(x=x):
                i = x()
                return [i["stacked"], i["q"], i["gain"]]

            def liger_grad(x=x):
                return x()["grad"].view(1, T, D)

            impls["liger"] = liger
            impls_bwd["liger"] = _fwd_bwd(liger, liger_leaves, liger_grad)
        if fused_attnres is not None:

            def fla(x=x):
                i = x()
                return fused_attnres(i["q"], i["srcs"], i["gain"], rms_eps=EPS)

            impls["fla"] = fla
            impls_bwd["fla"] = _fwd_bwd(fla, leaves, grad)
        out.append(
            Case(
                op="depth_attn",
                shape=f"T={T} d={D} K={K} {str(dtype).removeprefix('torch.')}",
                impls=impls,
                impls_bwd=impls_bwd,
                # forward: K sources read once, one output written
                bytes=(K + 1) * T * D * elt,
                # + backward: K sources and the output gradient read, K source gradients written
                bytes_bwd=(K + 1) * T * D * elt + (2 * K + 1) * T * D * elt,
                flops=6 * K * T * D,  # sum of squares, dot, weighted sum: 2 FLOPs/element each
                flops_bwd=6 * K * T * D + 12 * K * T * D,
                note=(
                    "memory-bound; ours multiplies the mix by scale=K ('count'), liger/fla return the plain mix "
                    "(scale=1; fla's `scale` is a logit temperature, left at 1): same cost. liger takes the sources "
                    "pre-stacked [K, 1, T, D] (the stack is outside the timed call); ours and fla take the list. "
                    "Our backward recomputes from the sources (reads them twice, the second read L2-resident by "
                    "design); liger saves alpha and inverse RMS."
                ),
            )
        )
    return out


def _two_phase_cases(device: str, dtype: torch.dtype) -> list[Case]:
    out = []
    elt = torch.tensor([], dtype=dtype).element_size()
    for r in rows("bench"):
        if r.op != "depth_attn_two_phase":
            continue
        T, D = r.d["T"], r.d["D"]
        x = functools.partial(_inputs, device, dtype, T, D)

        def two_phase(x=x):
            i = x()
            done, last = i["srcs"][:-1], i["srcs"][-1]
            o, lse = depth_attn_partial(done, i["qs"], i["gains"], EPS)
            return tuple(
                depth_attn_merge(o[s], lse[s], last, i["qs"][s], i["gains"][s], EPS, float(K)) for s in range(S)
            )

        def single_pass(x=x):  # what the two-phase pair replaces: S independent mixes over all K sources
            i = x()
            return tuple(depth_attn(i["srcs"], i["qs"][s], i["gains"][s], EPS, float(K)) for s in range(S))

        def leaves(x=x):
            i = x()
            return [*i["srcs"], i["qs"], i["gains"]]

        def grad(x=x):
            return tuple(x()["grad"] for _ in range(S))

        impls = {
            "fused": _backend("triton", two_phase),
            "reference": _backend("reference", two_phase),
            "fused-single-pass": _backend("triton", single_pass),
        }
        impls_bwd = {
            "fused": _backend("triton", _fwd_bwd(two_phase, leaves, grad)),
            "reference": _backend("reference", _fwd_bwd(two_phase, leaves, grad)),
            "fused-single-pass": _backend("triton", _fwd_bwd(single_pass, leaves, grad)),
        }
        # forward: K-1 completed sources read once; o (fp32) written and read once per site; the last source read
        # and the output written per site
        fwd = (K - 1) * T * D * elt + 2 * S * T * D * 4 + 2 * S * T * D * elt
        # backward: merge reads grad, o, last, writes grad_o (fp32) and grad_last per site; partial reads K-1
        # sources + grad_o for S sites, writes K-1 source gradients
        bwd = S * T * D * (2 * elt + 4 + 4 + elt) + (K - 1) * T * D * elt * 2 + S * T * D * 4
        out.append(
            Case(
                op="depth_attn_two_phase",
                shape=f"T={T} d={D} K={K} S={S} {str(dtype).removeprefix('torch.')}",
                impls=impls,
                impls_bwd=impls_bwd,
                bytes=fwd,
                bytes_bwd=fwd + bwd,
                flops=(4 * S + 2) * (K - 1) * T * D + S * 8 * T * D,
                note=(
                    "attnres spec §7: depth_attn_partial over the K-1 completed sources for all S sites, then one "
                    "depth_attn_merge per site with the open partial sum; 'fused-single-pass' is S depth_attn calls "
                    "over all K sources (reads the K sources S times). o is fp32 by the op's signature "
                    "(the spec's model-dtype o would save 2·S·T·d bytes)."
                ),
            )
        )
    return out


def cases(device: str, dtype: torch.dtype) -> list[Case]:
    """The depth-attention cases at the issue's shapes (inputs are allocated lazily, one shape at a time)."""
    return _single_cases(device, dtype) + _two_phase_cases(device, dtype)


def rows(scale: str = "bench") -> list[Row]:
    """The shapes as data. ``"bench"``: the issue's shapes (what :func:`cases` times); ``"aot"``: the same d and K at
    the first token count (the tile picks do not depend on T beyond a few tiles); ``"test"``: small shapes for the
    parity tests under Triton's interpreter, one stressed axis each."""
    if scale in ("bench", "aot"):
        toks = TOKENS if scale == "bench" else TOKENS[:1]
        rs = [row("depth_attn", T=T, D=D, K=K) for T in toks for D in D_SIZES] + [
            row("depth_attn_two_phase", T=T, D=D, K=K, S=S) for T in toks for D in D_SIZES
        ]
        if scale == "aot":  # more sources than one launch takes: the chunked path and its statistics kernel
            rs.append(row("depth_attn", "many sources: K > 16 (the chunked path)", T=toks[0], D=D_SIZES[0], K=19))
        return rs
    return [
        row("depth_attn", "K = 1 (one source: softmax weight 1)", T=5, D=16, K=1),
        row("depth_attn", "odd T and D (partial token and feature tiles)", T=7, D=33, K=3),
        row("depth_attn", "leading batch dim [B, T, D]", B=2, T=3, D=24, K=4),
        row("depth_attn", "many sources: K > 16 (the chunked path)", T=5, D=20, K=19),
        row("depth_attn_two_phase", "S = 1 site, K - 1 = 1 completed source", T=6, D=16, K=2, S=1),
        row("depth_attn_two_phase", "odd T, D; S = 3 sites (S not a power of two)", T=9, D=17, K=5, S=3),
        row("depth_attn_two_phase", "many sources: K - 1 = 17 > 16 (chunked partial)", T=4, D=16, K=18, S=2),
    ]


def call(r: Row, device: str, dtype: torch.dtype, seed: int = 0) -> Call:
    """The registered op(s) of row ``r`` on random inputs (sources in ``dtype``, query and gain fp32)."""
    d = r.d
    g = torch.Generator().manual_seed(seed)
    lead = (d["B"], d["T"]) if "B" in d else (d["T"],)
    D, k = d["D"], d["K"]
    f32 = dict(device=device, dtype=torch.float32)
    ops = torch.ops.depthrewrite
    srcs = [randn(g, *lead, D, device=device, dtype=dtype, scale=1 + i % 3) for i in range(k)]
    if r.op == "depth_attn":
        q, gain = randn(g, D, **f32), randn(g, D, **f32, scale=0.2, shift=1.0)

        def fn(*t):
            return ops.depth_attn(list(t[:k]), t[k], t[k + 1], EPS, float(k))

        return Call(fn, [*srcs, q, gain], [randn(g, *lead, D, device=device, dtype=dtype, grad=False)])
    s = d["S"]
    qs, gains = randn(g, s, D, **f32), randn(g, s, D, **f32, scale=0.2, shift=1.0)

    def two_phase(*t):
        o, lse = ops.depth_attn_partial(list(t[: k - 1]), t[k], t[k + 1], EPS)
        return tuple(ops.depth_attn_merge(o[i], lse[i], t[k - 1], t[k][i], t[k + 1][i], EPS, float(k)) for i in range(s))

    grads = [randn(g, *lead, D, device=device, dtype=dtype, grad=False) for _ in range(s)]
    return Call(two_phase, [*srcs, qs, gains], grads)
