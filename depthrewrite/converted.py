"""The converted model: a GraphModule that behaves as a training module.

What the captured graph needs before it can train like the original:

* **train/eval**: export bakes the mode into the graph (``aten.dropout(x, p, train)``, SDPA's ``dropout_p``, and any
  ``if self.training`` branch, such as MoE routing noise). The model is therefore captured and rewritten twice, in
  training and in eval mode; both graphs read the same parameters, and ``.train()`` / ``.eval()`` swap the graph.
* **dtype and device**: export bakes the capture dtype and device into casts, factory ops and metadata asserts. On
  ``.to()`` / ``.half()`` / ``.cuda()`` the graph is retargeted: the asserts are dropped and every dtype argument
  equal to the old parameter dtype (every device argument equal to the old device) follows the parameters. A model
  converted in fp32 and cast to bf16 therefore computes its own norms in bf16; convert in the training dtype to keep
  the model's explicit fp32 upcasts. The depth-mixing ops always compute in fp32.
* **call signature**: positional and keyword calls are bound to the original ``forward`` signature and passed in the
  layout the graph was captured with.
"""

from __future__ import annotations

import dataclasses
import inspect as _inspect
from types import MappingProxyType
from typing import Any, Mapping

import torch
import torch.fx as fx
import torch.nn as nn

from .errors import ConfigError, DepthRewriteError

__all__ = ["ConvertedGraphModule", "as_converted", "graft_graph", "drop_dead_code"]

aten = torch.ops.aten


class ConvertedGraphModule(fx.GraphModule):
    """Mixin methods for converted graphs (applied by :func:`as_converted`)."""

    # set by as_converted
    _dr_signature: _inspect.Signature | None
    _dr_layout: tuple[int, tuple[str, ...]]
    _dr_report: Any
    # set by depthrewrite.pipeline.split (through record_pipeline)
    _dr_pipeline_cuts: tuple[int, ...]

    def report(self):
        """The :class:`~depthrewrite.views.report.ConvertReport` of this conversion."""
        return self._dr_report

    @property
    def graphs(self) -> Mapping[bool, fx.Graph]:
        """Both graphs of the conversion, by training mode: ``graphs[True]`` runs in training mode, ``graphs[False]``
        in eval mode (``self.graph`` is the one of the current mode). A read-only view; a pass that edits the graphs
        in place calls :meth:`recompile` afterwards."""
        return MappingProxyType(self.__dict__.get("_dr_graphs") or {self.training: self.graph})

    @property
    def pipeline_cuts(self) -> tuple[int, ...] | None:
        """The sublayer index where each pipeline stage after the first begins, as placed by
        :func:`depthrewrite.pipeline.split`; ``()`` for a one-stage split, None when the model was never split."""
        return self.__dict__.get("_dr_pipeline_cuts")

    def record_pipeline(self, cuts: tuple[int, ...], info: Any = None) -> None:
        """Record a pipeline split whose boundaries are already placed in both :attr:`graphs`: :attr:`pipeline_cuts`
        becomes ``cuts`` and, when ``info`` is given, the report's ``pipeline`` section becomes ``info`` (a
        :class:`~depthrewrite.pipeline.PipelineInfo`). Called by :func:`depthrewrite.pipeline.split`."""
        self._dr_pipeline_cuts = tuple(cuts)
        if info is not None:
            self._dr_report = dataclasses.replace(self._dr_report, pipeline=info)

    def resolve_attr(self, target: str) -> Any:
        """The parameter, buffer, submodule or constant at the dotted ``target`` of a ``get_attr`` node (None when
        there is none)."""
        return _resolve(self, target)

    def bind_inputs(self, args: tuple = (), kwargs: dict | None = None) -> tuple[tuple, dict]:
        """``(positional, keywords)``: a call ``self(*args, **kwargs)`` bound to the original forward's signature and
        laid out as the graph was captured (what the forward pre-hook passes to the graph).

        Raises:
            ConfigError: the call lacks an input the model was converted with, or passes one it was not.
        """
        return _bind_inputs(self, tuple(args), dict(kwargs or {}))

    def __repr__(self) -> str:
        r = self._dr_report
        return f"Converted{r.model_class}(scheme={r.config.name!r}, sites={len(r.sites)}, new_params={r.new_params:,})"

    def __deepcopy__(self, memo):
        raise DepthRewriteError(
            "copy.deepcopy of a converted model is not supported yet: convert the original model again, and load "
            "this model's state_dict() into the new conversion"
        )

    def train(self, mode: bool = True):
        super().train(mode)
        graphs = self.__dict__.get("_dr_graphs")
        if graphs is not None and self.graph is not graphs[bool(mode)]:
            self.graph = graphs[bool(mode)]  # the setter recompiles forward
        return self

    def _apply(self, fn, recurse=True):
        ref = next((p for p in self.parameters() if p.is_floating_point()), None)
        before = (ref.dtype, ref.device) if ref is not None else None
        out = super()._apply(fn, recurse)
        ref = next((p for p in self.parameters() if p.is_floating_point()), None)
        if before is not None and ref is not None and (ref.dtype, ref.device) != before:
            _retarget(self, before, (ref.dtype, ref.device))
        return out


