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
* **module tools**: the graph reads the weights directly (``get_attr``) and never calls the submodules, so a hook on a
  submodule, a replaced submodule (peft's LoRA) or a global module hook would be bypassed. The submodule tree is
  recorded at conversion and every call checks it first (:class:`ModuleTreeChangedError`); hooks on the converted
  model itself run as on any module.
* **capture guards**: a dimension export fixed at the example inputs fails its guard as a typed
  :class:`CaptureGuardError` naming the input, the dimension and both values.
* **copies**: ``copy.deepcopy``, pickle and ``torch.save`` carry the module state and the two graphs (deepcopy as
  ``fx.Graph`` objects, pickle as node lists with operators by name) and rebuild the rest in the copy: the generated
  forward, the call hooks, the typed guard wrapper; the recorded module tree travels with the modules it names.
"""

from __future__ import annotations

import copy
import dataclasses
import marshal
import sys
import inspect as _inspect
import operator
import pickle
import re
from collections import OrderedDict
from types import FunctionType, MappingProxyType
from typing import Any, Mapping

import torch
import torch.fx as fx
import torch.nn as nn
from torch.export._unlift import GuardsFn

from .errors import CaptureGuardError, ConfigError, ModuleTreeChangedError

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
        # a change made before the split is reported, not taken as the new tree (which is then recorded as it is)
        _check_tree(self, (), {})
        _record_tree(self)
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

    def record_module_tree(self) -> None:
        """Record the submodule tree (paths, module objects, types) as it is now; every later call checks that it is
        unchanged and that no submodule has hooks. Called at conversion and after :func:`depthrewrite.pipeline.split`."""
        _record_tree(self)

    def __repr__(self) -> str:
        r = self._dr_report
        return f"Converted{r.model_class}(scheme={r.config.name!r}, sites={len(r.sites)}, new_params={r.new_params:,})"

    def __reduce__(self):
        # pickle / torch.save: an empty instance of a fresh class, then __setstate__ rebuilds it (the state is pickled
        # after the instance is memoised, so the module tree's references back to the root resolve to the copy)
        return _new_converted, (_graph_module_base(type(self)),), _get_state(self, pickling=True)

    def __getstate__(self):
        return _get_state(self, pickling=True)

    def __setstate__(self, state: dict) -> None:
        _set_state(self, state)

    def __deepcopy__(self, memo):
        res = _new_converted(_graph_module_base(type(self)))
        memo[id(self)] = res
        _set_state(res, copy.deepcopy(_get_state(self, pickling=False), memo))
        return res

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


# ---- the module tree check ---------------------------------------------------------------------------------------

_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_hooks_of = operator.attrgetter(*_HOOKS)
_children_of = operator.attrgetter("_modules")
_HOOK_WORDS = {
    "_forward_pre_hooks": "a forward pre-hook",
    "_forward_hooks": "a forward hook",
    "_backward_pre_hooks": "a backward pre-hook",
    "_backward_hooks": "a backward hook",
}
_GLOBAL_HOOKS = (
    ("_global_forward_pre_hooks", "register_module_forward_pre_hook"),
    ("_global_forward_hooks", "register_module_forward_hook"),
    ("_global_backward_pre_hooks", "register_module_full_backward_pre_hook"),
    ("_global_backward_hooks", "register_module_(full_)backward_hook"),
)
_WHAT_TO_DO = (
    "The converted graph reads the weights directly and never calls the submodules, so it would silently bypass it. "
    "Apply hooks, LoRA / peft adapters and other module replacements to the original model and convert it again "
    "(hooks on the converted model itself are fine); recapturing on such changes is planned."
)

# Set to False to skip the check (for measuring its cost only: changes then go unnoticed).
CHECK_MODULE_TREE = True


class _Tree:
    """The submodule tree at conversion: ``names[i]``/``mods[i]``/``types[i]`` for every submodule, and
    ``children[j]``, a copy of the ``_modules`` dict of ``owners[j]`` (the root, then every submodule)."""

    __slots__ = ("names", "mods", "types", "owners", "children", "hooks")

    def __init__(self, root: nn.Module):
        named = [(n, m) for n, m in root.named_modules() if m is not root]
        self.names = [n for n, _ in named]
        self.mods = [m for _, m in named]
        self.types = list(map(type, self.mods))
        self.owners = [root, *self.mods]
        self.children = [dict(d) for d in map(_children_of, self.owners)]
        # the hook dicts themselves (register_*_hook adds to them in place): any() over them is one C-level pass
        self.hooks = [d for m in self.mods for d in _hooks_of(m)]


def _record_tree(gm: nn.Module) -> None:
    gm.__dict__["_dr_tree"] = _Tree(gm)


def _check_tree(module: nn.Module, args, kwargs) -> None:
    """Forward pre-hook of the root (runs first): raise :class:`ModuleTreeChangedError` where the graph would
    bypass a module tool. Cheap: a few C-level passes over lists recorded at conversion."""
    tree = module.__dict__.get("_dr_tree")
    if tree is None or not CHECK_MODULE_TREE:
        return
    mm = torch.nn.modules.module
    if mm._global_forward_pre_hooks or mm._global_forward_hooks or mm._global_backward_pre_hooks or mm._global_backward_hooks:
        kind = next(fn for attr, fn in _GLOBAL_HOOKS if getattr(mm, attr))
        raise ModuleTreeChangedError(
            f"a global module hook is registered (torch.nn.modules.module.{kind}; FlopCounterMode and ModuleTracker "
            f"register one too): it would run for the converted model itself but for none of its submodules. "
            + _WHAT_TO_DO + " Remove the global hook before calling the converted model.",
            module=None, change="global hook",
        )
    if (
        list(map(type, tree.mods)) != tree.types
        or list(map(_children_of, tree.owners)) != tree.children  # dict ==: same names, same objects (any order)
    ):
        path, change = _tree_change(module, tree)
        raise ModuleTreeChangedError(
            f"the converted model's submodule {path!r} was {change} after conversion. " + _WHAT_TO_DO,
            module=path, change=change,
        )
    if any(tree.hooks):
        i = next(i for i, m in enumerate(tree.mods) if any(_hooks_of(m)))
        kinds = [_HOOK_WORDS[a] for a, d in zip(_HOOKS, _hooks_of(tree.mods[i])) if d]
        raise ModuleTreeChangedError(
            f"the converted model's submodule {tree.names[i]!r} has {' and '.join(kinds)} registered. " + _WHAT_TO_DO
            + " Remove the hook (handle.remove()) to call the converted model.",
            module=tree.names[i], change="hook",
        )


def _tree_change(root: nn.Module, tree: _Tree) -> tuple[str, str]:
    """The first difference between the recorded tree and ``root``'s: ``(path, what happened to it)``."""
    now = dict(root.named_modules())
    for name, mod, typ in zip(tree.names, tree.mods, tree.types):
        cur = now.get(name)
        if cur is None:
            return name, "removed"
        if cur is not mod:
            return name, f"replaced (by a {type(cur).__name__})"
        if type(cur) is not typ:
            return name, f"changed from a {typ.__name__} to a {type(cur).__name__}"
    known = set(tree.names)
    added = next((n for n in now if n and n not in known), "?")
    return added, f"added (a {type(now[added]).__name__})" if added in now else "changed"


# ---- capture guards ---------------------------------------------------------------------------------------------

_GUARD_PREFIX = "Guard failed: "
_SIZE_GUARD = re.compile(r"^(?P<input>.+?)\.size\(\)\[(?P<dim>\d+)\] == (?P<value>-?\d+)$")


def _typed_guards(gm: fx.GraphModule) -> None:
    """Make a failing export guard (``_guards_fn``: ``AssertionError("Guard failed: ...")``) a
    :class:`CaptureGuardError`; other assertion errors pass unchanged."""
    guards = gm.__dict__.get("_modules", {}).get("_guards_fn")
    fn = getattr(guards, "forward", None) if guards is not None else None
    if fn is None or guards.__dict__.get("_dr_typed"):
        return
    # the fixed sizes of every tensor input, in the order the graph passes them to _guards_fn (kept on the module: a
    # pickled copy's graphs carry no example values)
    fixed = gm.__dict__.get("_dr_guard_dims")
    if fixed is None:
        fixed = []
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                v = n.meta.get("val")
                fixed.append((n.name, _fixed_dims(v) if isinstance(v, torch.Tensor) else {}))
        gm.__dict__["_dr_guard_dims"] = fixed

    def guarded(*args):
        try:
            return fn(*args)
        except AssertionError as e:
            msg = str(e)
            if not msg.startswith(_GUARD_PREFIX):
                raise
            raise _guard_error(msg[len(_GUARD_PREFIX):], args, fixed) from None

    if type(guards) is GuardsFn:
        guards.__class__ = _TypedGuards  # copies rebuild it (its forward is a function made by exec)
    guards.__dict__["_dr_typed"] = True
    guards.__dict__["_dr_untyped_forward"] = fn
    guards.forward = torch._dynamo.dont_skip_tracing(guarded) if hasattr(torch._dynamo, "dont_skip_tracing") else guarded


def _fixed_dims(v: torch.Tensor) -> dict[int, int]:
    """``{dim: size}`` for the dimensions of a placeholder's example value that are constants (specialised)."""
    out = {}
    for d, s in enumerate(v.shape):
        if isinstance(s, torch.SymInt) and s.node.expr.is_number:
            s = int(s.node.expr)
        if isinstance(s, int):
            out[d] = s
    return out


def _guard_error(guard: str, args: tuple, fixed: list) -> CaptureGuardError:
    todo = (
        "Convert with example inputs of the shape you will call it with (example_inputs= / example_kwargs=), or "
        "pad/trim this call to the captured shape; graphs captured per call structure are planned."
    )
    m = _SIZE_GUARD.match(guard.strip())
    for (name, dims), x in zip(fixed, args):
        if not isinstance(x, torch.Tensor):
            continue
        for d, s in dims.items():
            if d < x.dim() and x.shape[d] != s:
                label = m.group("input") if m and int(m.group("dim")) == d and int(m.group("value")) == s else name
                return CaptureGuardError(
                    f"the converted model was captured with dimension {d} of {label!r} fixed to {s} (torch.export "
                    f"specialised it at the example inputs); this call gives {int(x.shape[d])} (guard: {guard}). "
                    + todo,
                    input=label, dim=d, captured=s, given=int(x.shape[d]), guard=guard,
                )
    if m:
        return CaptureGuardError(
            f"the converted model was captured with dimension {m.group('dim')} of {m.group('input')!r} fixed to "
            f"{m.group('value')}; this call breaks that guard ({guard}). " + todo,
            input=m.group("input"), dim=int(m.group("dim")), captured=int(m.group("value")), guard=guard,
        )
    return CaptureGuardError(
        f"this call breaks a shape guard the converted model was captured with: {guard}. " + todo, guard=guard
    )


# ---- copies: copy.deepcopy, pickle, torch.save -------------------------------------------------------------------
#
# The state of a converted model is its module state (parameters, buffers, submodules, plain attributes) plus what
# is derived from it and rebuilt in the copy: the two graphs (deepcopy copies the fx.Graph objects; pickle carries each
# graph as a node list whose op targets are names, so nothing of torch's op registry is pickled and the custom ops
# resolve again on load), the generated forward (recompiled), our forward pre-hooks (registered again), the typed
# guard wrapper (wrapped again around export's guard function, which pickle carries as its code object). The recorded
# module tree travels with the modules it refers to (the same objects in the copy), so a copy checks its own tree.

# attributes rebuilt in the copy
_REBUILT = ("_graph", "_dr_graphs", "_dr_tree", "_code", "_lineno_map", "_prologue_start")
# node meta entries that hold example values (fake tensors, symbolic ints): not carried by pickle
_EXAMPLE_META = ("val", "example_value", "tensor_meta", "unbacked_bindings")


def _graph_module_base(cls: type) -> type:
    """The class a converted model's per-instance classes derive from (export's ``_StatefulGraphModule``)."""
    for c in cls.__mro__:
        if not issubclass(c, ConvertedGraphModule) and c.__qualname__.split(".")[-1] != "GraphModuleImpl":
            return c
    return fx.GraphModule


def _converted_class(base: type) -> type:
    cls = _CLASSES.get(base)
    if cls is None:
        # Reuse the base's call wrapper: fx's recompile() installs one per class, and a second one on this subclass
        # would call back into itself through the base.
        cls = type("ConvertedGraphModule", (ConvertedGraphModule, base), {"_wrapped_call": getattr(base, "_wrapped_call", None)})
        _CLASSES[base] = cls
    return cls


def _new_converted(base: type) -> ConvertedGraphModule:
    """An empty converted model of a class of its own (fx installs ``forward`` on the class): what unpickling a
    converted model calls first, then :meth:`ConvertedGraphModule.__setstate__`."""
    impl = type("GraphModuleImpl", (base,), {})  # as GraphModule.__new__ makes one per instance
    # what recompile() would have installed on it (the converted class reuses it, see _converted_class)
    impl._wrapped_call = torch.fx.graph_module._WrappedCall(impl, None)
    return object.__new__(_converted_class(impl))


class _NodeRef:
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __reduce__(self):
        return _NodeRef, (self.name,)


class _OpRef:
    """An operator by name: ``torch.ops.<namespace>.<name>.<overload>`` (OpOverload), or a higher-order operator."""

    __slots__ = ("path",)

    def __init__(self, path: tuple):
        self.path = path

    def __reduce__(self):
        return _OpRef, (self.path,)

    def resolve(self):
        obj = torch.ops
        for part in self.path:
            obj = getattr(obj, part)
        return obj


def _encode(a):
    if isinstance(a, fx.Node):
        return _NodeRef(a.name)
    if isinstance(a, torch._ops.OpOverload):
        ns, name = a._schema.name.split("::")
        return _OpRef((ns, name, a._overloadname or "default"))
    if isinstance(a, torch._ops.OpOverloadPacket):
        ns, name = a._qualified_op_name.split("::")
        return _OpRef((ns, name))
    if isinstance(a, torch._ops.HigherOrderOperator):
        return _OpRef(("higher_order", a.name()))
    if isinstance(a, tuple) and not hasattr(a, "_fields"):
        return tuple(_encode(x) for x in a)
    if isinstance(a, list):
        return [_encode(x) for x in a]
    if isinstance(a, dict):
        return {k: _encode(v) for k, v in a.items()}
    if isinstance(a, slice):
        return slice(_encode(a.start), _encode(a.stop), _encode(a.step))
    return a


def _decode(a, env: dict):
    if isinstance(a, _NodeRef):
        return env[a.name]
    if isinstance(a, _OpRef):
        return a.resolve()
    if isinstance(a, tuple) and not hasattr(a, "_fields"):
        return tuple(_decode(x, env) for x in a)
    if isinstance(a, list):
        return [_decode(x, env) for x in a]
    if isinstance(a, dict):
        return {k: _decode(v, env) for k, v in a.items()}
    if isinstance(a, slice):
        return slice(_decode(a.start, env), _decode(a.stop, env), _decode(a.step, env))
    return a


def _picklable_meta(meta: dict) -> dict:
    out = {k: v for k, v in meta.items() if k not in _EXAMPLE_META}
    try:
        pickle.dumps(out)
        return out
    except Exception:  # noqa: BLE001 - keep what pickles, entry by entry
        pass
    keep = {}
    for k, v in out.items():
        try:
            pickle.dumps(v)
        except Exception:  # noqa: BLE001
            continue
        keep[k] = v
    return keep


def _graph_to_state(graph: fx.Graph) -> dict:
    nodes = [
        (n.op, n.name, _encode(n.target), _encode(n.args), _encode(dict(n.kwargs)),
         n.type if n.type is None or isinstance(n.type, type) else None, _picklable_meta(n.meta))
        for n in graph.nodes
    ]
    return {"nodes": nodes, "codegen": graph._codegen, "tracer_cls": graph._tracer_cls}


def _graph_from_state(state: dict) -> fx.Graph:
    graph = fx.Graph(tracer_cls=state["tracer_cls"])
    graph._codegen = state["codegen"]
    env: dict[str, fx.Node] = {}
    for op, name, target, args, kwargs, type_expr, meta in state["nodes"]:
        n = graph.create_node(
            op, _decode(target, env), _decode(args, env), _decode(kwargs, env), name=name, type_expr=type_expr
        )
        if n.name != name:
            raise RuntimeError(f"depthrewrite: node {name!r} came back as {n.name!r} on load")
        n.meta.update(meta)
        env[name] = n
    return graph


def _guard_code(fn) -> Any:
    """The function export generated for the guards (named ``_``), found inside the wrappers around it."""
    seen = set()
    todo = [fn]
    while todo:
        f = todo.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        if isinstance(f, FunctionType) and f.__name__ == "_":
            return f
        for cell in getattr(f, "__closure__", None) or ():
            try:
                v = cell.cell_contents
            except ValueError:
                continue
            if callable(v):
                todo.append(v)
        if getattr(f, "__wrapped__", None) is not None:
            todo.append(f.__wrapped__)
    return None


class _TypedGuards(GuardsFn):
    """Export's guard submodule once :func:`_typed_guards` wrapped it. Copies are rebuilt around the same guard
    function (deepcopy) or around its code object (pickle: the code is marshalled, so it loads under the same Python
    version), then wrapped again."""

    def __reduce__(self):
        f = _guard_code(self.__dict__.get("_dr_untyped_forward"))
        code = marshal.dumps(f.__code__) if f is not None else None
        return _guards_from_code, (code, tuple(sys.version_info[:2]))

    def __deepcopy__(self, memo):
        return _new_guards(self.__dict__.get("_dr_untyped_forward"))


def _new_guards(fn) -> _TypedGuards:
    guards = _TypedGuards()
    if fn is not None:
        guards.forward = fn
    guards._is_impure = True
    return guards


def _guards_from_code(code: bytes | None, version: tuple) -> _TypedGuards:
    if code is None or tuple(sys.version_info[:2]) != tuple(version):
        import warnings

        warnings.warn(
            "depthrewrite: this converted model was pickled under another Python version; its capture guards (the "
            "input shapes torch.export fixed) are not checked in the loaded copy", stacklevel=2,
        )
        return _new_guards(None)
    import math

    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    fn = FunctionType(marshal.loads(code), {**SYMPY_INTERP, "math": math, "inf": float("inf"), "torch": torch})
    if hasattr(torch._dynamo, "dont_skip_tracing"):
        fn = torch._dynamo.dont_skip_tracing(fn)
    return _new_guards(fn)


def _get_state(gm: ConvertedGraphModule, pickling: bool) -> dict:
    body = {k: v for k, v in gm.__dict__.items() if k not in _REBUILT}
    ours = [k for k, h in gm._forward_pre_hooks.items() if h is _bind_inputs or h is _check_tree]
    body["_forward_pre_hooks"] = OrderedDict((k, h) for k, h in gm._forward_pre_hooks.items() if k not in ours)
    body["_forward_pre_hooks_with_kwargs"] = OrderedDict(
        (k, v) for k, v in gm._forward_pre_hooks_with_kwargs.items() if k not in ours
    )
    graphs = gm.__dict__.get("_dr_graphs") or {gm.training: gm.graph}
    return {
        "body": body,
        "graphs": {mode: _graph_to_state(g) if pickling else g for mode, g in graphs.items()},
        "tree": _portable_tree(gm.__dict__.get("_dr_tree")),
    }


class _ImplOf:
    """Stands for a per-instance GraphModule class (``GraphModuleImpl``, local to ``GraphModule.__new__``) in a
    recorded tree: the copy of that submodule has a class of its own."""

    __slots__ = ("base",)

    def __init__(self, base: type):
        self.base = base

    def __reduce__(self):
        return _ImplOf, (self.base,)


def _is_impl(t: type) -> bool:
    return t.__qualname__.split(".")[-1] == "GraphModuleImpl"


def _portable_tree(tree: _Tree | None) -> _Tree | None:
    if tree is None:
        return None
    out = object.__new__(_Tree)
    for k in _Tree.__slots__:
        setattr(out, k, getattr(tree, k))
    out.types = [_ImplOf(t.__mro__[1]) if _is_impl(t) else t for t in tree.types]
    return out


def _resolved_tree(tree: _Tree) -> _Tree:
    tree.types = [
        type(m) if isinstance(t, _ImplOf) and _is_impl(type(m)) and type(m).__mro__[1] is t.base
        else t.base if isinstance(t, _ImplOf) else t
        for t, m in zip(tree.types, tree.mods)
    ]
    return tree


def _set_state(gm: ConvertedGraphModule, state: dict) -> None:
    gm.__dict__.update(state["body"])
    graphs = {mode: _graph_from_state(g) if isinstance(g, dict) else g for mode, g in state["graphs"].items()}
    for g in graphs.values():
        g.owning_module = gm
    gm.__dict__["_dr_graphs"] = graphs
    gm.graph = graphs[bool(gm.training)] if bool(gm.training) in graphs else next(iter(graphs.values()))
    if state.get("tree") is not None:
        gm.__dict__["_dr_tree"] = _resolved_tree(state["tree"])
    else:
        _record_tree(gm)
    _install_hooks(gm)
    _typed_guards(gm)


class _ExportHook:
    """A picklable stand-in for the hooks ``ExportedProgram.module()`` registers as lambdas: each calls one function
    of ``torch.export._unlift`` with the types of the module inputs (``module_types``)."""

    def __init__(self, fn_name: str, module_types):
        self.fn_name, self.module_types = fn_name, module_types

    def __call__(self, *args, **kwargs):
        import torch.export._unlift as unlift

        return getattr(unlift, self.fn_name)(self.module_types)


def _portable_export_hooks(gm: nn.Module) -> None:
    """Replace export's lambda hooks on ``gm`` (same keys, same order) by :class:`_ExportHook`, so the model pickles."""
    for attr in ("_forward_pre_hooks", "_forward_hooks"):
        hooks = getattr(gm, attr)
        for key, h in list(hooks.items()):
            if not (isinstance(h, FunctionType) and h.__qualname__.startswith("_create_stateful_graph_module.")):
                continue
            names = [n for n in h.__code__.co_names if n.startswith(("_enter_", "_exit_"))]
            cells = dict(zip(h.__code__.co_freevars, (c.cell_contents for c in h.__closure__ or ())))
            if len(names) == 1 and set(cells) == {"module_types"}:
                hooks[key] = _ExportHook(names[0], cells["module_types"])


def _install_hooks(gm: nn.Module) -> None:
    gm.register_forward_pre_hook(_bind_inputs, with_kwargs=True, prepend=True)
    gm.register_forward_pre_hook(_check_tree, with_kwargs=True, prepend=True)  # runs before _bind_inputs


_CLASSES: dict[type, type] = {}


def as_converted(
    gm: fx.GraphModule, eval_graph: fx.Graph, model: nn.Module, args: tuple, kwargs: dict, report: Any
) -> fx.GraphModule:
    """Give ``gm`` (the training-mode graph) the converted-model behaviour; ``eval_graph`` runs in eval mode.
    The class swap keeps every attribute and state-dict key."""
    cls = _converted_class(type(gm))
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
    _install_hooks(gm)
    _portable_export_hooks(gm)
    _typed_guards(gm)
    _record_tree(gm)
    return gm
