"""depthrewrite::depth_attn: registration (opcheck), gradients against fp64 finite differences, the spec's math."""

from __future__ import annotations

import pytest
import torch

from depthrewrite.kernels.depth_attn import depth_attn, depth_attn_ref


@pytest.mark.parametrize(
    "K, shape",
    [
        pytest.param(1, (2, 3, 8), id="one-source"),  # softmax over one source is the identity (times scale)
        pytest.param(3, (2, 3, 8), id="three"),
        pytest.param(17, (1, 5, 7), id="many-odd"),  # more sources than any kernel bucket, odd d
    ],
)
def test_opcheck_and_gradcheck(K, shape):
    g = torch.Generator().manual_seed(K)
    src = [torch.randn(*shape, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(K)]
    q = torch.randn(shape[-1], dtype=torch.float64, generator=g, requires_grad=True)
    gain = torch.randn(shape[-1], dtype=torch.float64, generator=g, requires_grad=True)
    torch.library.opcheck(depth_attn, (src, q, gain, 1e-6, float(K)))
    assert torch.autograd.gradcheck(lambda *a: depth_attn(list(a[:K]), a[K], a[K + 1], 1e-6, float(K)), (*src, q, gain))


def test_matches_the_spec_formula():
    torch.manual_seed(0)
    v = [torch.randn(4, 6) for _ in range(3)]
    w, gamma = torch.randn(6), torch.rand(6) + 0.5
    r = [x.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt() for x in v]
    s = torch.stack([(x * (gamma * w)).sum(-1, keepdim=True) * ri for x, ri in zip(v, r)])
    a = s.softmax(0)
    want = sum(ai * x for ai, x in zip(a, v))
    torch.testing.assert_close(depth_attn(v, w, gamma, 1e-6, 1.0), want)
    torch.testing.assert_close(depth_attn(v, w, gamma, 1e-6, 3.0), 3 * want)


def test_zero_query_is_the_mean_and_bf16_returns_bf16():
    v = [torch.randn(2, 4, 8, dtype=torch.bfloat16) for _ in range(4)]
    out = depth_attn(v, torch.zeros(8), torch.ones(8), 1e-6, 1.0)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), torch.stack([x.float() for x in v]).mean(0), atol=1e-2, rtol=1e-2)
    assert torch.equal(depth_attn_ref(v, torch.zeros(8), torch.ones(8), 1e-6, 1.0), out)
