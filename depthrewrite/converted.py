"""One captured and rewritten graph of a converted model (a :class:`ConvertedGraphModule`).

A converted model (:mod:`depthrewrite.runtime`) keeps one of these per call structure: the ``torch.export`` graph of
the original ``forward`` for that call, rewritten by the scheme's pass. Its parameters and buffers are the model's own
tensor objects (export unlifts them by reference) and ``depthrewrite`` is the model's own submodule of new parameters,
so every graph trains the same weights. What it adds to export's module:

* **call signature**: positional and keyword calls are bound to the original ``forward`` signature and passed in the
  layout the graph was captured with (:meth:`ConvertedGraphModule.bind_inputs`).
* **shape guards**: export's guard function is removed from the graph; the converted model checks the fixed and
  dynamic input dimensions itself before choosing a graph (:class:`depthrewrite.runtime.entries.GraphEntry`), and captures a
  new graph where none fits.
* **pipeline stages**: :func:`depthrewrite.pipeline.split` places stage boundaries in the graph and records them.
"""

from __future__ import annotations

import dataclasses
import inspect as _inspect
from types import MappingProxyType
from typing import Any, Mapping

import torch
import torch.fx as fx
import torch.nn as nn

from .errors import ConfigError

__all__ = ["ConvertedGraphModule", "as_converted", "drop_dead_code", "drop_empty_concats", "graph_module_of"]

aten = torch.ops.aten


class ConvertedGraphModule(fx.GraphModule):
    """Methods of a converted graph (applied by :func:`as_converted`)."""

    # set by as_converted
    _dr_signature: _inspect.Signature | None
    _dr_layout: tuple[int, tuple[str, ...]]
    _dr_report: Any
    # set by depthrewrite.pipeline.split (through record_pipeline)
    _dr_pipeline_cuts: tuple[int, ...]

    def __getattr__(self, name: str) -> Any:
        # A block runner (depthrewrite.blocks.build_runner) keeps no submodules or parameters of its own: what its
        # code reads (self.model.layers[3], self.lm_head.weight, self.depthrewrite) is the live model's, at call time.
        # Read there directly, not after nn.Module's lookup has raised (an exception per read, each decoding step).
        d = self.__dict__
        live = d.get("_dr_live")
        if live is not None and name not in d["_modules"] and name not in d["_parameters"] and name not in d["_buffers"]:
            return getattr(live, name)
        return super().__getattr__(name)

    @property
    def programs(self) -> Mapping[str, Any]:
        """The block programs of a block runner (``{attribute: BlockProgram}``; empty for a flat graph)."""
        return MappingProxyType(self.__dict__.get("_dr_programs", {}))

    def report(self):
        """The :class:`~depthrewrite.views.report.ConvertReport` of this conversion."""
        return self._dr_report

    @property
    def graphs(self) -> Mapping[bool, fx.Graph]:
        """This module's graph by the training mode it was captured in (``{mode: self.graph}``: one graph per module;
        a converted model's ``graphs`` has both modes). A read-only view; a pass that edits the graph in place calls
        :meth:`recompile` afterwards."""
        return MappingProxyType({self.training: self.graph})

    @property
    def pipeline_cuts(self) -> tuple[int, ...] | None:
        """The sublayer index where each pipeline stage after the first begins, as placed by
        :func:`depthrewrite.pipeline.split`; ``()`` for a one-stage split, None when the model was never split."""
        return self.__dict__.get("_dr_pipeline_cuts")

    def record_pipeline(self, cuts: tuple[int, ...], info: Any = None) -> None:
        """Record a pipeline split whose boundaries are already placed in :attr:`graph`: :attr:`pipeline_cuts`
        becomes ``cuts`` and, when ``info`` is given, the report's ``pipeline`` section becomes ``info`` (a
        :class:`~depthrewrite.pipeline.PipelineInfo`). Called by :func:`depthrewrite.pipeline.split`."""
        self._dr_pipeline_cuts = tuple(cuts)
        if info is not None:
            self._dr_report = dataclasses.replace(self._dr_report, pipeline=info)

    def resolve_attr(self, target: str) -> Any:
        """The parameter, buffer, submodule or constant at the dotted ``target`` of a ``get_attr`` node (None when
        there is none)."""
        return resolve_target(self, target)

    def bind_inputs(self, args: tuple = (), kwargs: dict | None = None) -> tuple[tuple, dict]:
        """``(positional, keywords)``: a call ``self(*args, **kwargs)`` bound to the original forward's signature and
        laid out as the graph was captured (what the forward pre-hook passes to the graph).

        Raises:
            ConfigError: the call lacks an input the model was converted with, or passes one it was not.
        """
        args, kwargs = tuple(args), dict(kwargs or {})
        bound = bind_graph_inputs(self, args, kwargs)
        return (args, kwargs) if bound is None else bound  # None: already in the captured layout

    def __repr__(self) -> str:
        r = self._dr_report
        return f"Converted{r.model_class}(scheme={r.config.name!r}, sites={len(r.sites)}, new_params={r.new_params:,})"

    def __reduce__(self):
        raise TypeError(
            "a converted graph is not pickled on its own: pickle, deepcopy or torch.save the converted model, which "
            "recaptures its graphs on first use"
        )


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


_CONST_COPIES = (aten.detach.default, aten.detach_.default, aten.lift_fresh_copy.default, aten.clone.default)


