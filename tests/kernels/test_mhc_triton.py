"""The fused mHC kernels (depthrewrite/kernels/mhc/fused.py) against the PyTorch reference: forward and every
gradient of ``mhc_coeffs`` / ``mhc_pre`` / ``mhc_post``, opcheck of the ops and of their backward ops, the fallback
boundary (n > 8, fp64). On CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1);
on a CUDA machine the same file runs them natively and adds bf16.

Tolerances (atol, rtol), per dtype of X; coefficients and their grads are fp32 throughout:
  fp32: forward 1e-5 / 1e-5, gradients 1e-4 / 1e-4 (TF32 is off in tests: the GEMMs run fp32-accurate "3xTF32")
  fp16: forward 2e-3 / 2e-3, gradients 1e-2 / 1e-2 (runs in the interpreter too; X exact in TF32: 2-MMA path)
  bf16 (CUDA only): forward 2e-2 / 2e-2 (outputs are rounded to bf16), gradients 5e-2 / 5e-2
  (Liger's mHC tests use 1.5e-2 / 2.5e-2 / 5e-2 for bf16 pre-post / res / grads; platform-notes §12.)
"""

from __future__ import annotations

import pytest
import torch

from depthrewrite.kernels.dispatch import kernel_backend, kernel_info
from depthrewrite.kernels.mhc import (
    mhc_coeffs,
    mhc_coeffs_backward,
    mhc_coeffs_ref,
    mhc_post,
    mhc_post_backward,
    mhc_post_ref,
    mhc_pre,
    mhc_pre_backward,
    mhc_pre_ref,
)

from ._helpers import close as _close, spy_calls

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {
    torch.float32: dict(fwd=(1e-5, 1e-5), grad=(1e-4, 1e-4)),
    torch.float16: dict(fwd=(2e-3, 2e-3), grad=(1e-2, 1e-2)),
    torch.bfloat16: dict(fwd=(2e-2, 2e-2), grad=(5e-2, 5e-2)),
}
DTYPES = [torch.float32] + ([torch.bfloat16] if DEV == "cuda" else [])
ITERS, EPS = 20, 1e-6


def _site(n: int, D: int, lead: tuple[int, ...], dtype=torch.float32, seed: int = 0):
    """X [*lead, n, D] and coefficient parameters at trained-model-like scales (non-trivial Sinkhorn)."""
    g = torch.Generator().manual_seed(seed)
    X = (torch.randn(*lead, n, D, generator=g) * 2).to(DEV, dtype)
    phi = (torch.randn(n * D, n * n + 2 * n, generator=g) * 0.3).to(DEV)
    bias = torch.randn(n * n + 2 * n, generator=g).to(DEV)
    alpha = (torch.rand(3, generator=g) + 0.1).to(DEV)
    return X, phi, bias, alpha


