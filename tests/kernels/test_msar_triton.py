"""The fused MSAR kernels (depthrewrite/kernels/msar/fused.py) against the PyTorch reference: forward and every
gradient of ``msar_mix`` (sources, query, gain, each conv filter, φ, b, α), the sigmoid and mean mixers, conv and
raw values, one to 16 sources and the fallback boundary (17 sources, fp64), leading dims of rank 0-3, tiles and D
chunks that do not divide the sizes, opcheck of the op and of its backward op. On CPU the kernels run in Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1); on a CUDA machine the same file runs them natively and
adds bf16.

Tolerances (atol scaled by max|want|, rtol), per dtype of the sources; all math is fp32 inside the kernels:
  fp32: forward 1e-5 / 1e-5, gradients 1e-4 / 1e-4 (parameter grads are fp32 atomic sums over tokens)
  fp16: forward 2e-3 / 2e-3, gradients 1e-2 / 1e-2 (sources and outputs rounded to fp16)
  bf16 (CUDA only): forward 2e-2 / 2e-2, gradients 5e-2 / 5e-2 (Liger's AttnRes bf16 grads use 2e-1 / 2e-2;
  platform-notes §12)
"""

from __future__ import annotations

import pytest
import torch

from depthrewrite.kernels.dispatch import kernel_backend, kernel_info
from depthrewrite.kernels.msar import msar_mix, msar_mix_ref
from depthrewrite.kernels.msar.op import msar_mix_backward

from ._helpers import close as _close, spy_calls

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {
    torch.float32: dict(fwd=(1e-5, 1e-5), grad=(1e-4, 1e-4)),
    torch.float16: dict(fwd=(2e-3, 2e-3), grad=(1e-2, 1e-2)),
    torch.bfloat16: dict(fwd=(2e-2, 2e-2), grad=(5e-2, 5e-2)),
}
EPS = 1e-6


def _site(K, lead, T, D, ks, sigmoid=True, dtype=torch.float32, seed=0):
    """Sources and parameters at trained-model-like scales (non-uniform softmaxes and mixer)."""
    g = torch.Generator().manual_seed(seed)
    m = len(ks) + 1
    src = [(torch.randn(*lead, T, D, generator=g) * (1 + i % 3)).to(DEV, dtype) for i in range(K)]
    query = torch.randn(m, D, generator=g).to(DEV)
    gain = (torch.rand(m, D, generator=g) + 0.5).to(DEV)
    conv = [(torch.randn(D, k, generator=g) * 0.5).to(DEV) for k in ks]
    if sigmoid:
        mix = [(torch.randn(m * D, m, generator=g) * 0.3).to(DEV), torch.randn(m, generator=g).to(DEV)]
        mix.append(torch.tensor(0.7, device=DEV))
    else:
        mix = [None, None, None]
    return src, query, gain, conv, mix


def _run(fn, src, query, gain, conv, mix, seed=1):
    """fn's output and the grads of every tensor input for a random cotangent."""
    leaves = [t.detach().clone().requires_grad_(True) for t in [*src, query, gain, *conv, *mix] if t is not None]
    K, c = len(src), len(conv)
    s, q, gn, cv = leaves[:K], leaves[K], leaves[K + 1], leaves[K + 2 : K + 2 + c]
    mx = leaves[K + 2 + c :] or [None, None, None]
    out = fn(s, q, gn, cv, *mx)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device, out.dtype)
    return out, torch.autograd.grad(out, leaves, cot)


@pytest.fixture
def calls(monkeypatch):
    """Counts the fused launcher calls (to tell the kernel path from the fallback)."""
    from depthrewrite.kernels.msar import fused

    return spy_calls(monkeypatch, fused, ("msar_fwd", "msar_bwd"))


