"""Helpers shared by the Triton kernel tests (test_mhc_triton.py, test_msar_triton.py)."""

from __future__ import annotations

import types

import pytest
import torch


def close(got, want, tol) -> None:
    """Pairwise: same dtype and shape, and close with ``atol`` scaled by ``max(1, max|want|)``.

    ``tol`` is ``(atol, rtol)``."""
    atol, rtol = tol
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), atol=atol * max(1.0, b.abs().max().item()), rtol=rtol)


def spy_calls(monkeypatch: pytest.MonkeyPatch, module: types.ModuleType, names) -> list[str]:
    """Wraps the launchers ``module.<name>`` so that each call appends its name to the returned list (to tell the
    kernel path from the reference fallback)."""
    seen: list[str] = []
    for name in names:
        orig = getattr(module, name)

        def spy(*a, _orig=orig, _name=name, **k):
            seen.append(_name)
            return _orig(*a, **k)

        monkeypatch.setattr(module, name, spy)
    return seen