def _grads(fn, inputs, seed: int = 1):
    """Outputs of fn and the grads of every input for a random cotangent on every output."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(seed)
    cot = [torch.randn(o.shape, generator=g).to(o.device, o.dtype) for o in outs]
    return outs, torch.autograd.grad(outs, leaves, cot)


@pytest.fixture
def calls(monkeypatch):
    """Counts the fused launcher calls (to tell the kernel path from the fallback)."""
    from depthrewrite.kernels.mhc import fused

    names = ("mhc_coeffs_fwd", "mhc_coeffs_bwd", "mhc_pre_fwd", "mhc_pre_bwd", "mhc_post_fwd", "mhc_post_bwd")
    return spy_calls(monkeypatch, fused, names)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "n, D, lead, iters",
    [
        pytest.param(1, 37, (5,), ITERS, id="one-stream-rank1"),
        pytest.param(4, 13, (2, 17), ITERS, id="n4-odd-rank2"),  # 34 tokens: 3 token blocks, K = 52 < BK
        pytest.param(4, 20, (1, 2, 3), 1, id="n4-rank3-iters1"),
        pytest.param(3, 29, (9,), 5, id="n3-K87"),  # K over one K-chunk, masked tail
        pytest.param(8, 5, (3,), ITERS, id="n8-boundary"),  # the largest n the kernels cover: 80 columns
    ],
)
def test_coeffs_forward_and_grads(n, D, lead, iters, dtype, calls):
    X, phi, bias, alpha = _site(n, D, lead, dtype)
    f = lambda *a: mhc_coeffs(*a, iters, EPS)  # noqa: E731
    with kernel_backend("reference"):
        want, gwant = _grads(f, (X, phi, bias, alpha))
    with kernel_backend("triton"):
        got, ggot = _grads(f, (X, phi, bias, alpha))
    assert calls == ["mhc_coeffs_fwd", "mhc_coeffs_bwd"]
    _close(got, want, TOL[dtype]["fwd"])
    _close(ggot, gwant, TOL[dtype]["grad"])
    torch.testing.assert_close(got[2].sum(-1), torch.ones_like(got[2].sum(-1)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("iters", [ITERS, 1], ids=["iters20", "iters1"])
def test_exact_rows(iters, calls):
    """exact_rows: the last row normalisation without eps. Kernel == reference (forward and every grad), each row of
    H_res sums to 1 up to fp32 rounding (V4's eps leaves 1 - O(eps)), and the closed-form backward == autograd of
    the plain reference function in fp64."""
    X, phi, bias, alpha = _site(4, 13, (2, 9))
    f = lambda *a: mhc_coeffs(*a, iters, EPS, True)  # noqa: E731
    with kernel_backend("reference"):
        want, gwant = _grads(f, (X, phi, bias, alpha))
    with kernel_backend("triton"):
        got, ggot = _grads(f, (X, phi, bias, alpha))
    assert calls == ["mhc_coeffs_fwd", "mhc_coeffs_bwd"]
    _close(got, want, TOL[torch.float32]["fwd"])
    _close(ggot, gwant, TOL[torch.float32]["grad"])
    for res in (want[2], got[2]):
        assert (res.sum(-1) - 1).abs().max() <= 4e-7
    v4 = mhc_coeffs_ref(X, phi, bias, alpha, iters, EPS)[2]
    assert (v4.sum(-1) - 1).abs().max() > 5e-7  # the eps in every division is visible at fp32
    Xd, pd, bd, ad = (t.double().cpu().requires_grad_() for t in (X, phi, bias, alpha))
    with kernel_backend("reference"):
        assert torch.autograd.gradcheck(lambda *a: mhc_coeffs(*a, iters, EPS, True), (Xd, pd, bd, ad), fast_mode=True)
    auto = torch.autograd.grad(mhc_coeffs_ref(Xd, pd, bd, ad, iters, EPS, True)[2].pow(2).sum(), (Xd, pd, bd, ad))
    with kernel_backend("reference"):
        mine = torch.autograd.grad(mhc_coeffs(Xd, pd, bd, ad, iters, EPS, True)[2].pow(2).sum(), (Xd, pd, bd, ad))
    for a, b in zip(mine, auto):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEV == "cuda" else []), ids=str)
def test_half_precision_state(dtype, calls):
    """X (and y) in a half type: the coefficient GEMM's 2-MMA path, outputs in X's dtype, coefficients fp32."""
    X, phi, bias, alpha = _site(4, 13, (2, 9), dtype)
    g = torch.Generator().manual_seed(5)
    y = torch.randn(2, 9, 13, generator=g).to(DEV, dtype)
    coeffs = lambda *a: mhc_coeffs(*a, ITERS, EPS)  # noqa: E731
    with kernel_backend("reference"):
        (pre, post, res), _ = _grads(coeffs, (X, phi, bias, alpha))
    for op, args in ((coeffs, (X, phi, bias, alpha)), (mhc_pre, (X, pre)), (mhc_post, (X, res, post, y))):
        with kernel_backend("reference"):
            want, gwant = _grads(op, args)
        with kernel_backend("triton"):
            got, ggot = _grads(op, args)
        _close(got, want, TOL[dtype]["fwd"])
        _close(ggot, gwant, TOL[dtype]["grad"])
    assert len(calls) == 6


def test_coeffs_backward_token_segments():
    """Kernel 2 of the coefficient backward with several token segments (grad φ partials summed by torch)."""
    from depthrewrite.kernels.mhc import fused

    X, phi, bias, alpha = _site(4, 9, (70,))
    (pre, post, res), want = _grads(lambda *a: mhc_coeffs_ref(*a, ITERS, EPS), (X, phi, bias, alpha))
    g = torch.Generator().manual_seed(1)
    cot = [torch.randn(o.shape, generator=g).to(DEV) for o in (pre, post, res)]
    for segments in (1, 2, 3):
        got = fused.mhc_coeffs_bwd(X, phi, bias, alpha, *cot, ITERS, EPS, segments=segments)
        _close(got, want, TOL[torch.float32]["grad"])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "n, D, lead",
    [
        pytest.param(1, 33, (4,), id="one-stream"),
        pytest.param(4, 19, (3, 5), id="n4-odd-rank2"),
        pytest.param(3, 7, (2, 1, 3), id="n3-rank3"),
        pytest.param(8, 11, (2,), id="n8"),
    ],
)
def test_apply_forward_and_grads(n, D, lead, dtype, calls):
    g = torch.Generator().manual_seed(n)
    X = torch.randn(*lead, n, D, generator=g).to(DEV, dtype)
    pre = torch.rand(*lead, n, generator=g).to(DEV)
    post = (2 * torch.rand(*lead, n, generator=g)).to(DEV)
    res = torch.rand(*lead, n, n, generator=g).to(DEV)
    y = torch.randn(*lead, D, generator=g).to(DEV, dtype)
    for op, args in ((mhc_pre, (X, pre)), (mhc_post, (X, res, post, y))):
        with kernel_backend("reference"):
            want, gwant = _grads(op, args)
        with kernel_backend("triton"):
            got, ggot = _grads(op, args)
        _close(got, want, TOL[dtype]["fwd"])
        _close(ggot, gwant, TOL[dtype]["grad"])
    assert calls == ["mhc_pre_fwd", "mhc_pre_bwd", "mhc_post_fwd", "mhc_post_bwd"]


def test_fallbacks_are_silent_and_exact(calls):
    """n > 8, fp64 (and bf16 on CPU) run the reference inside the op even with the triton backend forced."""
    f = lambda *a: mhc_coeffs(*a, ITERS, EPS)  # noqa: E731
    site9 = _site(9, 3, (2,))
    site64 = tuple(t.double() for t in _site(2, 3, (2, 3)))
    pre64 = torch.rand(2, 3, 2, dtype=torch.float64, device=DEV)
    sites = [site9, site64] + ([_site(4, 3, (2,), torch.bfloat16)] if DEV == "cpu" else [])  # interpreter: no bf16
    with kernel_backend("triton"):
        got = [_grads(f, s) for s in sites]
        u = mhc_pre(site64[0], pre64)
    assert calls == [] and u.dtype == torch.float64
    with kernel_backend("reference"):
        want = [_grads(f, s) for s in sites]
        torch.testing.assert_close(u, mhc_pre(site64[0], pre64), atol=0, rtol=0)
    for (o, g), (wo, wg) in zip(got, want):
        _close(o + g, wo + wg, (0.0, 0.0))


def test_reference_backward_ops_match_fp64_autograd():
    """The closed-form backward used on the reference path (gradcheck also checks it against finite differences)."""
    g = torch.Generator().manual_seed(3)
    kw = dict(dtype=torch.float64)
    X = torch.randn(2, 3, 3, 4, generator=g, **kw).requires_grad_()
    pre, post = torch.rand(2, 3, 3, generator=g, **kw).requires_grad_(), torch.rand(2, 3, 3, generator=g, **kw).requires_grad_()
    res = torch.rand(2, 3, 3, 3, generator=g, **kw).requires_grad_()
    y = torch.randn(2, 3, 4, generator=g, **kw).requires_grad_()
    with kernel_backend("reference"):
        assert torch.autograd.gradcheck(mhc_pre, (X, pre), fast_mode=True)
        assert torch.autograd.gradcheck(mhc_post, (X, res, post, y), fast_mode=True)
        Xs, phi, bias, alpha = (t.double().cpu().requires_grad_() for t in _site(3, 2, (2,)))
        assert torch.autograd.gradcheck(lambda *a: mhc_coeffs(*a, 7, EPS), (Xs, phi, bias, alpha), fast_mode=True)


def test_opcheck_with_the_triton_backend():
    X, phi, bias, alpha = _site(4, 5, (2, 3))
    g = torch.Generator().manual_seed(2)
    pre, post = torch.rand(2, 3, 4, generator=g).to(DEV), torch.rand(2, 3, 4, generator=g).to(DEV)
    res = torch.rand(2, 3, 4, 4, generator=g).to(DEV)
    y, gX = torch.randn(2, 3, 5, generator=g).to(DEV), torch.randn(2, 3, 4, 5, generator=g).to(DEV)
    rg = lambda *ts: tuple(t.clone().requires_grad_() for t in ts)  # noqa: E731
    with kernel_backend("triton"):
        torch.library.opcheck(mhc_coeffs, (*rg(X, phi, bias, alpha), ITERS, EPS))
        torch.library.opcheck(mhc_pre, rg(X, pre))
        torch.library.opcheck(mhc_post, rg(X, res, post, y))
        torch.library.opcheck(mhc_coeffs_backward, (X, phi, bias, alpha, pre, post, res, ITERS, EPS))
        torch.library.opcheck(mhc_pre_backward, (X, pre, y))
        torch.library.opcheck(mhc_post_backward, (X, res, post, y, gX))


def test_kernel_info_is_registered():
    info = kernel_info()
    for op in ("mhc_coeffs", "mhc_pre", "mhc_post", "mhc_collapse"):
        assert f"depthrewrite::{op}" in info
    assert "n > 8" in info["depthrewrite::mhc_coeffs"].falls_back


def test_site_compiles_with_one_node_per_op():
    """A whole site, forward and backward, under torch.compile(aot_eager, fullgraph): the kernels stay opaque ops."""
    X, phi, bias, alpha = _site(4, 6, (2, 3))
    y = torch.randn(2, 3, 6).to(DEV)

    def site(X, phi, bias, alpha, y):
        pre, post, res = mhc_coeffs(X, phi, bias, alpha, ITERS, EPS)
        return mhc_post(X, res, post, y * mhc_pre(X, pre))

    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs: dict[str, list[str]] = {}

    def record(kind):
        def compiler(gm, _inputs):
            graphs[kind] = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
            return make_boxed_func(gm.forward)

        return compiler

    backend = aot_autograd(fw_compiler=record("fw"), bw_compiler=record("bw"))
    with kernel_backend("triton"):
        want, gwant = _grads(site, (X, phi, bias, alpha, y))
        got, ggot = _grads(torch.compile(site, backend=backend, fullgraph=True), (X, phi, bias, alpha, y))
    _close(got, want, (1e-6, 1e-6))
    _close(ggot, gwant, (1e-6, 1e-6))
    for op in ("mhc_coeffs", "mhc_pre", "mhc_post"):
        assert sum(t.startswith(f"depthrewrite.{op}.") for t in graphs["fw"]) == 1, graphs["fw"]
        assert sum(t.startswith(f"depthrewrite.{op}_backward.") for t in graphs["bw"]) == 1, graphs["bw"]
