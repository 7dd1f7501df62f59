"""The fused launchers of depth_attn, msar and MoDA return tensors of their own, never views of a bigger or
differently shaped buffer (``t._base is None``): their outputs cross block boundaries, and FSDP2 warns about a block
module that returns a view (an in-place op on it would skip the pre-backward all-gather). The MoDA references and the
ops' fake implementations give the same layouts. On CPU the kernels run in Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from depthrewrite.kernels.depth_attn import fused as da
from depthrewrite.kernels.depth_attn.op import MAX_SOURCES
from depthrewrite.kernels.moda import fused as mf
from depthrewrite.kernels.moda.reference import moda_attn_ref, moda_slots_ref
from depthrewrite.kernels.msar import fused as ms

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _own(tensors) -> None:
    tensors = [t for t in tensors if t is not None]
    assert tensors
    for i, t in enumerate(tensors):
        assert t._base is None, f"output {i} {tuple(t.shape)} is a view of a {tuple(t._base.shape)} tensor"


def _r(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEV)


@pytest.mark.parametrize("K", [3, MAX_SOURCES + 1], ids=["one-launch", "split"])
def test_depth_attn_launchers(K):
    lead, D, S = (2, 3), 8, 2
    src = [_r(*lead, D, seed=i) for i in range(K)]
    q, g = _r(D, seed=50), _r(D, seed=51).abs() + 0.5
    out = da.depth_attn_fwd(src, q, g, 1e-6, 2.0)
    assert out.shape == src[0].shape
    _own([out])
    grads = da.depth_attn_bwd(_r(*lead, D, seed=60), src, q, g, 1e-6, 2.0)
    assert [t.shape for t in grads[2:]] == [s.shape for s in src]
    _own(grads)
    qs, gs = _r(S, D, seed=52), _r(S, D, seed=53).abs() + 0.5
    o, lse = da.depth_attn_partial_fwd(src, qs, gs, 1e-6)
    assert o.shape == (S, *lead, D) and lse.shape == (S, *lead)
    _own([o, lse])
    _own(da.depth_attn_partial_bwd(_r(S, *lead, D, seed=61), _r(S, *lead, seed=62), src, qs, gs, 1e-6))
    last = _r(*lead, D, seed=70)
    merged = da.depth_attn_merge_fwd(o[0], lse[0], last, q, g, 1e-6, 2.0)
    assert merged.shape == last.shape
    _own([merged])
    mg = da.depth_attn_merge_bwd(_r(*lead, D, seed=63), o[0], lse[0], last, q, g, 1e-6, 2.0)
    assert mg[0].shape == o[0].shape and mg[1].shape == lse[0].shape and mg[2].shape == last.shape
    _own(mg)


@pytest.mark.parametrize("sigmoid", [True, False], ids=["sigmoid-mixer", "mean-mixer"])
def test_msar_launchers(sigmoid):
    K, lead, T, D, ks = 2, (2,), 5, 6, (2, 3)
    m = len(ks) + 1
    src = [_r(*lead, T, D, seed=i) for i in range(K)]
    query, gain = _r(m, D, seed=10), _r(m, D, seed=11).abs() + 0.5
    conv = [_r(D, k, seed=20 + k) * 0.5 for k in ks]
    mix = [_r(m * D, m, seed=30) * 0.3, _r(m, seed=31), torch.tensor(0.7, device=DEV)] if sigmoid else [None] * 3
    out = ms.msar_fwd(src, query, gain, conv, *mix, 1e-6, float(K), True, sigmoid)
    _own([out])
    grads = ms.msar_bwd(_r(*lead, T, D, seed=40), src, query, gain, conv, *mix, 1e-6, float(K), True, sigmoid)
    _own(grads)
    if sigmoid:
        assert grads[-1].shape == mix[2].shape  # dα of a 0-d α: was a reshaped view of a [1] buffer


@pytest.mark.parametrize("mask", [None, "add"], ids=["no-mask", "learned-add-mask-2d"])
def test_moda_launchers_and_reference(mask):
    B, Hq, Hk, T, n, d = 2, 4, 2, 7, 3, 8
    q, k, v = _r(B, Hq, T, d, seed=1), _r(B, Hk, T, d, seed=2), _r(B, Hk, T, d, seed=3)
    kd, vd = _r(B, T, n, Hk, d, seed=4), _r(B, T, n, Hk, d, seed=5)
    m = _r(T, T, seed=6) if mask == "add" else None
    lam = _r(Hq, seed=7).abs()
    o, lse = mf.moda_attn_fwd(q, k, v, m, kd, vd, lam, 0.3, True, 0.0)
    sdpa = torch.empty(B, T, Hq, d).transpose(1, 2).stride()  # SDPA's output layout
    assert o.stride() == sdpa
    _own([o, lse])
    grads = mf.moda_attn_bwd(_r(B, Hq, T, d, seed=8), q, k, v, m, kd, vd, lam, o, 0.3, True, 0.0, m is not None)
    if m is not None:
        assert grads[3].shape == m.shape  # the mask's gradient: was sum_to_size's view when it drops leading dims
    _own(grads)
    ref = moda_attn_ref(q.cpu(), k.cpu(), v.cpu(), None if m is None else m.cpu(), kd.cpu(), vd.cpu(), lam.cpu(),
                        0.3, True)
    assert ref.stride() == sdpa
    _own([ref])
    with torch.no_grad():  # the op's fake gives the same layout
        fake = torch.ops.depthrewrite.moda_attn.default(q.to("meta"), k.to("meta"), v.to("meta"), None,
                                                        kd.to("meta"), vd.to("meta"), None, 0.3, True, 0.0, None, 0.0)
    assert fake.stride() == sdpa
    slots = moda_slots_ref([_r(B, Hk, T, d, seed=9), _r(B, T, Hk, d, seed=10).transpose(1, 2)])
    assert slots.shape == (B, T, 2, Hk, d) and slots.is_contiguous()
    _own([slots])


def test_mhc_launchers():
    from depthrewrite.kernels.mhc import fused as mh

    lead, n, D = (2, 3), 4, 8
    X, y = _r(*lead, n, D, seed=1), _r(*lead, D, seed=2)
    phi, bias, alpha = _r(n * D, n * n + 2 * n, seed=3) * 0.1, _r(n * n + 2 * n, seed=4), _r(3, seed=5).abs()
    pre, post, res = mh.mhc_coeffs_fwd(X, phi, bias, alpha, 5, 1e-6)
    _own([pre, post, res])
    _own(mh.mhc_coeffs_bwd(X, phi, bias, alpha, _r(*lead, n, seed=6), _r(*lead, n, seed=7), _r(*lead, n, n, seed=8),
                           5, 1e-6))
    _own([mh.mhc_pre_fwd(X, pre), *mh.mhc_pre_bwd(X, pre, _r(*lead, D, seed=9))])
    _own([mh.mhc_post_fwd(X, res, post, y), *mh.mhc_post_bwd(X, res, post, y, _r(*lead, n, D, seed=10))])
