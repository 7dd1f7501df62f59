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
