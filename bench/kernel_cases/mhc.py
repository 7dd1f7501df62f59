"""Benchmark cases for the mHC ops: ``mhc_coeffs`` (RMS + projection + σ + Sinkhorn), ``mhc_pre`` (H_pre X) and
``mhc_post`` (H_res X + H_postᵀ y), n = 4 streams, d ∈ {2048, 4096, 7168}, tokens ∈ {8192, 32768}.

Implementations: ``fused`` (the registered op with the Triton backend forced), ``reference`` (eager PyTorch
reference), ``compiled-reference`` (``torch.compile`` of the reference, built here so the compiled function takes the
tensors as arguments), and ``liger`` when ``liger_kernel`` imports (``liger_mhc_coeffs`` / ``liger_mhc_pre`` /
``liger_mhc_post_res``). Tensors are allocated lazily on the first call of a shape and only one shape is alive at a
time (the cases are built all at once by bench/kernels.py).

Liger differences, set to ours where it has a knob: pre_eps = rms_eps = sinkhorn_eps = 1e-6, post_mult = 2, tmax = 20
(its defaults: pre_eps 0, α = 1 in ``LigerMHC``). Its Sinkhorn starts with a softmax over the *input* axis and ends
with a column normalisation ([out, in] layout, transposed orientation vs ours) — the same cost. With φ in fp32 (ours)
its coefficient GEMM takes its fp32/TF32 path (its tensor-core path wants φ in the activation dtype); with fp32 X it
needs ``allow_fp32=True``.
"""

from __future__ import annotations

import torch

from . import Call, Case, Row, randn, row

N_STREAMS, ITERS, EPS = 4, 20, 1e-6
DIMS = (2048, 4096, 7168)
TOKENS = (8192, 32768)

try:  # peers are optional
    from liger_kernel.transformers.functional import liger_mhc_coeffs, liger_mhc_post_res, liger_mhc_pre
except Exception:  # noqa: BLE001
    try:
        from liger_kernel.ops.mhc import liger_mhc_coeffs, liger_mhc_post_res, liger_mhc_pre
    except Exception:  # noqa: BLE001
        liger_mhc_coeffs = liger_mhc_pre = liger_mhc_post_res = None


