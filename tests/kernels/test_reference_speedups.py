"""The batched PyTorch references (issue #16, item 3): the hand-written backward formulas against autograd through
the forward references in fp64, the eager convolution (channels-last ``conv2d`` / ``convolution_backward``) against
the pointwise shifted multiply-adds used while compiling, ``causal_depthwise_conv`` against a tap-by-tap loop
(with and without ``left`` context), and traceability by ``make_fx`` with fake and symbolic shapes.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from depthrewrite.kernels.depth_attn import op as da_op
from depthrewrite.kernels.depth_attn.reference import depth_attn_merge_ref, depth_attn_partial_ref, depth_attn_ref
from depthrewrite.kernels.msar import reference as msar_reference
from depthrewrite.kernels.msar.op import _backward_ref as msar_backward_ref
from depthrewrite.kernels.msar.reference import causal_depthwise_conv, msar_mix_ref

F64 = torch.float64


def _msar_site(K, lead, T, D, ks, sigmoid, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = len(ks) + 1
    src = [torch.randn(*lead, T, D, generator=g, dtype=F64) * (1 + i % 3) for i in range(K)]
    query = torch.randn(m, D, generator=g, dtype=F64)
    gain = torch.rand(m, D, generator=g, dtype=F64) + 0.5
    conv = [torch.randn(D, k, generator=g, dtype=F64) * 0.5 for k in ks]
    mix = [None, None, None]
    if sigmoid:
        mix = [torch.randn(m * D, m, generator=g, dtype=F64) * 0.3, torch.randn(m, generator=g, dtype=F64),
               torch.tensor(0.7, dtype=F64)]
    return src, query, gain, conv, mix


def _taps(x, w, left=None):
    k, T = w.shape[1], x.shape[-2]
    xp = torch.cat([x.new_zeros(*x.shape[:-2], k - 1, x.shape[-1]) if left is None else left[..., left.shape[-2] - (k - 1) :, :],
                    x], dim=-2)
    return sum(w[:, j] * xp[..., j : j + T, :] for j in range(k))


@pytest.fixture(params=[False, True], ids=["conv2d", "pointwise"])
def pointwise(request, monkeypatch):
    monkeypatch.setattr(msar_reference, "_pointwise", lambda: request.param)
    return request.param


@pytest.mark.parametrize("k", [1, 3, 12])
def test_causal_depthwise_conv(pointwise, k):
    x, w = torch.randn(2, 3, 5, 6, dtype=F64), torch.randn(6, k, dtype=F64)
    torch.testing.assert_close(causal_depthwise_conv(x, w), _taps(x, w))
    left = torch.randn(2, 3, 11, 6, dtype=F64)
    torch.testing.assert_close(causal_depthwise_conv(x, w, left[..., 11 - max(k - 1, 0):, :] if k > 1 else None),
                               _taps(x, w, left))


@pytest.mark.parametrize(
    "K,lead,T,ks,sigmoid,conv_values",
    [(3, (2,), 13, (4, 8, 12), True, True), (4, (), 5, (2, 6), True, False), (1, (2, 1), 7, (3,), False, True),
     (2, (1,), 4, (), True, True), (5, (2,), 9, (4, 8, 12), False, False)],
)
def test_msar_backward_ref_matches_autograd(pointwise, K, lead, T, ks, sigmoid, conv_values):
    src, q, gain, conv, mix = _msar_site(K, lead, T, 8, ks, sigmoid)
    leaves = [t.clone().requires_grad_(True) for t in [*src, q, gain, *conv, *mix] if t is not None]
    c = len(conv)
    s, lq, lg, lc = leaves[:K], leaves[K], leaves[K + 1], leaves[K + 2 : K + 2 + c]
    lm = leaves[K + 2 + c :] or [None, None, None]
    args = (1e-3, float(K), conv_values, sigmoid)
    out = msar_mix_ref(s, lq, lg, lc, *lm, *args)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    want = torch.autograd.grad(out, leaves, cot)
    got = msar_backward_ref(cot, src, q, gain, conv, *mix, *args)
    if not sigmoid and mix[0] is None:
        assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_msar_left_context(pointwise):
    src, q, gain, conv, mix = _msar_site(3, (2,), 10, 8, (4, 8, 12), True)
    whole = msar_mix_ref(src, q, gain, conv, *mix, 1e-3, 3.0)
    first = msar_mix_ref([x[:, :6] for x in src], q, gain, conv, *mix, 1e-3, 3.0)
    left = [torch.cat([torch.zeros_like(x[:, :7]), x[:, :6]], dim=1)[:, -11:] for x in src]
    second = msar_mix_ref([x[:, 6:] for x in src], q, gain, conv, *mix, 1e-3, 3.0, left=left)
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole)


@pytest.mark.parametrize("K,lead,S", [(3, (2, 5), 1), (5, (), 3), (1, (4,), 2)])
def test_depth_attn_backward_refs_match_autograd(K, lead, S):
    g = torch.Generator().manual_seed(0)
    src = [torch.randn(*lead, 8, generator=g, dtype=F64) * (1 + i % 3) for i in range(K)]
    qs, gs = torch.randn(S, 8, generator=g, dtype=F64), torch.rand(S, 8, generator=g, dtype=F64) + 0.5
    leaves = [t.clone().requires_grad_(True) for t in (qs, gs, *src)]
    o, lse = depth_attn_partial_ref(leaves[2:], leaves[0], leaves[1], 1e-3)
    go, gl = torch.randn(o.shape, generator=g, dtype=F64), torch.randn(lse.shape, generator=g, dtype=F64)
    want = torch.autograd.grad((o * go).sum() + (lse * gl).sum(), leaves)
    for a, b in zip(da_op._partial_backward_ref(go, gl, src, qs, gs, 1e-3), want):
        torch.testing.assert_close(a, b)
    # the single-query mix through the same formula, and the merge
    h = depth_attn_ref(leaves[2:], leaves[0][0], leaves[1][0], 1e-3, 2.0)
    gh = torch.randn(h.shape, generator=g, dtype=F64)
    want = torch.autograd.grad(h, [leaves[0], leaves[1], *leaves[2:]], gh)
    got = da_op._partial_backward_ref(gh.unsqueeze(0) * 2.0, None, src, qs[:1], gs[:1], 1e-3)
    torch.testing.assert_close(got[0][0], want[0][0])
    for a, b in zip(got[2:], want[2:]):
        torch.testing.assert_close(a, b)
    mo, ml, last = [t.detach().clone().requires_grad_(True) for t in (o[0], lse[0], src[0])]
    mq, mg = qs[0].clone().requires_grad_(True), gs[0].clone().requires_grad_(True)
    hm = depth_attn_merge_ref(mo, ml, last, mq, mg, 1e-3, 2.0)
    want = torch.autograd.grad(hm, [mo, ml, last, mq, mg], gh)
    for a, b in zip(da_op._merge_backward_ref(gh, mo.detach(), ml.detach(), src[0], qs[0], gs[0], 1e-3, 2.0), want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("mode", ["fake", "symbolic"])
def test_references_trace(pointwise, mode):
    src, q, gain, conv, mix = _msar_site(3, (2,), 10, 8, (4, 8, 12), True)
    make_fx(lambda s, q, g, c, p, b, a: msar_mix_ref(s, q, g, c, p, b, a, 1e-6, 3.0), tracing_mode=mode)(
        src, q, gain, conv, *mix)
    make_fx(lambda gr, s, q, g, c, p, b, a: msar_backward_ref(gr, s, q, g, c, p, b, a, 1e-6, 3.0, True, True),
            tracing_mode=mode)(src[0], src, q, gain, conv, *mix)
    s2 = [x[:, 0] for x in src]
    o, lse = depth_attn_partial_ref(s2, q, gain, 1e-6)
    make_fx(lambda s, q, g: depth_attn_ref(s, q, g, 1e-6, 3.0), tracing_mode=mode)(s2, q[0], gain[0])
    make_fx(lambda s, q, g: depth_attn_partial_ref(s, q, g, 1e-6), tracing_mode=mode)(s2, q, gain)
    make_fx(lambda go, gl, s, q, g: da_op._partial_backward_ref(go, gl, s, q, g, 1e-6), tracing_mode=mode)(
        o, lse, s2, q, gain)
    make_fx(lambda gr, o, l, x, q, g: da_op._merge_backward_ref(gr, o, l, x, q, g, 1e-6, 3.0), tracing_mode=mode)(
        s2[0], o[0], lse[0], s2[0], q[0], gain[0])