CASES = [  # K, lead, T, D, kernel sizes, sigmoid mixer, conv values
    pytest.param(1, (2,), 1, 6, (2, 3, 4), True, True, id="one-source-m4-one-token"),  # a decoding-step shape
    pytest.param(2, (1,), 18, 5, (2, 3, 5), True, True, id="odd-T-crosses-tiles"),  # two 16-token tiles
    pytest.param(2, (), 4, 7, (3,), False, True, id="mean-mixer-m2-rank0"),
    pytest.param(3, (2, 1), 5, 5, (2, 2), True, False, id="raw-values-rank2"),
    pytest.param(2, (1, 2, 1), 3, 4, (), True, True, id="one-stream-rank3"),
    pytest.param(16, (1,), 2, 3, (2,), False, True, id="max-sources"),
]


@pytest.mark.parametrize("K, lead, T, D, ks, sig, cv", CASES)
def test_matches_reference(K, lead, T, D, ks, sig, cv, calls):
    src, q, gain, conv, mix = _site(K, lead, T, D, ks, sig)
    args = (EPS, float(K), cv, sig)
    want, gwant = _run(lambda *a: msar_mix_ref(*a, *args), src, q, gain, conv, mix)
    with kernel_backend("triton"):
        got, ggot = _run(lambda *a: msar_mix(*a, *args), src, q, gain, conv, mix)
    assert calls == ["msar_fwd", "msar_bwd"]
    _close([got], [want], TOL[torch.float32]["fwd"])
    _close(ggot, gwant, TOL[torch.float32]["grad"])


def test_launchers_with_small_blocks():
    """Several token tiles, extended backward tiles and D chunks, none dividing the sizes (halo across tiles)."""
    from depthrewrite.kernels.msar import fused

    K, ks, sig = 2, (2, 3, 4), True
    src, q, gain, conv, mix = _site(K, (1,), 9, 6, ks, sig, seed=3)
    args = (EPS, 2.0, True, sig)
    want, gwant = _run(lambda *a: msar_mix_ref(*a, *args), src, q, gain, conv, mix)
    got = fused.msar_fwd(src, q, gain, conv, *mix, *args, block_t=4, block_d=4)
    cot = torch.randn(want.shape, generator=torch.Generator().manual_seed(1)).to(DEV)
    ggot = fused.msar_bwd(cot, src, q, gain, conv, *mix, *args, block_t=4, block_d=4, ext_t=8, block_d2=4)
    _close([got], [want], TOL[torch.float32]["fwd"])
    _close(ggot, gwant, TOL[torch.float32]["grad"])


@pytest.mark.skipif(DEV != "cuda", reason="realistic shapes need a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_realistic_shape_on_gpu(dtype):
    """K = 9, m = 4, k = (4, 8, 12), odd T and D: fla-style RMS-relative error < 0.005 on the output and every grad
    (parameter grads sum over ~1000 tokens in a different order: elementwise tolerances would be meaningless)."""
    K, ks = 9, (4, 8, 12)
    src, q, gain, conv, mix = _site(K, (2,), 515, 1000, ks, True, dtype=dtype)
    args = (EPS, float(K), True, True)
    want, gwant = _run(lambda *a: msar_mix_ref(*a, *args), src, q, gain, conv, mix)
    with kernel_backend("triton"):
        got, ggot = _run(lambda *a: msar_mix(*a, *args), src, q, gain, conv, mix)
    for a, b in zip([got, *ggot], [want, *gwant], strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        err = (a.double() - b.double()).pow(2).mean().sqrt() / b.double().pow(2).mean().sqrt().clamp_min(1e-12)
        assert err < 0.005, err


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEV == "cuda" else []))
def test_low_precision(dtype, calls):
    K, ks = 3, (2, 4)
    src, q, gain, conv, mix = _site(K, (2,), 6, 8, ks, True, dtype=dtype)
    args = (EPS, float(K), True, True)
    want, gwant = _run(lambda *a: msar_mix_ref(*a, *args), src, q, gain, conv, mix)
    with kernel_backend("triton"):
        got, ggot = _run(lambda *a: msar_mix(*a, *args), src, q, gain, conv, mix)
    assert calls == ["msar_fwd", "msar_bwd"] and got.dtype == dtype
    _close([got], [want], TOL[dtype]["fwd"])
    _close(ggot, gwant, TOL[dtype]["grad"])


