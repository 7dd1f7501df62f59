"""Benchmark cases for ``msar_mix`` (Block MSAR site): K = 9 sources, m = 4 streams with causal conv kernel sizes
(4, 8, 12) (msar.md §2 defaults), sigmoid mixer, conv on keys and values, d ∈ {2048, 4096}, tokens ∈ {8192, 32768}
as ``[B, T, d]`` with T = 4096 (B = 2) and T = 8192 (B = 4).

Implementations: ``fused`` (the registered op with the Triton backend forced), ``reference`` (eager PyTorch
reference), ``compiled-reference`` (``torch.compile`` of the reference, built here so the compiled function takes the
tensors as arguments). No peer implements MSAR. Tensors are allocated lazily on the first call of a shape and only
one shape is alive at a time. The reference's fwd+bwd materialises the K·m stream views and their products in fp32 (each
[K, B, T, d] fp32 tensor is 4.8 GB at 32768 tokens, d = 4096; tens of them are alive): it may run out of memory;
bench/kernels.py records that as an error row.

Counting (per token): the fused forward is compute-bound (msar.md §6): convs Σk_r·K·d MACs, per-stream key
statistics 2·m·K·d, weighted sums m·K·d, mixer m²·d + 2·m·d → ``flops`` = 2 × that. ``bytes`` is the single-pass
minimum (sources read once, h written once). fwd+bwd: ``flops_bwd`` = 3 × ``flops`` (the usual fwd + 2×fwd
convention; the fused backward actually recomputes the views about 7 times: 4 passes in its first kernel,
2 on 1.5×-extended tiles in its second), ``bytes_bwd`` = sources twice, dh
once, source grads written once.
"""

from __future__ import annotations

import torch

from . import Call, Case, Row, randn, row

K_SOURCES, STREAMS, KSIZES, EPS = 9, 4, (4, 8, 12), 1e-6
DIMS = (2048, 4096)
SHAPES = ((2, 4096), (4, 8192))  # (B, T): 8192 and 32768 tokens


