"""mHC's Sinkhorn on a small CPU call (a decoding step) runs its normalisations in NumPy (kernels/mhc/op.py): the same
float32 operations in the same order as the reference, so the same values; larger calls keep the reference."""

from __future__ import annotations

import pytest
import torch

from depthrewrite.kernels.mhc import op as mhc_op
from depthrewrite.kernels.mhc.reference import mhc_coeffs_ref, sinkhorn


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("iters", [1, 2, 20])
@pytest.mark.parametrize("exact_rows", [False, True])
def test_numpy_sinkhorn_equals_the_reference(dtype, iters, exact_rows):
    g = torch.Generator().manual_seed(iters)
    for shape in [(1, 1, 4, 4), (2, 3, 4, 4), (5, 2, 2)]:
        logits = torch.randn(shape, generator=g, dtype=dtype) * 3
        got = mhc_op._sinkhorn_numpy(logits, iters, 1e-6, exact_rows)
        want = sinkhorn(logits, iters, 1e-6, exact_rows)
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=2e-7 if dtype == torch.float32 else 1e-15, atol=1e-7)


def test_a_decoding_step_takes_the_numpy_path_and_a_batch_does_not(monkeypatch):
    calls = []
    real = mhc_op._sinkhorn_numpy
    monkeypatch.setattr(mhc_op, "_sinkhorn_numpy", lambda *a: calls.append(a[0].shape) or real(*a))
    n, D = 4, 32
    g = torch.Generator().manual_seed(0)
    phi, bias, alpha = torch.randn(n * D, n * n + 2 * n, generator=g) * 0.1, torch.randn(n * n + 2 * n, generator=g), \
        torch.ones(3)
    for tokens, numpy in [(1, True), (mhc_op._NUMPY_SINKHORN_ROWS // n + 1, False)]:
        X = torch.randn(1, tokens, n, D, generator=g)
        calls.clear()
        got = torch.ops.depthrewrite.mhc_coeffs(X, phi, bias, alpha, 20, 1e-6, True)
        want = mhc_coeffs_ref(X, phi, bias, alpha, 20, 1e-6, True)
        assert bool(calls) is numpy
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=2e-7, atol=1e-7)
