"""Depth ops lowered to their references for inductor (``depthrewrite.kernels.decompose``, backend option
``decompose``): the decomposed op computes what the registered op computes, forward and backward; it stays one
opaque node where the Triton kernel would run and in exported graphs.

Compiles use the backend's ``aot_eager`` inner compiler: AOT autograd traces the same decompositions inductor gets,
without code generation (seconds, not minutes)."""

from __future__ import annotations

import pytest
import torch

import depthrewrite as dr
import depthrewrite.kernels  # noqa: F401 - registers every op package
from depthrewrite.demo.zoo import hf_model
from depthrewrite.kernels.decompose import DECOMPOSABLE, decompositions
from depthrewrite.kernels.dispatch import kernel_backend

OPS = torch.ops.depthrewrite


def _g(*shape, seed=[0]):  # noqa: B006 - one generator state for the module: fresh values per call
    seed[0] += 1
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed[0]))


def _cases() -> dict[str, tuple]:
    """op -> (callable, inputs): one small call per forward op (the backward ops run under its autograd)."""
    srcs = [_g(2, 5, 8) for _ in range(3)]
    X = _g(2, 5, 4, 8)
    return {
        "depth_attn": (OPS.depth_attn.default, (srcs, _g(8), 1 + 0.1 * _g(8), 1e-6, 3.0)),
        "depth_attn_stack": (OPS.depth_attn_stack.default, (_g(2, 2, 5, 8), [srcs[0]], _g(8), 1 + 0.1 * _g(8), 1e-6, 1.0, True)),
        "depth_attn_stack_fixed_scale": (OPS.depth_attn_stack.default, (_g(3, 2, 5, 8), [], _g(8), 1 + 0.1 * _g(8), 1e-6, 0.5, False)),
        "depth_attn_partial": (OPS.depth_attn_partial.default, (srcs, _g(2, 8), 1 + 0.1 * _g(2, 8), 1e-6)),
        "depth_attn_merge": (OPS.depth_attn_merge.default, (_g(2, 5, 8), _g(2, 5), _g(2, 5, 8), _g(8), 1 + 0.1 * _g(8), 1e-6, 2.0)),
        "msar_mix": (
            OPS.msar_mix.default,
            ([_g(2, 6, 8) for _ in range(3)], _g(3, 8), 1 + 0.1 * _g(3, 8), [_g(8, 4), _g(8, 2)], 0.3 * _g(24, 3),
             _g(3), torch.tensor([0.7]), 1e-6, 3.0, True, True, 1e-5),
        ),  # fmt: skip (eps_mix positional, as the rewrite passes it)
        "msar_mix_stack": (
            OPS.msar_mix_stack.default,
            (_g(2, 2, 6, 8), [_g(2, 6, 8)], _g(3, 8), 1 + 0.1 * _g(3, 8), [_g(8, 4), _g(8, 2)], 0.3 * _g(24, 3),
             _g(3), torch.tensor([0.7]), 1e-6, 1.0, True, True, True, 1e-5),
        ),  # fmt: skip
        "msar_mix_stack_rows_only_mean": (
            OPS.msar_mix_stack.default,
            (_g(3, 2, 6, 8), [], _g(2, 8), 1 + 0.1 * _g(2, 8), [_g(8, 3)], None, None, None, 1e-6, 0.5, False, False,
             False),
        ),  # fmt: skip
        "msar_mix_mean_raw_values": (
            OPS.msar_mix.default, ([_g(2, 6, 8) for _ in range(2)], _g(2, 8), 1 + 0.1 * _g(2, 8), [_g(8, 3)], None, None, None,
                           1e-6, 2.0, False, False),
        ),  # fmt: skip
        "mhc_coeffs": (OPS.mhc_coeffs.default, (X, 0.2 * _g(32, 24), _g(24), torch.tensor([0.5, 0.8, 1.1]), 5, 1e-6)),
        "mhc_pre": (OPS.mhc_pre.default, (X, torch.rand(2, 5, 4))),
        "mhc_post": (OPS.mhc_post.default, (X, torch.rand(2, 5, 4, 4), torch.rand(2, 5, 4), _g(2, 5, 8))),
        "mhc_collapse": (OPS.mhc_collapse.default, (X, "mean")),
        "moda_attn": (
            OPS.moda_attn.default,
            (_g(1, 4, 6, 8), _g(1, 2, 6, 8), _g(1, 2, 6, 8), None, _g(1, 6, 3, 2, 8), _g(1, 6, 3, 2, 8),
             torch.rand(4), 0.3, True, 0.0, None, 0.0),
        ),  # fmt: skip
        "moda_attn_bool_mask_mha": (
            OPS.moda_attn.default,
            (_g(1, 2, 6, 8), _g(1, 2, 6, 8), _g(1, 2, 6, 8), torch.rand(1, 1, 6, 6) > 0.3, _g(1, 6, 2, 2, 8),
             _g(1, 6, 2, 2, 8), None, 0.3, False, 0.0, None, 0.0),
        ),  # fmt: skip
        "moda_attn_slots": (  # slots as their writers made them: one [B, Hk, T, d] each, a transposed one among them
            OPS.moda_attn_slots.default,
            (_g(1, 4, 6, 8), _g(1, 2, 6, 8), _g(1, 2, 6, 8), None, [_g(1, 2, 6, 8), _g(1, 6, 2, 8).transpose(1, 2)],
             [_g(1, 2, 6, 8), _g(1, 2, 6, 8)], torch.rand(4), 0.3, True, 0.0, None, 0.0),
        ),  # fmt: skip
        "moda_attn_slots_stack": (  # two rows of a [n, 2, ...] buffer, then one slot of the block's own
            OPS.moda_attn_slots_stack.default,
            (_g(1, 4, 6, 8), _g(1, 2, 6, 8), _g(1, 2, 6, 8), None, *_g(2, 2, 1, 2, 6, 8).unbind(1),
             [_g(1, 6, 2, 8).transpose(1, 2)], [_g(1, 2, 6, 8)], torch.rand(4), 0.3, True, 0.0, None, 0.0),
        ),  # fmt: skip
    }


