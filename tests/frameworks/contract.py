"""The checks every framework test module runs on its models: for every registered scheme with its exact-at-init
options (``Scheme.exact``, and ``blocks=2`` where the scheme has a block form), ``convert(..., inplace=False)`` gives
the original's logits at init, and one training step gives finite gradients on the new parameters.

A conversion that depthrewrite refuses with a typed error (a proper subclass of :class:`DepthRewriteError`:
``NotPreNormError``, ``AttentionPatternError``, ...) is an expected refusal: the test xfails with its message. A bare
``DepthRewriteError`` (what ``convert`` wraps an internal crash in: "This is a bug in depthrewrite"), any other
exception, or logits that differ are failures.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import depthrewrite as dr
from depthrewrite.errors import DepthRewriteError

from ..passes.rewrite.helpers import INIT_RTOL, logits, rel_err
from .models import build

__all__ = ["SCHEMES", "check_init", "check_training_step"]


def _scheme_cases():
    """(scheme, options, init tolerance) from the registry, as tests/passes/rewrite/test_contract.py enumerates them."""
    for s in dr.schemes().values():
        tol = next((v.init_tol for v in s.variants if v.options == {} and v.init_tol is not None and not s.exact),
                   INIT_RTOL)
        yield pytest.param(s.name, dict(s.exact), tol, id=s.name if not s.exact else f"{s.name}-exact")
        if s.block_form:
            yield pytest.param(s.name, {**s.exact, "blocks": 2}, tol, id=f"{s.name}-block2")


#: (scheme, options, tolerance at init) for every registered scheme
SCHEMES = list(_scheme_cases())


@functools.lru_cache(maxsize=None)
def _original(framework: str, name: str):
    """The model, in train mode: the conversions capture their first graph in the model's mode, so converting a
    training model lets the init check and the training step share one graph (these tiny models have no dropout, so
    train and eval logits are the same; :func:`check_init` compares eval mode too for the first scheme)."""
    model, args, kwargs = build(framework, name)
    dropout = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    assert not dropout, f"{framework}:{name} has dropout in {dropout}: train-mode logits would be random"
    return model.train(), args, kwargs


def _key(options: dict) -> tuple:
    return tuple(sorted(options.items()))


@functools.lru_cache(maxsize=None)
def _converted(framework: str, name: str, scheme: str, options: tuple) -> Any:
    """The converted copy (train mode), or the exception convert() raised; shared by the init and training tests."""
    model, args, kwargs = _original(framework, name)
    try:
        return dr.convert(model, scheme, example_inputs=args, example_kwargs=kwargs, inplace=False,
                          **dict(options))
    except Exception as e:  # noqa: BLE001 - kept and re-raised by the test that asks
        return e


def _refused(e: BaseException, what: str) -> None:
    """xfail for a typed refusal; re-raise anything else (a bug: the test fails with its traceback)."""
    if isinstance(e, DepthRewriteError) and type(e) is not DepthRewriteError:
        pytest.xfail(f"{what}: {type(e).__name__}: {e}")
    raise e


def _get(framework: str, name: str, scheme: str, options: dict):
    model, args, kwargs = _original(framework, name)
    conv = _converted(framework, name, scheme, _key(options))
    if isinstance(conv, BaseException):
        _refused(conv, "convert() refuses")
    return model, conv, args, kwargs


def _call(conv, args, kwargs):
    try:
        return logits(conv(*args, **kwargs))
    except DepthRewriteError as e:
        _refused(e, "the converted model refuses the call")


def _compare(framework, name, scheme, options, tol, model, conv, args, kwargs, mode: str) -> None:
    with torch.no_grad():
        ref = logits(model(*args, **kwargs))
        out = _call(conv, args, kwargs)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), f"{mode}: non-finite logits"
    err = rel_err(out, ref)
    assert err <= tol, f"{framework}:{name} {scheme}{options} ({mode}): max|Δ|/max|ref| = {err:.3e} > {tol:.0e} at init"


def check_init(framework: str, name: str, scheme: str, options: dict, tol: float) -> None:
    """The converted copy's logits equal the original's, in train mode (the graph the conversion captured) and, for
    the first scheme of :data:`SCHEMES`, in eval mode too (a second graph)."""
    model, conv, args, kwargs = _get(framework, name, scheme, options)
    _compare(framework, name, scheme, options, tol, model, conv, args, kwargs, "train mode")
    first = SCHEMES[0].values
    if (scheme, options) == (first[0], first[1]):
        try:
            model.eval(), conv.eval()
            _compare(framework, name, scheme, options, tol, model, conv, args, kwargs, "eval mode")
        finally:
            model.train(), conv.train()
    assert any(n.startswith("depthrewrite.") for n, _ in conv.named_parameters()), \
        "the converted model has no new parameters under depthrewrite."


def check_training_step(framework: str, name: str, scheme: str, options: dict) -> None:
    _, conv, (ids, *rest), kwargs = _get(framework, name, scheme, options)
    saved = {k: v.detach().clone() for k, v in conv.state_dict().items()}  # shared with check_init: restored below
    try:
        conv.train()
        conv.zero_grad(set_to_none=True)
        out = _call(conv, (ids, *rest), kwargs)
        loss = torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), ids[:, 1:].reshape(-1))
        assert torch.isfinite(loss), loss
        loss.backward()
        params = dict(conv.named_parameters())
        new = {n: p for n, p in params.items() if n.startswith("depthrewrite.")}
        assert new, "the converted model has no new parameters under depthrewrite."
        missing = [n for n, p in new.items() if p.requires_grad and p.grad is None]
        assert not missing, f"new parameters without a gradient: {missing}"
        bad = [n for n, p in params.items() if p.grad is not None and not torch.isfinite(p.grad).all()]
        assert not bad, f"non-finite gradients: {bad}"
        assert any(p.grad.abs().sum() > 0 for p in new.values() if p.grad is not None), \
            "every gradient of the new parameters is zero"
        torch.optim.SGD(conv.parameters(), lr=1e-2).step()
        with torch.no_grad():
            assert torch.isfinite(_call(conv, (ids, *rest), kwargs)).all()
    finally:
        conv.zero_grad(set_to_none=True)
        conv.load_state_dict(saved)
        conv.train()