def _retarget(gm: fx.GraphModule, old: tuple, new: tuple) -> None:
    for graph in gm.__dict__.get("_dr_graphs", {}).values() or [gm.graph]:
        _retarget_graph(graph, old, new)
    gm.recompile()


def _retarget_graph(graph: fx.Graph, old: tuple, new: tuple) -> None:
    (odt, odev), (ndt, ndev) = old, new

    def swap(a):
        if isinstance(a, torch.dtype) and a == odt:
            return ndt
        if isinstance(a, torch.device) and a == odev:
            return ndev
        return a

    for n in list(graph.nodes):
        if n.op != "call_function":
            continue
        if n.target is aten._assert_tensor_metadata.default:
            graph.erase_node(n)
            continue
        n.args = tuple(swap(a) for a in n.args)
        n.kwargs = {k: swap(v) for k, v in n.kwargs.items()}


def drop_dead_code(gm: fx.GraphModule) -> int:
    """Remove what no output reads any more after a rewrite; returns the number of nodes removed.

    Export's ``_assert_tensor_metadata`` checks are side-effecting nodes, so they keep the *original* residual chain
    alive after the rewrite has redirected every reader (the old stream would still be computed at every step). They
    only re-check dtypes the capture already fixed, so they are dropped (as ``.to()`` does), then dead code goes.
    """
    graph = gm.graph
    before = len(graph.nodes)
    for n in list(graph.nodes):
        if n.op == "call_function" and n.target is aten._assert_tensor_metadata.default:
            graph.erase_node(n)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return before - len(graph.nodes)


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
    missing = [k for k in (*names[:n_pos], *kw_names) if k not in values]
    if missing:
        raise ConfigError(
            f"the model was converted with inputs {list(names[:n_pos]) + list(kw_names)}; this call lacks {missing}. "
            "Pass the same inputs, or convert with example inputs that match how you call it."
        )
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


def graft_graph(host: fx.GraphModule, other: fx.GraphModule) -> fx.Graph:
    """Make ``other``'s graph runnable on ``host``: attributes with the same path and value are shared (parameters
    are the same objects), anything else is copied onto ``host`` under a new name."""
    for i, n in enumerate(n for n in other.graph.nodes if n.op == "get_attr"):
        theirs = _resolve(other, n.target)
        ours = _resolve(host, n.target)
        if ours is theirs or (
            isinstance(ours, torch.Tensor) and isinstance(theirs, torch.Tensor) and ours.shape == theirs.shape
            and ours.dtype == theirs.dtype and torch.equal(ours, theirs)
        ):
            continue
        name = f"_dr_eval_const_{i}"
        if isinstance(theirs, torch.Tensor) and not isinstance(theirs, nn.Parameter):
            host.register_buffer(name, theirs, persistent=False)
        else:
            setattr(host, name, theirs)
        n.target = name
    return other.graph


def _resolve(mod: nn.Module, target: str):
    obj = mod
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


_CLASSES: dict[type, type] = {}


def as_converted(
    gm: fx.GraphModule, eval_graph: fx.Graph, model: nn.Module, args: tuple, kwargs: dict, report: Any
) -> fx.GraphModule:
    """Give ``gm`` (the training-mode graph) the converted-model behaviour; ``eval_graph`` runs in eval mode.
    The class swap keeps every attribute and state-dict key."""
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
    gm._dr_graphs = {True: gm.graph, False: eval_graph}
    gm.register_forward_pre_hook(_bind_inputs, with_kwargs=True, prepend=True)
    return gm
