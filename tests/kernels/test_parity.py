"""One harness: every registered depth op, fused (Triton) == reference, forward and every gradient.

The cases are the rows of ``bench/kernel_cases/<op>.py`` at ``scale="test"`` (small shapes built by the same
``call`` builder the benchmark's shapes come from; each row names the axis it stresses), with every input and
parameter random. The op runs under ``kernel_backend("triton")`` (Triton's interpreter on CPU) and
``kernel_backend("reference")`` (half precision: the reference in fp32 on upcast inputs); outputs and gradients are
compared with the one tolerance table :data:`depthrewrite.testing.KERNEL_TOL` (scaled allclose by dtype plus the RMS
ratio). ``torch.empty`` is NaN-poisoned here (tests/kernels/conftest.py), so a kernel that leaves output unwritten fails.
The Triton launches are counted generically (every ``@triton.jit`` function's ``run``) to tell the fused path from
an in-op fallback to the reference.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from depthrewrite.kernels.dispatch import kernel_backend

from ._helpers import assert_matches

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
from bench.kernel_cases import OPS  # noqa: E402

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _rows():
    out = []
    for mod in OPS:
        m = importlib.import_module(f"bench.kernel_cases.{mod}")
        for r in m.rows("test"):
            out.append(pytest.param(m, r, id=r.id))
    return out


@pytest.fixture
def launches(monkeypatch):
    """Counts Triton kernel launches (interpreted or compiled), whatever the kernels are called."""
    import triton.runtime.interpreter as interp
    import triton.runtime.jit as jit

    n = [0]
    for cls in (interp.InterpretedFunction, jit.JITFunction):
        orig = cls.run

        def run(self, *a, _orig=orig, **k):
            n[0] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(cls, "run", run)
    return n


def _grads(call, tensors, fn_mode):
    with kernel_backend(fn_mode):
        out = call.fn(*tensors)
        outs = out if isinstance(out, tuple) else (out,)
        leaves = [t for t in tensors if t.requires_grad]
        grads = [g.to(o.dtype) for g, o in zip(call.grads, outs, strict=True)]
        return outs, leaves, torch.autograd.grad(outs, leaves, grads)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("mod, row", _rows())
def test_fused_matches_reference(mod, row, dtype, launches):
    call = mod.call(row, DEVICE, dtype, seed=len(row.id))
    outs, leaves, got = _grads(call, call.tensors, "triton")
    assert launches[0] > 0, f"{row.id}: no Triton kernel ran (the op fell back to its reference)"
    # the reference: same values, in fp32 for half-precision inputs
    up = [t.detach().float().requires_grad_(t.requires_grad) if t.is_floating_point() else t for t in call.tensors]
    want_outs, _, want = _grads(call, up, "reference")
    for i, (a, b) in enumerate(zip(outs, want_outs, strict=True)):
        assert a.dtype == dtype or a.dtype == torch.float32, (i, a.dtype)
        assert_matches(f"{row.id} out[{i}]", a, b, dtype, "fwd")
    for i, (x, a, b) in enumerate(zip(leaves, got, want, strict=True)):
        assert a.dtype == x.dtype and a.shape == x.shape, (i, a.dtype, x.dtype)
        assert_matches(f"{row.id} grad[{i}]", a, b, dtype, "grad")


def test_empty_is_nan_poisoned():
    """The conftest's poisoning is on here: fresh floating buffers read as NaN, integer ones are left alone."""
    import torch as t

    assert t.isnan(t.empty(3, 2)).all() and t.isnan(t.empty_like(t.zeros(4, dtype=t.float16))).all()
    assert t.empty(2, dtype=t.int64).dtype == t.int64
    assert t.isnan(t.zeros(2).new_empty(3)).all() and t.isnan(t.empty_strided((2, 2), (2, 1))).all()


def test_an_unwritten_output_fails_the_harness(monkeypatch):
    """With every kernel launch skipped, the op returns its poisoned buffers untouched and the comparison fails."""
    import triton.runtime.interpreter as interp
    import triton.runtime.jit as jit

    for cls in (interp.InterpretedFunction, jit.JITFunction):
        monkeypatch.setattr(cls, "run", lambda self, *a, **k: None)
    mod = importlib.import_module("bench.kernel_cases.depth_attn")
    call = mod.call(mod.rows("test")[1], DEVICE, torch.float32)
    with kernel_backend("triton"):
        got = call.fn(*call.tensors)
    with kernel_backend("reference"):
        want = call.fn(*call.tensors)
    with pytest.raises(AssertionError, match="non-finite"):
        assert_matches("out", got, want, torch.float32)
