"""Helpers shared by the Triton kernel tests (test_mhc_triton.py, test_msar_triton.py, test_parity.py).

The tolerance table and the comparison helpers live in :mod:`depthrewrite.testing` (one place); they are re-exported
here under the names the tests import."""

from __future__ import annotations

import types

import pytest
import torch

from depthrewrite.testing import KERNEL_TOL, Tol, assert_close_rms, assert_matches, close, sqnr  # noqa: F401


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
