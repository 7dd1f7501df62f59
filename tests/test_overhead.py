"""The cost model of bench.overhead: a FLOP formula for every depth op, unfused bytes per op, the step count.

No speed is asserted here (bench.overhead measures it); every count below is exact arithmetic on shapes."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import depthrewrite.kernels as kernels
from depthrewrite.kernels import cost

ops = torch.ops.depthrewrite
D, T = 8, 4  # row width, tokens per batch row


def _depth_args(b: int) -> dict[str, Callable[[], tuple]]:
    """Per op, the arguments of one small call with batch b (tokens = b·T)."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    src = [r(b, T, D) for _ in range(3)]
    q, gain, qs, gs = r(D), r(D), r(2, D), r(2, D)
    o, lse = r(b, T, D), r(b, T)
    msar = (src, r(2, D), r(2, D), [r(D, 3)], r(2 * D, 2), r(2), r(1), 1e-6, 3.0, True, True)
    n = 2
    X, phi, bias, alpha = r(b, T, n, D), 0.1 * r(n * D, n * n + 2 * n), r(n * n + 2 * n), r(3)
    pre, post, res, y = r(b, T, n), r(b, T, n), r(b, T, n, n), r(b, T, D)
    mq, mk, mv = r(b, 2, T, D), r(b, 1, T, D), r(b, 1, T, D)
    dk, dv = r(b, T, 2, 1, D), r(b, T, 2, 1, D)
    moda = (mq, mk, mv, None, dk, dv, None, 0.35, True, 0.0, None, 0.0)
    return {
        "depth_attn": lambda: (src, q, gain, 1e-6, 3.0),
        "depth_attn_backward": lambda: (r(b, T, D), src, q, gain, 1e-6, 3.0),
        "depth_attn_stack": lambda: (torch.stack(src[:2]), src[2:], q, gain, 1e-6, 1.0, True),
        "depth_attn_stack_backward": lambda: (r(b, T, D), torch.stack(src[:2]), src[2:], q, gain, 1e-6, 1.0, True),
        "depth_attn_partial": lambda: (src, qs, gs, 1e-6),
        "depth_attn_partial_backward": lambda: (r(2, b, T, D), r(2, b, T), src, qs, gs, 1e-6),
        "depth_attn_merge": lambda: (o, lse, src[0], q, gain, 1e-6, 3.0),
        "depth_attn_merge_backward": lambda: (r(b, T, D), o, lse, src[0], q, gain, 1e-6, 3.0),
        "msar_mix": lambda: msar,
        "msar_mix_backward": lambda: (r(b, T, D), *msar),
        "msar_mix_stack": lambda: (torch.stack(src[:2]), src[2:], *msar[1:7], 1e-6, 1.0, True, True, True),
        "msar_mix_stack_backward": lambda: (r(b, T, D), torch.stack(src[:2]), src[2:], *msar[1:7], 1e-6, 1.0, True,
                                            True, True),
        "mhc_coeffs": lambda: (X, phi, bias, alpha, 3, 1e-6),
        "mhc_pre": lambda: (X, pre),
        "mhc_post": lambda: (X, res, post, y),
        "mhc_collapse": lambda: (X, "mean"),
        "mhc_coeffs_backward": lambda: (X, phi, bias, alpha, r(b, T, n), r(b, T, n), r(b, T, n, n), 3, 1e-6),
        "mhc_pre_backward": lambda: (X, pre, y),
        "mhc_post_backward": lambda: (X, res, post, y, r(b, T, n, D)),
        "moda_attn": lambda: moda,
        "moda_attn_backward": lambda: (r(b, 2, T, D), *moda[:7], r(b, 2, T, D), *moda[7:], False),
        "moda_attn_slots": lambda: (*moda[:4], [mk, mv], [mv, mk], *moda[6:]),  # two slots [B, Hk, T, d]
        "moda_attn_slots_stack": lambda: (*moda[:4], mk[None], mv[None], [mv], [mk], *moda[6:]),  # as above, stacked
    }


def _flops(name: str, b: int) -> int:
    args = _depth_args(b)[name]()
    with FlopCounterMode(display=False) as fc:
        getattr(ops, name)(*args)
    return fc.get_total_flops()


def test_every_registered_depth_op_has_a_formula():
    kernels.all_kernel_info()  # imports every op package
    names = {n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("depthrewrite::")}
    assert names == set(cost.FORMULAS) == set(_depth_args(1))
    cost.register_flop_formulas()  # idempotent: a second registration is no error
    assert all(getattr(ops, n) in torch.utils.flop_counter.flop_registry for n in names)


@pytest.mark.parametrize("name", sorted(cost.FORMULAS))
def test_flop_counter_counts_the_op_and_it_scales_with_tokens(name):
    f1, f2, f3 = (_flops(name, b) for b in (1, 2, 3))
    assert 0 < f1 < f2
    assert f3 - f2 == f2 - f1  # affine in tokens: per-token work plus per-parameter work
    assert f2 - f1 > 0.8 * f1  # and the per-token work is nearly all of it at these sizes


