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
"""

from __future__ import annotations

import dataclasses
import inspect as _inspect
import operator
import re
from types import MappingProxyType
from typing import Any, Mapping

import torch
import torch.fx as fx
import torch.nn as nn

from .errors import CaptureGuardError, ConfigError, DepthRewriteError, ModuleTreeChangedError

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
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # the fixed sizes of every tensor input, in the order the graph passes them to _guards_fn
    fixed = []
    for n in placeholders:
        v = n.meta.get("val")
        fixed.append((n.name, _fixed_dims(v) if isinstance(v, torch.Tensor) else {}))

    def guarded(*args):
        try:
            return fn(*args)
        except AssertionError as e:
            msg = str(e)
            if not msg.startswith(_GUARD_PREFIX):
                raise
            raise _guard_error(msg[len(_GUARD_PREFIX):], args, fixed) from None

    guards.__dict__["_dr_typed"] = True
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
    gm.register_forward_pre_hook(_check_tree, with_kwargs=True, prepend=True)  # runs before _bind_inputs
    _typed_guards(gm)
    _record_tree(gm)
    return gm