CASES = _cases()


def _leaves(inputs):
    """The inputs with every float tensor (also inside lists) a fresh leaf that requires grad."""

    def leaf(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.detach().clone().requires_grad_(True)
        if isinstance(x, list):
            return [leaf(y) for y in x]
        return x

    return [leaf(x) for x in inputs]


def _flat(inputs):
    for x in inputs:
        if isinstance(x, list):
            yield from _flat(x)
        elif isinstance(x, torch.Tensor) and x.requires_grad:
            yield x


def _run(fn, inputs):
    """Outputs and the gradients of every float input of a weighted sum of the outputs."""
    out = fn(*inputs)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    loss = sum((o * torch.linspace(-1, 1, o.numel()).reshape(o.shape)).sum() for o in outs)
    grads = torch.autograd.grad(loss, list(_flat(inputs)))
    return [o.detach() for o in outs], grads


pytestmark = pytest.mark.usefixtures("fresh_backend")  # tests/conftest.py: Dynamo reset, records cleared


def test_every_registered_depth_op_has_a_decomposition():
    registered = {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("depthrewrite::")}
    assert registered == set(DECOMPOSABLE)
    assert {k.name().split("::", 1)[1] for k in decompositions()} == set(DECOMPOSABLE)


@pytest.mark.parametrize("case", list(CASES))
def test_decomposed_op_matches_the_registered_op_forward_and_backward(case):
    op, inputs = CASES[case]
    want, g_want = _run(op, _leaves(inputs))
    compiled = torch.compile(lambda *a: op(*a), backend="depthrewrite", options={"inner": "aot_eager"})
    got, g_got = _run(compiled, _leaves(inputs))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    (rec,) = [r for r in dr.backend._RECORDS if r.kind == "converted"]
    name = op._schema.name.split("::", 1)[1]
    assert rec.decomposed[name] >= 1
    backward = f"{name}_backward"
    if backward in DECOMPOSABLE:
        assert rec.decomposed[backward] >= 1
    assert not any(a.depth_ops for a in rec.aot)  # no opaque depth op left in AOT's forward and backward graphs


STACKED = {"depth_attn_stack": 0, "msar_mix_stack": 0, "moda_attn_slots_stack": 4}  # case -> the stack's position


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("case", list(STACKED))
def test_a_stacked_op_compiles_once_for_every_row_count(case, backend):
    """A block program reads its earlier sources as one stack whose row count differs from block to block: compiled,
    the count is a dynamic size, so every block after the first two shares one graph. Nothing in the traced op —
    the decomposition (its ``n + i`` row indices were one) nor the routing probe (listing the rows was one) — may
    fix it to one value (a guard that compiled one program per block, 2-3x the compile time)."""
    from torch._dynamo.utils import counters

    op, inputs = CASES[case]
    at = STACKED[case]
    compiled = torch.compile(lambda *a: op(*a), backend="depthrewrite", options={"inner": "aot_eager"})
    counters.clear()
    with kernel_backend(backend):
        for n in (2, 3, 4, 5):
            args = list(inputs)
            for i in range(at, at + (2 if case.startswith("moda") else 1)):  # MoDA: its key and value stacks
                args[i] = _g(n, *inputs[i].shape[1:])
            got, g_got = _run(compiled, _leaves(args))
            want, g_want = _run(op, _leaves(args))
            for a, b in zip([*got, *g_got], [*want, *g_want]):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # n = 2 static, then n dynamic
    lowered = {name for rec in dr.backend._RECORDS for name in rec.decomposed}
    if backend == "triton":  # the kernels run (the interpreter): forward and backward stay opaque
        assert not lowered, lowered
    else:  # the op and its backward (MoDA's: moda_attn_backward) traced as references
        assert case in lowered and any(x.endswith("_backward") for x in lowered), lowered


def test_ops_stay_opaque_where_a_triton_kernel_runs_or_when_switched_off():
    op, inputs = CASES["depth_attn"]
    want, g_want = _run(op, _leaves(inputs))
    with kernel_backend("triton"):  # the interpreter (tests/conftest.py): the kernel runs, so nothing is lowered
        compiled = torch.compile(lambda *a: op(*a), backend="depthrewrite", options={"inner": "aot_eager"})
        got, g_got = _run(compiled, _leaves(inputs))
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    rec = dr.backend._RECORDS[-1]
    assert not rec.decomposed
    stages = {a.stage: a.depth_ops for a in rec.aot}
    assert stages["forward"]["depth_attn"] == 1 and stages["backward"]["depth_attn_backward"] == 1
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: op(*a), backend="depthrewrite", options={"inner": "aot_eager", "decompose": False})
    _run(compiled, _leaves(inputs))
    rec = dr.backend._RECORDS[-1]
    assert not rec.decomposed and rec.aot[0].depth_ops["depth_attn"] == 1


