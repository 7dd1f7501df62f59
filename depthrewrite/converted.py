"""The converted model: a GraphModule that behaves as a training module.

What the captured graph needs before it can train like the original:

* **train/eval**: export bakes the mode into ``aten.dropout(x, p, train)`` and SDPA's ``dropout_p``. Each dropout
  becomes an ``nn.Dropout`` call and each SDPA with ``dropout_p > 0`` a small module, so ``.train()``/``.eval()``
  switch them (no state-dict keys are added).
* **dtype and device**: export bakes the capture dtype and device into casts, factory ops and metadata asserts. On
  ``.to()`` / ``.half()`` / ``.cuda()`` the graph is retargeted: the asserts are dropped and every dtype argument
  equal to the old parameter dtype (every device argument equal to the old device) follows the parameters. A model
  converted in fp32 and cast to bf16 therefore computes its own norms in bf16; convert in the training dtype to keep
  the model's explicit fp32 upcasts. The depth-mixing ops always compute in fp32.
* **call signature**: positional and keyword calls are bound to the original ``forward`` signature and passed in the
  layout the graph was captured with.
"""

from __future__ import annotations

import inspect as _inspect
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from .errors import ConfigError, DepthRewriteError
from .passes.analyse.ops import op_of

__all__ = ["ConvertedGraphModule", "make_trainable", "as_converted"]

aten = torch.ops.aten


class _SDPA(nn.Module):
    """SDPA whose dropout follows ``self.training``."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=self.p if self.training else 0.0, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )


def make_trainable(gm: fx.GraphModule, prefix: str = "depthrewrite") -> int:
    """Replace baked dropout (``aten.dropout``, SDPA ``dropout_p``) by modules that follow train/eval. Returns count."""
    box = getattr(gm, prefix, None)
    if box is None:
        gm.add_submodule(prefix, nn.Module())
        box = getattr(gm, prefix)
    count = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        if n.target is aten.dropout.default:
            p = float(n.args[1])
            name = f"dropout_{count}"
            box.add_module(name, nn.Dropout(p))
            with gm.graph.inserting_before(n):
                new = gm.graph.call_module(f"{prefix}.{name}", (n.args[0],))
        elif op_of(n) == "sdpa" and n.target is aten.scaled_dot_product_attention.default:
            p = n.kwargs.get("dropout_p", n.args[4] if len(n.args) > 4 else 0.0)
            if not p:
                continue
            name = f"sdpa_{count}"
            box.add_module(name, _SDPA(float(p)))
            with gm.graph.inserting_before(n):
                new = gm.graph.call_module(f"{prefix}.{name}", n.args, n.kwargs)
        else:
            continue
        new.meta.update(n.meta)
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


class ConvertedGraphModule(fx.GraphModule):
    """Mixin methods for converted graphs (applied by :func:`as_converted`)."""

    # set by as_converted
    _dr_signature: _inspect.Signature | None
    _dr_layout: tuple[int, tuple[str, ...]]
    _dr_report: Any

    def report(self):
        """The :class:`~depthrewrite.report.ConvertReport` of this conversion."""
        return self._dr_report

    def __repr__(self) -> str:
        r = self._dr_report
        return f"Converted{r.model_class}(scheme={r.config.name!r}, sites={len(r.sites)}, new_params={r.new_params:,})"

    def __deepcopy__(self, memo):
        raise DepthRewriteError(
            "copy.deepcopy of a converted model is not supported yet: convert the original model again, and load "
            "this model's state_dict() into the new conversion"
        )

    def _apply(self, fn, recurse=True):
        ref = next((p for p in self.parameters() if p.is_floating_point()), None)
        before = (ref.dtype, ref.device) if ref is not None else None
        out = super()._apply(fn, recurse)
        ref = next((p for p in self.parameters() if p.is_floating_point()), None)
        if before is not None and ref is not None and (ref.dtype, ref.device) != before:
            _retarget(self, before, (ref.dtype, ref.device))
        return out


def _retarget(gm: fx.GraphModule, old: tuple, new: tuple) -> None:
    (odt, odev), (ndt, ndev) = old, new

    def swap(a):
        if isinstance(a, torch.dtype) and a == odt:
            return ndt
        if isinstance(a, torch.device) and a == odev:
            return ndev
        return a

    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        if n.target is aten._assert_tensor_metadata.default:
            gm.graph.erase_node(n)
            continue
        n.args = tuple(swap(a) for a in n.args)
        n.kwargs = {k: swap(v) for k, v in n.kwargs.items()}
    gm.recompile()


def _bind_inputs(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook: map a call onto the layout the graph was captured with."""
    sig = module._dr_signature
    n_pos, kw_names = module._dr_layout
    if sig is None:
        return args, kwargs
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise ConfigError(f"the converted model takes the original forward's arguments: {e}") from e
    values = dict(bound.arguments)
    extra = values.pop(next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), "__none__"), {})
    values.update(extra)
    names = list(sig.parameters)
    pos = tuple(values.pop(names[i]) for i in range(n_pos))
    kw = {k: values.pop(k) for k in kw_names if k in values}
    for k, v in values.items():
        default = sig.parameters[k].default if k in sig.parameters else None
        if k == "use_cache" or v is None or v is default:
            continue
        raise ConfigError(
            f"the model was converted with inputs {list(names[:n_pos]) + list(kw_names)}; it cannot take {k}= now. "
            f"Convert with example_kwargs including {k!r} to use it."
        )
    return pos, kw


_CLASSES: dict[type, type] = {}


def as_converted(gm: fx.GraphModule, model: nn.Module, args: tuple, kwargs: dict, report: Any) -> fx.GraphModule:
    """Give ``gm`` the converted-model behaviour (class swap keeps every attribute and state-dict key)."""
    base = type(gm)
    cls = _CLASSES.get(base)
    if cls is None:
        # Reuse the base's call wrapper: fx's recompile() installs one per class, and a second one on this subclass
        # would call back into itself through the base.
        cls = type("ConvertedGraphModule", (ConvertedGraphModule, base), {"_wrapped_call": getattr(base, "_wrapped_call", None)})
        _CLASSES[base] = cls
    gm.__class__ = cls
    for name in ("train", "eval"):  # ExportedProgram.module() forbids them per instance; our graph supports both
        gm.__dict__.pop(name, None)
    try:
        gm._dr_signature = _inspect.signature(model.forward)
    except (TypeError, ValueError):
        gm._dr_signature = None
    gm._dr_layout = (len(args), tuple(kwargs))
    gm._dr_report = report
    gm.register_forward_pre_hook(_bind_inputs, with_kwargs=True, prepend=True)
    return gm