class _Inputs:
    """The tensors of one shape, built on first use; building another shape frees the previous one."""

    def __init__(self, device: str, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.key: tuple[int, int, int] | None = None
        self.t: dict[str, object] = {}

    def __call__(self, B: int, T: int, d: int) -> dict[str, object]:
        if self.key != (B, T, d):
            self.t = {}
            if self.device == "cuda":
                torch.cuda.empty_cache()
            dev, dt, m = self.device, self.dtype, STREAMS
            g = torch.Generator(device=dev).manual_seed(0)
            f32 = dict(device=dev, dtype=torch.float32)
            self.t = dict(
                sources=[
                    torch.randn(B, T, d, generator=g, device=dev, dtype=dt).requires_grad_() for _ in range(K_SOURCES)
                ],
                query=(torch.randn(m, d, generator=g, **f32) * 0.1).requires_grad_(),
                gain=(1 + 0.1 * torch.randn(m, d, generator=g, **f32)).requires_grad_(),
                conv=[(torch.randn(d, k, generator=g, **f32) / k).requires_grad_() for k in KSIZES],
                phi=(torch.randn(m * d, m, generator=g, **f32) * 1e-2).requires_grad_(),
                bias=torch.full((m,), -1.0986, **f32).requires_grad_(),  # -log(m-1)
                alpha=torch.full((), 0.01, **f32).requires_grad_(),
                grad=torch.randn(B, T, d, generator=g, device=dev, dtype=dt),
            )
            self.key = (B, T, d)
        return self.t


def _args(t: dict[str, object]) -> tuple:
    return (t["sources"], t["query"], t["gain"], t["conv"], t["phi"], t["bias"], t["alpha"])


def _leaves(t: dict[str, object]) -> list[torch.Tensor]:
    return [*t["sources"], t["query"], t["gain"], *t["conv"], t["phi"], t["bias"], t["alpha"]]


def _fwd(fn, S: _Inputs, B: int, T: int, d: int):
    def run():
        t = S(B, T, d)
        with torch.no_grad():
            return fn(*_args(t))

    return run


def _fwd_bwd(fn, S: _Inputs, B: int, T: int, d: int):
    def run():
        t = S(B, T, d)
        out = fn(*_args(t))
        return torch.autograd.grad(out, _leaves(t), t["grad"])

    return run


def cases(device: str, dtype: torch.dtype) -> list[Case]:
    from depthrewrite.kernels.dispatch import kernel_backend
    from depthrewrite.kernels.msar import msar_mix, msar_mix_ref

    scale = float(K_SOURCES)
    extra = (EPS, scale, True, True)

    def fused(*a):
        with kernel_backend("triton"):
            return msar_mix(*a, *extra)

    def reference(*a):
        return msar_mix_ref(*a, *extra)

    impls = {"fused": fused, "reference": reference, "compiled-reference": torch.compile(reference, dynamic=False)}
    S = _Inputs(device, dtype)
    elt = torch.tensor([], dtype=dtype).element_size()
    K, m = K_SOURCES, STREAMS
    out: list[Case] = []
    for r in rows("bench"):
        B, T, d = r.d["B"], r.d["T"], r.d["d"]
        N = B * T
        src_bytes = K * N * d * elt
        macs = N * d * (sum(KSIZES) * K + 3 * m * K + m * m + 2 * m)
        out.append(
            Case(
                op="msar_mix",
                shape=f"B={B} T={T} d={d} K={K} m={m} k={KSIZES}",
                impls={k: _fwd(f, S, B, T, d) for k, f in impls.items()},
                impls_bwd={k: _fwd_bwd(f, S, B, T, d) for k, f in impls.items()},
                bytes=src_bytes + N * d * elt,
                bytes_bwd=2 * src_bytes + N * d * elt + src_bytes,
                flops=2 * macs,
                flops_bwd=6 * macs,
                note="compute-bound (fp32 CUDA-core FMAs); the fused forward reads the sources 3 times (2 with the "
                "mean mixer), the backward about 7 times (plus its forward's 3)",
            )
        )
    return out


def rows(scale: str = "bench") -> list[Row]:
    """The shapes as data: ``"bench"`` (what :func:`cases` times), ``"aot"`` (the bench d's at the first shape, plus
    the mean mixer) or ``"test"`` (small shapes for the parity tests, one stressed axis each)."""
    if scale in ("bench", "aot"):
        shapes = SHAPES if scale == "bench" else SHAPES[:1]
        out = [row("msar_mix", B=B, T=T, d=d, K=K_SOURCES, ks=KSIZES, cv=True, sig=True) for B, T in shapes for d in DIMS]
        if scale == "aot":  # the mean mixer and value-less conv are other constexpr branches
            B, T = SHAPES[0]
            out.append(row("msar_mix", B=B, T=T, d=DIMS[0], K=K_SOURCES, ks=KSIZES, cv=False, sig=False))
        return out
    return [
        row("msar_mix", "K = 1 source, one conv stream", B=1, T=5, d=8, K=1, ks=(2,), cv=True, sig=True),
        row("msar_mix", "odd T and d, kernel sizes not powers of two", B=2, T=7, d=9, K=3, ks=(3, 5), cv=True, sig=True),
        row("msar_mix", "mean mixer, conv on keys only", B=1, T=6, d=8, K=4, ks=(2, 4), cv=False, sig=False),
        row("msar_mix", "kernel size longer than T (halo past the start)", B=1, T=3, d=6, K=2, ks=(4, 8), cv=True, sig=True),
        row("msar_mix", "many sources: K = 16 (the kernel's maximum)", B=1, T=4, d=4, K=16, ks=(2,), cv=True, sig=True),
    ]


def call(r: Row, device: str, dtype: torch.dtype, seed: int = 0) -> Call:
    """``msar_mix`` on random inputs (sources in ``dtype``, parameters fp32, non-uniform softmaxes and mixer)."""
    dm = r.d
    g = torch.Generator().manual_seed(seed)
    B, T, d, K, ks, cv, sig = (dm[k] for k in ("B", "T", "d", "K", "ks", "cv", "sig"))
    m = len(ks) + 1
    f32 = dict(device=device, dtype=torch.float32)
    src = [randn(g, B, T, d, device=device, dtype=dtype, scale=1 + i % 3) for i in range(K)]
    query, gain = randn(g, m, d, **f32), randn(g, m, d, **f32, scale=0.2, shift=1.0)
    conv = [randn(g, d, k, **f32, scale=0.5) for k in ks]
    mix = [randn(g, m * d, m, **f32, scale=0.3), randn(g, m, **f32), randn(g, **f32, scale=0.1, shift=0.7)] if sig else []
    c = len(ks)

    def fn(*t):
        mx = list(t[K + 2 + c :]) or [None, None, None]
        return torch.ops.depthrewrite.msar_mix(list(t[:K]), t[K], t[K + 1], list(t[K + 2 : K + 2 + c]), *mx, EPS,
                                               float(K), cv, sig)

    return Call(fn, [*src, query, gain, *conv, *mix], [randn(g, B, T, d, device=device, dtype=dtype, grad=False)])
