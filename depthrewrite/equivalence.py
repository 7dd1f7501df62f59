"""Is a conversion the same function as the original, and the way back.

:func:`check_equivalence` runs a converted model and the original on the same inputs and compares every tensor of
their outputs (what every example used to compute by hand); :func:`unconvert` gives a converted model its original
class back, without the depth mixing.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from .errors import ConfigError

__all__ = ["Equivalence", "check_equivalence", "unconvert"]

#: default tolerance per output dtype (the contract tests' own)
_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@dataclasses.dataclass(frozen=True)
class Equivalence:
    """The result of :func:`check_equivalence`: truthy when every output tensor matched within ``tol``."""

    same: bool
    max_abs: float
    max_rel: float
    tol: float
    tensors: int

    def __bool__(self) -> bool:
        return self.same

    def __str__(self) -> str:
        verdict = "the same function" if self.same else "NOT the same function"
        return (f"{verdict} on these inputs: {self.tensors} output tensor(s), max |diff| {self.max_abs:.3g}, "
                f"max relative {self.max_rel:.3g} (tolerance {self.tol:g})")


def _leaves(out: Any) -> list[torch.Tensor]:
    """The floating-point output tensors, KV caches left out (a converted MSAR's cache also holds its conv history)."""
    from .capture import is_cache

    if hasattr(out, "to_tuple"):  # transformers' ModelOutput
        out = out.to_tuple()
    leaves = pytree.tree_leaves(out, is_leaf=is_cache)
    return [x for x in leaves if isinstance(x, torch.Tensor) and x.is_floating_point()]


def check_equivalence(converted: nn.Module, original: nn.Module, *args: Any, tol: float | None = None,
                      **kwargs: Any) -> Equivalence:
    """Run ``converted`` and ``original`` on ``(*args, **kwargs)`` in eval mode without gradients (their modes are put
    back after) and compare every floating-point tensor of their outputs: ``|a - b| <= tol * max(1, |b|)``.

    Args:
        converted: the converted model (``depthrewrite.convert(model, ..., inplace=False)``).
        original: the model it was converted from, unchanged.
        tol: the tolerance; default by the outputs' dtype (1e-5 for float32, 2e-2 for bfloat16).

    Raises:
        ConfigError: the two outputs have different structures or shapes.
    """
    if converted is original:
        raise ConfigError("check_equivalence: converted and original are one object (convert(..., inplace=False) "
                          "keeps the original to compare with)")
    modes = (converted.training, original.training)
    try:
        converted.eval()
        original.eval()
        with torch.no_grad():  # each model gets its own copy of the inputs (a KV cache is extended in place)
            a = _leaves(converted(*copy.deepcopy(args), **copy.deepcopy(kwargs)))
            b = _leaves(original(*copy.deepcopy(args), **copy.deepcopy(kwargs)))
    finally:
        converted.train(modes[0])
        original.train(modes[1])
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        raise ConfigError(
            f"check_equivalence: the outputs differ in structure ({len(a)} vs {len(b)} tensors, shapes "
            f"{[tuple(x.shape) for x in a][:3]} vs {[tuple(y.shape) for y in b][:3]})"
        )
    if tol is None:
        tol = max((_TOL.get(x.dtype, 1e-5) for x in a), default=1e-5)
    max_abs = max_rel = 0.0
    same = True
    for x, y in zip(a, b):
        d = (x.double() - y.double()).abs()
        scale = y.double().abs().clamp_min(1.0)
        if d.numel():  # NaN-aware: a NaN difference is reported as NaN, never as 0
            m, r = float(d.max()), float((d / scale).max())
            max_abs = m if m != m or max_abs != max_abs else max(max_abs, m)
            max_rel = r if r != r or max_rel != max_rel else max(max_rel, r)
        same = same and bool(((d <= tol * scale) | (torch.isnan(x) & torch.isnan(y))).all())
    return Equivalence(same=same, max_abs=max_abs, max_rel=max_rel, tol=tol, tensors=len(a))


def unconvert(model: nn.Module) -> nn.Module:
    """Give a converted model its original class back, in place, and return it: its own forward runs again, the
    new ``depthrewrite.*`` parameters and the captured graphs are removed, its blocks are their own classes again.
    The depth mixing is gone with them (a trained conversion is not the original function any more: this is the way
    back to the architecture, not to what the conversion learnt).

    Raises:
        ConfigError: ``model`` is not a converted model.
    """
    from .blocks import restore_blocks
    from .runtime.handle import is_converted, state_of
    from .passes.rewrite.editor import PARAM_PREFIX

    if not is_converted(model):
        raise ConfigError(f"unconvert: this {type(model).__name__} is not a model converted by depthrewrite.convert()")
    st = state_of(model)
    from .passes.lower.module_calls import is_fsdp

    if any(is_fsdp(m) for m in model.modules()):
        raise ConfigError("unconvert: the model is sharded with FSDP; unconvert before fully_shard (the FSDP classes "
                          "would be dropped)")
    own = model.__dict__.get("_old_forward")
    model.__class__ = st.original
    model.__dict__.pop("_depthrewrite", None)
    model._modules.pop(PARAM_PREFIX, None)
    restore_blocks(model)
    if own is not None:  # accelerate's hook: its _old_forward is the original forward again
        import types

        model.__dict__["_old_forward"] = types.MethodType(st.original.forward, model)
    return model
