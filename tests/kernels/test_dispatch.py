"""depthrewrite.kernels.dispatch: which implementation a depth op runs (decide / use_triton), the auto backend's
device check (NVIDIA sm_80+, no ROCm), and the shared dtype check of the kernels. Runs on CPU: the CUDA side is faked
by monkeypatching ``torch.cuda.get_device_capability``, ``torch.version.hip`` and tensor-like stand-ins."""

from __future__ import annotations

import types

import pytest
import torch

from depthrewrite.errors import KernelError
from depthrewrite.kernels import dispatch
from depthrewrite.kernels.dispatch import decide, kernel_backend, kernel_dtypes_ok, triton_supported_device, use_triton


@pytest.fixture
def fake_gpu(monkeypatch):
    """A fake CUDA device 0 whose capability and vendor the test sets: ``fake_gpu(cap, hip=None)``."""
    calls = []

    def setup(cap, hip=None):
        def capability(index):
            calls.append(index)
            return cap

        dispatch._capability.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(dispatch, "triton_available", lambda: True)
        return calls

    yield setup
    dispatch._capability.cache_clear()


def _cuda_like(index=0):
    """What decide() reads of a tensor: ``is_cuda`` and ``device``."""
    return types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", index))


@pytest.mark.parametrize(
    "cap, hip, want",
    [((8, 0), None, True), ((9, 0), None, True), ((12, 1), None, True), ((7, 5), None, False),
     ((6, 1), None, False), ((9, 4), "6.2.0", False)],  # fmt: skip
)
def test_supported_device_needs_nvidia_sm80(fake_gpu, cap, hip, want):
    fake_gpu(cap, hip)
    assert triton_supported_device(0) is want
    assert triton_supported_device(torch.device("cuda", 0)) is want
    assert triton_supported_device("cuda:0") is want


def test_capability_is_cached_per_device_index(fake_gpu):
    calls = fake_gpu((8, 6))
    for _ in range(3):
        assert triton_supported_device(0) and triton_supported_device(1)
    assert sorted(calls) == [0, 1]


def test_cpu_is_never_a_supported_device(fake_gpu):
    calls = fake_gpu((9, 0))
    assert not triton_supported_device(torch.device("cpu"))
    assert not triton_supported_device(torch.zeros(1))
    assert calls == []


@pytest.mark.parametrize("cap, hip, want", [((8, 0), None, "triton"), ((7, 0), None, "reference"),
                                            ((9, 0), "6.0", "reference")])  # fmt: skip
def test_auto_runs_triton_only_on_supported_gpus(fake_gpu, cap, hip, want):
    fake_gpu(cap, hip)
    t = _cuda_like()
    with kernel_backend("auto"):
        assert decide("op", t, None, t) == want
        assert use_triton(t, None, op="op") is (want == "triton")
    with kernel_backend("triton"):  # forced: no capability check
        assert decide("op", t) == "triton"
    with kernel_backend("reference"):
        assert decide("op", t) == "reference"


def test_decide_on_cpu(monkeypatch):
    x = torch.zeros(2)
    with kernel_backend("auto"):
        assert decide("op", x) == "reference" and not use_triton(x, op="op")
        assert decide("op") == "reference"  # no tensors
    with kernel_backend("reference"):
        assert decide("op", x) == "reference"
    with kernel_backend("triton"):
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert decide("op", x) == "triton-interpreter" and use_triton(x, op="op")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(KernelError, match="my::op.*TRITON_INTERPRET"):
            decide("my::op", x)
        with pytest.raises(KernelError, match="my::op"):
            use_triton(x, op="my::op")


def test_kernel_dtypes_ok():
    f32, f16, bf16 = (torch.zeros(1, dtype=dt) for dt in (torch.float32, torch.float16, torch.bfloat16))
    assert kernel_dtypes_ok(f32, f16, None) and kernel_dtypes_ok()
    assert not kernel_dtypes_ok(f32, torch.zeros(1, dtype=torch.float64))
    assert not kernel_dtypes_ok(torch.zeros(1, dtype=torch.int64))
    assert not kernel_dtypes_ok(f32, bf16)  # bf16 on CPU: Triton's interpreter has no bf16
    fake_bf16_cuda = types.SimpleNamespace(dtype=torch.bfloat16, is_cuda=True)
    assert kernel_dtypes_ok(fake_bf16_cuda, f32)


# ---- each op's gate covers(...) -> None | reason, and the routing that uses it ------------------------------------------


def _moda_args(d=8, dropout=0.0, dtype=torch.float32):
    q = torch.randn(1, 2, 3, d, dtype=dtype)
    k = torch.randn(1, 1, 4, d, dtype=dtype)
    dk = torch.randn(1, 3, 2, 1, d, dtype=dtype)
    return (q, k, k.clone(), None, dk, dk.clone(), None, dropout)


def _msar_args(K=2, m=2, dtype=torch.float32):
    return ([torch.randn(1, 5, 4, dtype=dtype) for _ in range(K)], torch.randn(m, 4), [torch.randn(4, 3)] * (m - 1))