@pytest.mark.parametrize("K, dtype", [(17, torch.float32), (2, torch.float64)], ids=["17-sources", "fp64"])
def test_fallback_runs_the_reference(K, dtype, calls):
    src, q, gain, conv, mix = _site(K, (1,), 3, 4, (2,), True, dtype=dtype)
    args = (EPS, float(K), True, True)
    want, gwant = _run(lambda *a: msar_mix_ref(*a, *args), src, q, gain, conv, mix)
    with kernel_backend("triton"):
        got, ggot = _run(lambda *a: msar_mix(*a, *args), src, q, gain, conv, mix)
    assert calls == []
    _close([got], [want], TOL[torch.float32]["fwd"])
    _close(ggot, gwant, TOL[torch.float32]["grad"])


@pytest.mark.parametrize("sig", [True, False], ids=["sigmoid", "mean"])
def test_opcheck(sig):
    K, ks = 2, (2, 3)
    src, q, gain, conv, mix = _site(K, (1,), 3, 4, ks, sig)
    src = [s.requires_grad_(True) for s in src]
    q.requires_grad_(True)
    grad = torch.randn_like(src[0])
    with kernel_backend("triton"):
        torch.library.opcheck(msar_mix, (src, q, gain, conv, *mix, EPS, float(K), True, sig))
        plain = [s.detach() for s in src]
        torch.library.opcheck(msar_mix_backward, (grad, plain, q.detach(), gain, conv, *mix, EPS, float(K), True, sig))


@pytest.mark.parametrize("sig, cv", [(True, True), (False, False)], ids=["sigmoid-conv", "mean-raw"])
def test_reference_backward_gradcheck(sig, cv):
    """The written-out reference backward (what the op runs off the kernel path) against fp64 finite differences."""
    K, ks = 2, (2, 3)
    src, q, gain, conv, mix = _site(K, (1,), 4, 3, ks, sig)
    leaves = [t.detach().double().requires_grad_(True) for t in [*src, q, gain, *conv, *mix] if t is not None]

    def f(*a):
        c = len(ks)
        mx = list(a[K + 2 + c :]) or [None, None, None]
        return msar_mix(list(a[:K]), a[K], a[K + 1], list(a[K + 2 : K + 2 + c]), *mx, EPS, float(K), cv, sig)

    with kernel_backend("reference"):
        assert torch.autograd.gradcheck(f, tuple(leaves))


def test_kernel_info_is_registered():
    info = kernel_info()
    assert "16 sources" in info["depthrewrite::msar_mix"].falls_back
    assert "depthrewrite::msar_mix_backward" in info


# ---- msar_mix_stack: the earlier sources one stacked tensor -----------------------------------------------------------


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("n_extra, sig", [(1, True), (0, False)], ids=["extra-sigmoid", "rows-only-mean"])
def test_msar_mix_stack_is_msar_mix_of_its_rows(backend, n_extra, sig, calls):
    """The stacked op (kernel or reference), its stacked-tensor reference (what the compile backend traces) and
    msar_mix on the unbound rows: the same output and gradients (every input's, the stack's rows included)."""
    from depthrewrite.kernels.msar.op import msar_mix_stack, msar_mix_stack_ref

    K = 3
    src, query, gain, conv, mix = _site(K, (2,), 5, 6, (2, 3), sigmoid=sig, seed=4)
    n = K - n_extra

    def apart(s, q, g, cv, *mx):
        return msar_mix(s, q, g, cv, *mx, EPS, float(K), True, sig)

    def stacked(op):
        return lambda s, q, g, cv, *mx: op(torch.stack(s[:n]), s[n:], q, g, cv, *mx, EPS, 1.0, True, True, sig)

    with kernel_backend(backend):
        want, g_want = _run(apart, src, query, gain, conv, mix)
        for fn in (stacked(msar_mix_stack), stacked(msar_mix_stack_ref)):
            out, grads = _run(fn, src, query, gain, conv, mix)
            _close([out], [want], TOL[torch.float32]["fwd"])
            _close(grads, g_want, TOL[torch.float32]["grad"])
    if backend == "triton":
        assert "msar_fwd" in calls and "msar_bwd" in calls  # the kernels ran (no silent fallback)