def _empty_constant(gm: fx.GraphModule, n: Any) -> bool:
    """Whether ``n`` is (a copy of) a constant of ``gm`` that ``torch.cat`` skips: a 1-D tensor with no elements."""
    while isinstance(n, fx.Node) and n.op == "call_function" and n.target in _CONST_COPIES:
        n = n.args[0]
    if not isinstance(n, fx.Node) or n.op != "get_attr":
        return False
    t = resolve_target(gm, n.target)
    return isinstance(t, torch.Tensor) and t.dim() == 1 and t.numel() == 0


def _same_size(a: Any, b: Any) -> bool:
    """Whether two sizes of traced shapes are the same (a fixed number, or the same expression of size symbols),
    without asking the shape environment (which would add a guard)."""
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return a.node.expr == b.node.expr
    return type(a) is type(b) and a == b


def drop_empty_concats(gm: fx.GraphModule) -> int:
    """``cat([empty constant, x])`` → ``x`` where ``x`` is a graph input of the same dtype and shape as the result
    (transformers' exported ``DynamicCache`` starts each layer from ``torch.tensor([])`` and concatenates the
    caller's keys and values onto it: one copy of the whole cache per layer per call, ~3 ops and O(cached tokens)
    bytes per layer of every decoding step). Returns how many were dropped; dead code goes with
    :func:`drop_dead_code` after it."""
    dropped = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not aten.cat.default or not isinstance(n.args[0], (list, tuple)):
            continue
        kept = [x for x in n.args[0] if not _empty_constant(gm, x)]
        if len(kept) != 1 or len(kept) == len(n.args[0]) or not isinstance(kept[0], fx.Node) \
                or kept[0].op != "placeholder":
            continue
        have, want = kept[0].meta.get("val"), n.meta.get("val")
        if not (isinstance(have, torch.Tensor) and isinstance(want, torch.Tensor) and have.dtype == want.dtype
                and have.dim() == want.dim() and all(map(_same_size, have.shape, want.shape))):
            continue
        empties = [x for x in n.args[0] if x is not kept[0]]
        n.replace_all_uses_with(kept[0])
        gm.graph.erase_node(n)
        dropped += 1
        for x in empties:  # the constant's copies (an in-place detach_ is not dead code to fx): erased when unread
            while isinstance(x, fx.Node) and not x.users and (x.op == "get_attr" or x.target in _CONST_COPIES):
                up = x.args[0] if x.op == "call_function" else None
                gm.graph.erase_node(x)
                x = up
    if dropped:
        gm.recompile()
    return dropped


def bind_graph_inputs(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook: map a call onto the layout the graph was captured with (None: it is in that layout)."""
    sig = module._dr_signature
    n_pos, kw_names = module._dr_layout
    if sig is None:
        return args, kwargs
    if not args and not n_pos and len(kwargs) == len(kw_names) and all(k in kwargs for k in kw_names):
        return None  # already in the captured layout: how a converted model calls its graphs

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
        if v is None or v is default:
            continue
        raise ConfigError(
            f"the model was converted with inputs {list(names[:n_pos]) + list(kw_names)}; it cannot take {k}= now. "
            f"Convert with example_kwargs including {k!r} to use it."
        )
    return pos, kw


def resolve_target(mod: nn.Module, target: str):
    obj = mod
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj




def _drop_export_guards(gm: fx.GraphModule) -> None:
    """Remove export's ``_guards_fn`` call: the converted model checks input shapes itself before it picks a graph
    (export's generated guard code also fails on inputs that are pytree containers, such as a KV cache)."""
    for n in list(gm.graph.nodes):
        if n.op == "call_module" and n.target == "_guards_fn":
            gm.graph.erase_node(n)
    if "_guards_fn" in gm._modules:
        del gm._modules["_guards_fn"]
    gm.recompile()


def as_converted(gm: fx.GraphModule, model: nn.Module, signature: _inspect.Signature | None, args: tuple,
                 kwargs: dict, report: Any) -> fx.GraphModule:
    """Make ``gm`` (one rewritten graph of ``model``) a :class:`ConvertedGraphModule`; the class swap keeps every
    attribute and state-dict key."""
    cls = _converted_class(type(gm))
    gm.__class__ = cls
    for name in ("train", "eval"):  # ExportedProgram.module() forbids them per instance
        gm.__dict__.pop(name, None)
    gm._dr_signature = signature
    gm._dr_layout = (len(args), tuple(kwargs))
    gm._dr_report = report
    gm.training = bool(model.training)
    _drop_export_guards(gm)
    gm.register_forward_pre_hook(bind_graph_inputs, with_kwargs=True, prepend=True)
    return gm


_CLASSES: dict[type, type] = {}


def _converted_class(base: type) -> type:
    cls = _CLASSES.get(base)
    if cls is None:
        # Reuse the base's call wrapper: fx's recompile() installs one per class, and a second one on this subclass
        # would call back into itself through the base.
        cls = type("ConvertedGraphModule", (ConvertedGraphModule, base), {"_wrapped_call": getattr(base, "_wrapped_call", None)})
        _CLASSES[base] = cls
    return cls


def graph_module_of(obj: Any, what: str = "this") -> "ConvertedGraphModule":
    """The :class:`ConvertedGraphModule` to work on: ``obj`` itself, or for a converted model the graph of its current
    mode (the one its last call ran; captured from the conversion's example call when there is none yet)."""
    if isinstance(obj, ConvertedGraphModule):
        return obj
    from .runtime.handle import is_converted

    if is_converted(obj):
        return obj.graph_module()
    raise ConfigError(f"{what} needs a model returned by depthrewrite.convert(), got {type(obj).__name__}")
