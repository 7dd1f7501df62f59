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


# ---- two-phase pair (attnres spec §7): references, registration and the hand-written backward formulas in fp64 ----


@pytest.mark.parametrize("K, S, shape", [(1, 1, (3, 5)), (3, 2, (2, 3, 6))])
def test_partial_opcheck_and_gradcheck(K, S, shape):
    from depthrewrite.kernels.depth_attn import depth_attn_partial

    g = torch.Generator().manual_seed(K)
    f64 = dict(dtype=torch.float64, generator=g, requires_grad=True)
    src = [torch.randn(*shape, **f64) for _ in range(K)]
    qs, gs = torch.randn(S, shape[-1], **f64), torch.randn(S, shape[-1], **f64)
    torch.library.opcheck(depth_attn_partial, (src, qs, gs, 1e-6))
    assert torch.autograd.gradcheck(lambda *a: depth_attn_partial(list(a[:K]), a[K], a[K + 1], 1e-6), (*src, qs, gs))


def test_merge_opcheck_and_gradcheck():
    from depthrewrite.kernels.depth_attn import depth_attn_merge

    g = torch.Generator().manual_seed(0)
    f64 = dict(dtype=torch.float64, generator=g, requires_grad=True)
    o, lse, last = torch.randn(2, 3, 7, **f64), torch.randn(2, 3, **f64), torch.randn(2, 3, 7, **f64)
    q, gain = torch.randn(7, **f64), torch.randn(7, **f64)
    torch.library.opcheck(depth_attn_merge, (o, lse, last, q, gain, 1e-6, 3.0))
    assert torch.autograd.gradcheck(lambda *a: depth_attn_merge(*a, 1e-6, 3.0), (o, lse, last, q, gain))


def test_two_phase_references_equal_the_single_pass():
    from depthrewrite.kernels.depth_attn import depth_attn_merge_ref, depth_attn_partial_ref

    g = torch.Generator().manual_seed(1)
    src = [torch.randn(4, 6, generator=g, dtype=torch.float64) for _ in range(5)]
    qs, gs = torch.randn(3, 6, generator=g, dtype=torch.float64), torch.randn(3, 6, generator=g, dtype=torch.float64)
    o, lse = depth_attn_partial_ref(src[:4], qs, gs, 1e-6)
    for s in range(3):
        want = depth_attn_ref(src, qs[s], gs[s], 1e-6, 5.0)
        torch.testing.assert_close(depth_attn_merge_ref(o[s], lse[s], src[4], qs[s], gs[s], 1e-6, 5.0), want)


def test_each_site_is_one_opaque_node_forward_and_backward():
    """AOT autograd keeps every op, and every backward op, as a single node (what the compile backend rewrites)."""
    from torch._functorch.aot_autograd import aot_function, make_boxed_func

    from depthrewrite.kernels.depth_attn import depth_attn_merge, depth_attn_partial

    seen = []

    def grab(gm, _):
        seen.append(sorted(str(n.target) for n in gm.graph.nodes if "depthrewrite" in str(n.target)))
        return make_boxed_func(gm)

    def f(a, b, c, q, g):
        o, lse = depth_attn_partial([a, b], q[None], g[None], 1e-6)
        h = depth_attn_merge(o[0], lse[0], c, q, g, 1e-6, 3.0)
        return depth_attn([a, b, c], q, g, 1e-6, 3.0).sum() + h.sum()

    args = [torch.randn(4, 8, requires_grad=True) for _ in range(3)] + [torch.randn(8, requires_grad=True)] * 2
    aot_function(f, fw_compiler=grab, bw_compiler=grab)(*args).backward()
    ops = ["depthrewrite.depth_attn.default", "depthrewrite.depth_attn_merge.default"]
    assert seen[0] == ops + ["depthrewrite.depth_attn_partial.default"]
    assert seen[1] == [o.replace(".default", "_backward.default") for o in ops] + [
        "depthrewrite.depth_attn_partial_backward.default"
    ]
