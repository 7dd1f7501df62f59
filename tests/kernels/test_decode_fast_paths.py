"""Fast paths of a no-grad eager call at a decoding step: MSAR's streams computed at once (kernels/msar/reference.py)
and the depth ops' bodies called directly by a block program (kernels/direct.py). Each gives what the general path
gives; a gradient, a mode or a subclass keeps the general path."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from depthrewrite.kernels import direct
from depthrewrite.kernels.msar import reference as msar_ref


def _msar_args(K, m, D, lead, T, ks, dtype, left, g):
    sources = [torch.randn(*lead, T, D, generator=g, dtype=dtype) for _ in range(K)]
    query = torch.randn(m, D, generator=g, dtype=dtype)
    gain = torch.rand(m, D, generator=g, dtype=dtype) + 0.5
    conv = [torch.randn(D, k, generator=g, dtype=dtype) * 0.3 for k in ks]
    phi = torch.randn(m * D, m, generator=g, dtype=dtype) * 0.2
    bias, alpha = torch.randn(m, generator=g, dtype=dtype), torch.tensor(0.7, dtype=dtype)
    lefts = [torch.randn(*lead, max(ks) - 1, D, generator=g, dtype=dtype) for _ in range(K)] if left else None
    return sources, query, gain, conv, phi, bias, alpha, lefts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("left", [False, True])
@pytest.mark.parametrize("conv_values,sigmoid", [(True, True), (False, True), (True, False)])
def test_msar_streams_at_once_equal_the_loop_over_streams(monkeypatch, dtype, left, conv_values, sigmoid):
    g = torch.Generator().manual_seed(3)
    for K, lead, T, ks in [(3, (1,), 1, (4, 8, 12)), (5, (2,), 3, (2, 2, 5)), (2, (1, 2), 1, (3,))]:
        m = len(ks) + 1
        s, q, gain, conv, phi, bias, alpha, lefts = _msar_args(K, m, 16, lead, T, ks, dtype, left, g)
        args = (s, q, gain, conv, phi, bias, alpha, 1e-6, float(K), conv_values, sigmoid)
        with torch.no_grad():
            fast = msar_ref.msar_mix_ref(*args, left=lefts)
            monkeypatch.setattr(msar_ref, "_SMALL_MIX", 0)
            loop = msar_ref.msar_mix_ref(*args, left=lefts)
            monkeypatch.undo()
        assert fast.shape == loop.shape and fast.dtype == loop.dtype and fast._base is None
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(fast, loop, **tol)


def test_msar_takes_the_loop_with_gradients_or_a_long_sequence(monkeypatch):
    calls = []
    real = msar_ref._streams_at_once
    monkeypatch.setattr(msar_ref, "_streams_at_once", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(0)
    s, q, gain, conv, phi, bias, alpha, _ = _msar_args(3, 4, 16, (1,), 1, (4, 8, 12), torch.float32, False, g)
    args = (s, q, gain, conv, phi, bias, alpha, 1e-6, 3.0, True, True)
    msar_ref.msar_mix_ref(*args)
    assert not calls  # grad mode on: the loop (whose graph the backward recomputes)
    with torch.no_grad():  # the registered op's forward in a training step: grad mode off, sources requiring grad
        msar_ref.msar_mix_ref([x.detach().requires_grad_() for x in s], *args[1:])
    assert not calls
    with torch.no_grad():
        msar_ref.msar_mix_ref(*args)
        assert calls
        calls.clear()
        long = [torch.randn(1, msar_ref._SMALL_MIX, 16, generator=g) for _ in range(3)]
        msar_ref.msar_mix_ref(long, *args[1:])
        assert not calls


class _Seen(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_plain_eager_only_without_gradients_modes_or_compilers():
    assert not direct.plain_eager()  # gradients on
    with torch.no_grad():
        assert direct.plain_eager()
        with FlopCounterMode(display=False):
            assert not direct.plain_eager()
        with _Seen():
            assert not direct.plain_eager()
        with torch.autograd.forward_ad.dual_level():
            assert not direct.plain_eager()
    with torch.inference_mode():
        assert direct.plain_eager()


def test_a_direct_program_calls_the_body_for_plain_tensors_and_the_op_otherwise(monkeypatch):
    import torch.fx as fx

    from depthrewrite.kernels.depth_attn import op as da_op

    g = fx.Graph()
    xs = [g.placeholder(f"x{i}") for i in range(3)]
    q, gain = g.placeholder("q"), g.placeholder("g")
    g.output(g.call_function(torch.ops.depthrewrite.depth_attn.default, (xs, q, gain, 1e-6, 3.0)))
    gm = fx.GraphModule(torch.nn.Module(), g)
    fn = direct.direct_forward(gm)
    assert fn is not None
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(1, 1, 8, generator=gen) for _ in range(3)] + [torch.randn(8, generator=gen),
                                                                       torch.nn.Parameter(torch.rand(8, generator=gen))]
    seen = _OpsSeen()
    with torch.no_grad():
        want = gm(*args)
        with seen:
            got = fn(gm, *args)  # a Parameter is a plain tensor: the body, no op call
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert "depthrewrite.depth_attn.default" not in seen.ops and seen.ops  # the body's aten ops, no op call
    sub = [torch.Tensor._make_subclass(_Sub, a) for a in args[:3]] + args[3:]
    with torch.no_grad(), _OpsSeen() as seen:
        fn(gm, *sub)  # a subclass: the op
    assert "depthrewrite.depth_attn.default" in seen.ops


class _Sub(torch.Tensor):
    pass


class _OpsSeen(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.filterwarnings("ignore::depthrewrite.NotFunctionPreservingWarning")
def test_a_converted_model_decodes_the_same_bits_with_the_bodies_called_directly():
    import depthrewrite as dr
    from depthrewrite.demo.zoo import hf_model

    torch.manual_seed(0)
    base = hf_model("llama", layers=2, hidden=64).eval()
    ids = torch.randint(3, base.config.vocab_size, (1, 6))
    for scheme in ("block-attnres", "msar", "mhc"):
        model = dr.convert(base, scheme, inplace=False)
        for p in model.depthrewrite.parameters():  # trained-looking depth parameters
            torch.nn.init.normal_(p, std=0.3)
        outs = []
        for on in (True, False):
            direct.ENABLED = on
            try:
                with torch.no_grad():
                    outs.append(model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0,
                                               output_logits=True, return_dict_in_generate=True))
            finally:
                direct.ENABLED = True
        assert torch.equal(outs[0].sequences, outs[1].sequences), scheme
        assert all(torch.equal(a, b) for a, b in zip(outs[0].logits, outs[1].logits)), scheme  # the same body runs
        with torch.no_grad(), _OpsSeen() as seen:  # a dispatch mode watching: the ops are called (and seen)
            model(ids)
        assert any(op.startswith("depthrewrite.") for op in seen.ops), scheme


def test_a_graph_without_depth_ops_has_no_direct_forward():
    import torch.fx as fx

    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.ops.aten.relu.default, (x,)))
    assert direct.direct_forward(fx.GraphModule(torch.nn.Module(), g)) is None


@pytest.mark.parametrize("K,lead,scale", [(1, (1, 1), 1.0), (5, (1, 1), 5.0), (3, (2, 3), 1.0), (7, (4,), 7.0)])
def test_depth_attn_on_rows_equals_the_reference(K, lead, scale):
    """The small no-grad path (``depth_attn_rows``: the keys' RMSNorm with its gain as one op, one vector-matrix
    product per token) computes the reference's mix, to rounding; through the registered ops too."""
    from depthrewrite.kernels.depth_attn.reference import depth_attn_ref, depth_attn_rows

    g = torch.Generator().manual_seed(K)
    D = 32
    sources = [torch.randn(*lead, D, generator=g) for _ in range(K)]
    query, gain = torch.randn(D, generator=g), torch.rand(D, generator=g) + 0.5
    ref = depth_attn_ref(sources, query, gain, 1e-6, scale)
    rows = depth_attn_rows(torch.stack(sources), query, gain, 1e-6, scale, sources[0].shape)
    assert rows.shape == ref.shape and rows._base is None
    torch.testing.assert_close(rows, ref, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        ops = torch.ops.depthrewrite
        torch.testing.assert_close(ops.depth_attn(sources, query, gain, 1e-6, scale), ref, rtol=1e-5, atol=1e-6)
        stacked = ops.depth_attn_stack(torch.stack(sources)[: K - 1], sources[-1:], query, gain, 1e-6, scale, False)
        torch.testing.assert_close(stacked, ref, rtol=1e-5, atol=1e-6)


def test_depth_attn_takes_the_rows_path_only_for_a_small_no_grad_call(monkeypatch):
    from depthrewrite.kernels.depth_attn import op as da_op

    calls = []
    real = da_op.depth_attn_rows
    monkeypatch.setattr(da_op, "depth_attn_rows", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(0)
    sources = [torch.randn(1, 1, 16, generator=g) for _ in range(3)]
    query, gain = torch.randn(16, generator=g).requires_grad_(), torch.ones(16).requires_grad_()
    args = (query, gain, 1e-6, 3.0)
    torch.ops.depthrewrite.depth_attn([s.clone().requires_grad_() for s in sources], *args).sum().backward()
    assert not calls  # a training step (the op's forward runs with gradients off, on sources requiring them)
    with torch.no_grad():
        torch.ops.depthrewrite.depth_attn([s.clone().requires_grad_() for s in sources], *args)
        assert not calls
        torch.ops.depthrewrite.depth_attn([torch.randn(4, 64, 16) for _ in range(20)], *args)  # 20480 elements
        assert not calls
        torch.ops.depthrewrite.depth_attn(sources, *args)  # a decoding step (parameters still require grad)
        assert calls == [1]
        torch.ops.depthrewrite.depth_attn([s.double() for s in sources], query.double(), gain.double(), 1e-6, 3.0)
        assert calls == [1]  # fp32 only


def test_depth_attn_on_rows_returns_the_sources_dtype_under_autocast():
    """As the reference: under a bfloat16 autocast its products are bfloat16, the mix it returns is the sources'."""
    sources = [torch.randn(1, 1, 16) for _ in range(3)]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.ops.depthrewrite.depth_attn(sources, torch.randn(16), torch.ones(16), 1e-6, 3.0)
    assert out.dtype == torch.float32