def test_covers_returns_a_reason_for_each_uncovered_call():
    from depthrewrite.kernels.depth_attn.limits import MAX_ROW, covers as da_covers, covers_merge
    from depthrewrite.kernels.mhc.limits import MAX_STREAMS, covers as mhc_covers
    from depthrewrite.kernels.moda.limits import MAX_HEAD_DIM, covers as moda_covers
    from depthrewrite.kernels.msar.limits import MAX_KERNEL, MAX_SOURCES, covers as msar_covers

    f32, f64 = torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.float64)
    q = torch.zeros(8)
    # depth_attn
    assert da_covers([f32, f32], q, q, whole_row=True) is None
    assert "float64" in da_covers([f64, f64], q, q)
    assert "different dtypes" in da_covers([f32, f32.half()], q, q)
    wide = torch.zeros(1, MAX_ROW + 1)
    assert "MAX_ROW" in da_covers([wide], torch.zeros(MAX_ROW + 1), torch.zeros(MAX_ROW + 1), whole_row=True)
    assert da_covers([wide], torch.zeros(MAX_ROW + 1), torch.zeros(MAX_ROW + 1)) is None  # D-chunked kernels
    assert covers_merge(f32, torch.zeros(2), f32, q, q) is None
    assert "fp32" in covers_merge(f32.half(), torch.zeros(2), f32, q, q)
    # msar
    assert msar_covers(*_msar_args()) is None
    assert f"MAX_SOURCES={MAX_SOURCES}" in msar_covers(*_msar_args(K=MAX_SOURCES + 1))
    assert "MAX_STREAMS" in msar_covers(*_msar_args(m=5))
    src, query, _ = _msar_args()
    assert "MAX_KERNEL" in msar_covers(src, query, [torch.randn(4, MAX_KERNEL + 1)])
    assert "float64" in msar_covers(*_msar_args(dtype=torch.float64))
    # mhc
    X = torch.zeros(3, 4, 8)
    assert mhc_covers(X, torch.zeros(3, 4)) is None
    assert f"MAX_STREAMS={MAX_STREAMS}" in mhc_covers(torch.zeros(3, MAX_STREAMS + 1, 8))
    assert "empty" in mhc_covers(X, torch.zeros(0))
    assert "float64" in mhc_covers(X.double())
    # moda
    assert moda_covers(*_moda_args()) is None
    assert "dropout" in moda_covers(*_moda_args(dropout=0.1))
    assert f"MAX_HEAD_DIM={MAX_HEAD_DIM}" in moda_covers(*_moda_args(d=MAX_HEAD_DIM + 8))
    assert "float64" in moda_covers(*_moda_args(dtype=torch.float64))
    bf16 = moda_covers(*_moda_args(dtype=torch.bfloat16))
    assert "bf16" in bf16 and "interpreter" in bf16


def _op_calls():
    """(op package, fused launcher, registered op name, a call of the op) per op: small fp32 CPU inputs."""
    from depthrewrite.kernels.depth_attn import depth_attn
    from depthrewrite.kernels.mhc import mhc_pre
    from depthrewrite.kernels.moda import moda_attn
    from depthrewrite.kernels.msar import msar_mix

    src = [torch.randn(3, 8) for _ in range(2)]
    src_m, query, conv = _msar_args()
    q, k, v, mask, dk, dv, lam, _ = _moda_args()
    return [
        ("depth_attn", "depth_attn_fwd", "depthrewrite::depth_attn",
         lambda: depth_attn(src, torch.randn(8), torch.ones(8), 1e-6, 1.0)),
        ("msar", "msar_fwd", "depthrewrite::msar_mix",
         lambda: msar_mix(src_m, query, torch.ones_like(query), conv, None, None, None, 1e-6, 1.0, True, False)),
        ("mhc", "mhc_pre_fwd", "depthrewrite::mhc_pre",
         lambda: mhc_pre(torch.randn(3, 4, 8), torch.rand(3, 4))),
        ("moda", "moda_attn_fwd", "depthrewrite::moda_attn",
         lambda: moda_attn(q, k, v, mask, dk, dv, lam, 0.5, False, 0.0, None, 0.0)),
    ]  # fmt: skip


CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through Triton's interpreter: on a CUDA "
                             "machine the kernels are compiled (the native route is what the other kernel tests run)")


@CPU_ONLY
@pytest.mark.parametrize("index", range(4), ids=["depth_attn", "msar", "mhc", "moda"])
def test_routing_uses_the_gate_and_records_the_reason(monkeypatch, index):
    import importlib

    from ._helpers import spy_calls

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pkg, launcher, op, call = _op_calls()[index]
    op_mod = importlib.import_module(f"depthrewrite.kernels.{pkg}.op")
    fused = importlib.import_module(f"depthrewrite.kernels.{pkg}.fused")
    calls = spy_calls(monkeypatch, fused, [launcher])
    with kernel_backend("triton"):
        call()  # covered: the kernel runs
        assert calls == [launcher]
        assert dispatch.last_routes()[op] == dispatch.Route("triton-interpreter", None)
        monkeypatch.setattr(op_mod, "covers", lambda *a, **k: "a test says no")
        call()  # the gate's reason sends it to the reference
        assert calls == [launcher]
        assert dispatch.last_routes()[op] == dispatch.Route("reference", "a test says no")
    with kernel_backend("reference"):
        call()
        assert dispatch.last_routes()[op] == dispatch.Route("reference", "kernel backend 'reference'")
    assert calls == [launcher]


@CPU_ONLY
def test_explain_prints_why_the_last_call_fell_back():
    from collections import Counter

    from depthrewrite.kernels.depth_attn import depth_attn
    from depthrewrite.views.explain import Explanation

    src = [torch.randn(3, 8, dtype=torch.float64) for _ in range(2)]
    with kernel_backend("triton"):
        depth_attn(src, torch.randn(8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-6, 1.0)
    exp = Explanation(model="m", compiled=False, device="cpu", static_ops=Counter({"depth_attn": 1}))
    assert exp.routes() == {"depth_attn": "reference: float64 sources (the kernels take fp32/bf16/fp16)"}
    assert "depth_attn  reference: float64 sources" in str(exp)
    assert exp.to_dict()["last_calls"] == exp.routes()