def test_moda_with_attention_dropout_stays_opaque():
    op, inputs = CASES["moda_attn"]
    inputs = list(inputs)
    inputs[9], inputs[10] = 0.2, torch.tensor([7])
    compiled = torch.compile(lambda *a: op(*a), backend="depthrewrite", options={"inner": "aot_eager"})
    got, _ = _run(compiled, _leaves(inputs))
    want, _ = _run(op, _leaves(inputs))
    torch.testing.assert_close(got[0], want[0])  # the same seeded masks
    rec = dr.backend._RECORDS[-1]
    assert "moda_attn" not in rec.decomposed and rec.aot[0].depth_ops["moda_attn"] == 1


@pytest.mark.parametrize("scheme,options", [("attnres", {"blocks": 2}), ("msar", {}), ("mhc", {}), ("moda", {})])
def test_exported_graphs_keep_one_node_per_site(scheme, options):
    torch.manual_seed(0)
    model = hf_model("llama", layers=2, hidden=32).eval()
    ids = torch.randint(3, 100, (1, 8))
    conv = dr.convert(model, scheme, example_inputs=(ids,), **options)
    flat = conv.graph_module()

    def ops(graph):
        return sorted(str(n.target) for n in graph.nodes if n.op == "call_function" and str(n.target).startswith("depthrewrite."))

    want = ops(flat.graph)
    got = ops(torch.export.export(conv, (ids,)).graph)
    assert got and got == want


def test_decomposed_moda_backward_reuses_the_forward_flash_attention():
    """The backward's recomputation of the sequence part reuses the forward's flash call in the joint trace (the
    flash op is tagged nondeterministic, so CSE alone would leave two): one flash forward per training step."""
    op, inputs = CASES["moda_attn"]
    compiled = torch.compile(lambda *a: op(*a), backend="depthrewrite", options={"inner": "aot_eager"})
    got, g_got = _run(compiled, _leaves(inputs))  # compiles (traced once)
    with torch.profiler.profile() as prof:
        _run(compiled, _leaves(inputs))
    names = [e.name for e in prof.events()]
    assert names.count("aten::_scaled_dot_product_flash_attention_for_cpu") == 1
    assert names.count("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == 1
    want, g_want = _run(op, _leaves(inputs))
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_probing_in_one_thread_leaves_other_threads_calls_alone():
    """would_fuse() makes route() answer by raising, in its own thread only: an eager call elsewhere still runs."""
    import threading

    from depthrewrite.kernels.dispatch import would_fuse

    inside, release, answer = threading.Event(), threading.Event(), []

    def body():
        inside.set()
        release.wait(10)
        from depthrewrite.kernels.dispatch import route

        route("depthrewrite::probe", (torch.zeros(1),), lambda: None)

    t = threading.Thread(target=lambda: answer.append(would_fuse(body)))
    t.start()
    assert inside.wait(10)
    op, inputs = CASES["depth_attn"]
    out = op(*inputs)  # routes while the other thread is probing
    release.set()
    t.join(10)
    assert out.shape == inputs[0][0].shape and answer == [False]  # CPU tensors: the reference would run
