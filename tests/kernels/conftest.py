"""Kernel-test fixtures: ``torch.empty`` / ``torch.empty_like`` (and ``torch.empty_strided``, ``Tensor.new_empty``)
poisoned with NaN.

Every launcher allocates its outputs and scratch buffers with ``torch.empty(...)`` / ``torch.empty_like(...)``; on a
fresh allocation those often happen to hold zeros, which hides a kernel that leaves part of an output unwritten or reads
a buffer before writing it. During the kernel tests these functions (as seen by every module: they are looked up on
``torch`` at call time) return floating tensors filled with NaN, so such a kernel fails its comparison. Integer and bool
tensors are left as allocated. Opt out for one test with ``@pytest.mark.no_nan_poison``.
"""

from __future__ import annotations

import functools

import pytest
import torch


def _poisoned(alloc):
    @functools.wraps(alloc)
    def wrapper(*args, **kwargs):
        t = alloc(*args, **kwargs)
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            with torch.no_grad():
                t.fill_(float("nan"))
        return t

    wrapper.__nan_poisoned__ = True
    return wrapper


def pytest_configure(config):
    config.addinivalue_line("markers", "no_nan_poison: run without the NaN-filled torch.empty of tests/kernels")


@pytest.fixture(autouse=True)
def _nan_poison(request, monkeypatch):
    if request.node.get_closest_marker("no_nan_poison") is None:
        monkeypatch.setattr(torch, "empty", _poisoned(torch.empty))
        monkeypatch.setattr(torch, "empty_like", _poisoned(torch.empty_like))
        monkeypatch.setattr(torch, "empty_strided", _poisoned(torch.empty_strided))
        monkeypatch.setattr(torch.Tensor, "new_empty", _poisoned(torch.Tensor.new_empty))
    yield