def test_depth_attn_flops_by_hand():
    # K=3 sources, N=2·4 rows, D=8: u = γ⊙w (8); per source-row: Σv² (2·8), /D, +eps, rsqrt (3), v·u (2·8),
    # ·r (1); softmax over 3 sources per row (5 each); Σ α v (2·8 per source-row); ·scale (8 per row)
    K, N = 3, 2 * T
    hand = D + K * N * (2 * D + 3) + K * N * (2 * D + 1) + 5 * K * N + 2 * K * N * D + N * D
    assert hand == 8 + 456 + 408 + 120 + 384 + 64
    assert _flops("depth_attn", 2) == hand


def test_the_stacked_mix_counts_as_the_mix_of_its_rows():
    args = _depth_args(2)
    assert _flops("depth_attn_stack", 2) == _flops("depth_attn", 2)
    src, q, gain = args["depth_attn"]()[:3]
    with FlopCounterMode(display=False) as fc:
        ops.depth_attn_stack_backward(torch.randn(2, T, D), torch.stack(src[:2]), src[2:], q, gain, 1e-6, 1.0, True)
    assert fc.get_total_flops() == _flops("depth_attn_backward", 2)
    assert _flops("msar_mix_stack", 2) == _flops("msar_mix", 2)


def test_traffic_mode_sees_a_depth_op_as_one_op():
    args = _depth_args(2)["depth_attn"]()
    with cost.TrafficMode() as tm:
        out = ops.depth_attn(*args)
    assert list(tm.by_op) == ["depthrewrite.depth_attn"]  # its reference's stack/pow/softmax are not seen
    src, q, gain = args[:3]
    moved = sum(cost.tensor_bytes(t) for t in [*src, q, gain, out])
    assert tm.by_op["depthrewrite.depth_attn"].bytes == tm.bytes == moved == (3 * 2 * T * D + 2 * D + 2 * T * D) * 4
    assert tm.flops == _flops("depth_attn", 2)


def test_traffic_mode_skips_views_and_counts_in_place_once_each_way():
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with cost.TrafficMode() as tm:
        v = x.t().view(8, 4)
        v.add_(1.0)
        z = torch.mm(x, y.t())
    assert tm.by_op["aten.t"].bytes == tm.by_op["aten.view"].bytes == 0
    assert tm.by_op["aten.add_"].bytes == 2 * 32 * 4  # read x, write x
    assert tm.by_op["aten.mm"].bytes == (32 + 32 + 16) * 4 and tm.by_op["aten.mm"].flops == 2 * 4 * 8 * 4
    assert z.shape == (4, 4)


def test_grouped_kv_attention_counts_as_repeated_heads():
    # The CUDA SDPA kernels take K/V with fewer heads than Q (GQA); torch's formulas reject those shapes, so the count
    # is the one with K/V repeated to Q's heads (what the kernels compute). Formulas called on meta tensors directly.
    f = cost.flop_mapping()
    q, kv = torch.empty(2, 8, 16, 32, device="meta"), torch.empty(2, 2, 16, 32, device="meta")
    lse = torch.empty(2, 8, 16, device="meta")
    fwd = f[torch.ops.aten._scaled_dot_product_efficient_attention]
    assert cost._flops(fwd, (q, kv, kv, None, False), {}, (q,)) == cost._flops(fwd, (q, q, q, None, False), {}, (q,))
    bwd = f[torch.ops.aten._scaled_dot_product_flash_attention_backward]
    rest = (None, None, 16, 16, 0.0, False, None, None)
    assert cost._flops(bwd, (q, q, kv, kv, q, lse, *rest), {}, (q, kv, kv)) == \
        cost._flops(bwd, (q, q, q, q, q, lse, *rest), {}, (q, q, q)) > 0


def test_counting_a_converted_step():
    from bench import overhead

    a = argparse.Namespace(layers=2, hidden=32, seq=16, batch=1, device="cpu", dtype="fp32")
    base = overhead.build(overhead.Variant("original", "original", None), a)
    conv = overhead.build(overhead.Variant("block-attnres", "Block AttnRes", "block-attnres", {"blocks": 2}), a)
    ids = torch.randint(3, 256, (a.batch, a.seq))
    c0, c1 = overhead.step_cost(base, ids), overhead.step_cost(conv, ids)
    assert c0.tokens == c1.tokens == a.seq and c0.flops > 0 and c0.bytes > 0
    dflops, dbytes = overhead.extra(c1, c0)
    assert dflops > 0 and dbytes > 0
    assert c1.part("depthrewrite.depth_attn").calls > 0 and c0.part("depthrewrite.").calls == 0
    assert overhead.floor(dflops, dbytes)[0] == 1 + max(dflops, dbytes)
    assert overhead.peak_memory(conv, ids) > overhead.resident_bytes(conv)