class _Inputs:
    """The tensors of one shape, built on first use; building another shape frees the previous one."""

    def __init__(self, device: str, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.key: tuple[int, int] | None = None
        self.t: dict[str, torch.Tensor] = {}

    def __call__(self, T: int, d: int) -> dict[str, torch.Tensor]:
        if self.key != (T, d):
            self.t = {}
            if self.device == "cuda":
                torch.cuda.empty_cache()
            n, dev, dt = N_STREAMS, self.device, self.dtype
            g = torch.Generator(device=dev).manual_seed(0)
            f32 = dict(device=dev, dtype=torch.float32)
            X = torch.randn(T, n, d, generator=g, device=dev, dtype=dt)
            res = torch.rand(T, n, n, generator=g, **f32)
            self.t = dict(
                X=X.requires_grad_(),
                phi=(torch.randn(n * d, n * n + 2 * n, generator=g, **f32) * 1e-2).requires_grad_(),
                bias=torch.randn(n * n + 2 * n, generator=g, **f32).requires_grad_(),
                alpha=torch.full((3,), 0.1, **f32).requires_grad_(),
                pre=torch.rand(T, n, generator=g, **f32).requires_grad_(),
                post=(2 * torch.rand(T, n, generator=g, **f32)).requires_grad_(),
                res=(res / res.sum(-1, keepdim=True)).requires_grad_(),
                y=torch.randn(T, d, generator=g, device=dev, dtype=dt).requires_grad_(),
                gX=torch.randn(T, n, d, generator=g, device=dev, dtype=dt),
                gu=torch.randn(T, d, generator=g, device=dev, dtype=dt),
                gpre=torch.randn(T, n, generator=g, **f32),
                gpost=torch.randn(T, n, generator=g, **f32),
                gres=torch.randn(T, n, n, generator=g, **f32),
            )
            self.key = (T, d)
        return self.t


def _fwd_bwd(fn, names: tuple[str, ...], gnames: tuple[str, ...], S: _Inputs, T: int, d: int):
    """A zero-argument callable: fn(*inputs) then the grads of every input (no .grad accumulation)."""

    def run():
        t = S(T, d)
        ins = [t[k] for k in names]
        out = fn(*ins)
        outs = out if isinstance(out, tuple) else (out,)
        return torch.autograd.grad(outs, ins, [t[k] for k in gnames])

    return run


def _fwd(fn, names: tuple[str, ...], S: _Inputs, T: int, d: int):
    """A zero-argument callable running the forward only (no autograd graph)."""

    def run():
        t = S(T, d)
        with torch.no_grad():
            return fn(*[t[k] for k in names])

    return run


def _forced(op):
    def call(*a):
        from depthrewrite.kernels.dispatch import kernel_backend

        with kernel_backend("triton"):
            return op(*a)

    return call


def cases(device: str, dtype: torch.dtype) -> list[Case]:
    from depthrewrite.kernels.mhc import mhc_coeffs, mhc_coeffs_ref, mhc_post, mhc_post_ref, mhc_pre, mhc_pre_ref

    S = _Inputs(device, dtype)
    n, elt, M = N_STREAMS, torch.tensor([], dtype=dtype).element_size(), N_STREAMS**2 + 2 * N_STREAMS
    coeffs = lambda *a: mhc_coeffs(*a, ITERS, EPS)  # noqa: E731
    coeffs_ref = lambda *a: mhc_coeffs_ref(*a, ITERS, EPS)  # noqa: E731
    compiled = {
        "coeffs": torch.compile(coeffs_ref, dynamic=False),
        "pre": torch.compile(mhc_pre_ref, dynamic=False),
        "post": torch.compile(mhc_post_ref, dynamic=False),
    }
    impls_by_op = {
        "mhc_coeffs": (("X", "phi", "bias", "alpha"), ("gpre", "gpost", "gres"),
                       {"fused": _forced(coeffs), "reference": coeffs_ref, "compiled-reference": compiled["coeffs"]}),
        "mhc_pre": (("X", "pre"), ("gu",),
                    {"fused": _forced(mhc_pre), "reference": mhc_pre_ref, "compiled-reference": compiled["pre"]}),
        "mhc_post": (("X", "res", "post", "y"), ("gX",),
                     {"fused": _forced(mhc_post), "reference": mhc_post_ref, "compiled-reference": compiled["post"]}),
    }
    if liger_mhc_coeffs is not None:
        allow_fp32 = dtype == torch.float32

        def liger_coeffs(X, phi, bias, alpha):
            return liger_mhc_coeffs(X, phi, bias, alpha[0:1], alpha[1:2], alpha[2:3], allow_fp32=allow_fp32, tmax=ITERS,
                                    rms_eps=EPS, pre_eps=EPS, sinkhorn_eps=EPS, post_mult=2.0)

        impls_by_op["mhc_coeffs"][2]["liger"] = liger_coeffs
        impls_by_op["mhc_pre"][2]["liger"] = liger_mhc_pre
        impls_by_op["mhc_post"][2]["liger"] = lambda X, res, post, y: liger_mhc_post_res(X, y, post, res)

    out: list[Case] = []
    for T, d in dict.fromkeys((r.d["T"], r.d["d"]) for r in rows("bench")):  # each (T, d) once, all three ops
        K = n * d
        x_bytes = T * K * elt
        coef_bytes = T * M * 4  # pre, post, res (fp32) — also the size of their grads
        by_op = {
            # fwd: X once + φ, write coefficients; fwd+bwd: X twice, grad X once (+ φ and its grad)
            "mhc_coeffs": (x_bytes + K * M * 4 + coef_bytes, 3 * x_bytes + 3 * K * M * 4 + 2 * coef_bytes,
                           2 * T * K * M, 6 * T * K * M),
            # fwd: X, write u; bwd: X, grad u, write grad X (+ coefficients)
            "mhc_pre": (x_bytes + T * d * elt, 3 * x_bytes + 2 * T * d * elt, 0, 0),
            # fwd: X, y, write X'; bwd: X, y, grad X', write grad X, grad y
            "mhc_post": (2 * x_bytes + T * d * elt, 5 * x_bytes + 3 * T * d * elt, 0, 0),
        }
        for op, (names, gnames, impls) in impls_by_op.items():
            b, bb, fl, flb = by_op[op]
            out.append(Case(
                op=op,
                shape=f"T={T} n={n} d={d}",
                impls={k: _fwd(f, names, S, T, d) for k, f in impls.items()},
                impls_bwd={k: _fwd_bwd(f, names, gnames, S, T, d) for k, f in impls.items()},
                bytes=b, bytes_bwd=bb, flops=fl, flops_bwd=flb,
                note=("fused fwd+bwd reads X three times (forward, backward recompute, grad X pass); "
                      "the minimum counted here is twice" if op == "mhc_coeffs" else ""),
            ))
    return out


def rows(scale: str = "bench") -> list[Row]:
    """The shapes as data: ``"bench"`` (what :func:`cases` times), ``"aot"`` (the bench d's at the first token
    count) or ``"test"`` (small shapes for the parity tests, one stressed axis each)."""
    ops = ("mhc_coeffs", "mhc_pre", "mhc_post")
    if scale in ("bench", "aot"):
        toks = TOKENS if scale == "bench" else TOKENS[:1]
        return [row(op, T=T, n=N_STREAMS, d=d) for T in toks for d in DIMS for op in ops]
    return [
        row("mhc_coeffs", "n = 4 streams, odd T (partial token tile)", T=7, n=4, d=16),
        row("mhc_coeffs", "n = 1 (a single stream: trivial Sinkhorn), odd d", T=5, n=1, d=9),
        row("mhc_coeffs", "n = 3 (not a power of two), leading batch dim", B=2, T=3, n=3, d=12),
        row("mhc_pre", "n = 4, odd T and d", T=7, n=4, d=13),
        row("mhc_pre", "n = 3 (padded stream axis), leading batch dim", B=2, T=5, n=3, d=16),
        row("mhc_post", "n = 4, odd T and d", T=9, n=4, d=11),
        row("mhc_post", "n = 2, one token", T=1, n=2, d=8),
    ]


def call(r: Row, device: str, dtype: torch.dtype, seed: int = 0) -> Call:
    """The registered op of row ``r`` on random inputs (X, y in ``dtype``; coefficients and parameters fp32)."""
    dm = r.d
    g = torch.Generator().manual_seed(seed)
    lead = (dm["B"], dm["T"]) if "B" in dm else (dm["T"],)
    n, d = dm["n"], dm["d"]
    f32 = dict(device=device, dtype=torch.float32)
    ops = torch.ops.depthrewrite
    X = randn(g, *lead, n, d, device=device, dtype=dtype, scale=2.0)
    if r.op == "mhc_coeffs":
        M = n * n + 2 * n
        phi = randn(g, n * d, M, **f32, scale=(n * d) ** -0.5)
        bias, alpha = randn(g, M, **f32), randn(g, 3, **f32, scale=0.1, shift=0.5)
        grads = [randn(g, *lead, n, **f32, grad=False), randn(g, *lead, n, **f32, grad=False),
                 randn(g, *lead, n, n, **f32, grad=False)]
        return Call(lambda *t: ops.mhc_coeffs(*t, ITERS, EPS), [X, phi, bias, alpha], grads)
    pre = randn(g, *lead, n, **f32, scale=0.3, shift=0.5)
    if r.op == "mhc_pre":
        return Call(ops.mhc_pre, [X, pre], [randn(g, *lead, d, device=device, dtype=dtype, grad=False)])
    res = torch.softmax(torch.randn(*lead, n, n, generator=g), -1).to(**f32).requires_grad_()
    post = randn(g, *lead, n, **f32, scale=0.5, shift=1.0)
    y = randn(g, *lead, d, device=device, dtype=dtype)
    return Call(ops.mhc_post, [X, res, post, y], [randn(g, *lead, n, d, device=device, dtype=dtype, grad=False)])
