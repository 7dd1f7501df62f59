"""The converted model: the user's own object, whose ``forward`` runs rewritten graphs captured per call structure.

:func:`depthrewrite.convert` converts in place (as ``torchao.quantization.quantize_`` does): the model keeps its
identity, its attributes and its methods, and its class becomes a subclass of the original one
(:class:`ConvertedModel` first in the method order) whose ``forward`` has the original signature. So ``.config``,
``generate()``, ``save_pretrained()``, HF ``Trainer`` and a hand-written model's own methods keep working.

How a call runs (:meth:`ConversionState.call`):

1. **Module tree.** A fingerprint of the submodule tree (every submodule object and type, its parameters' and
   buffers' identities, its hook dicts, the config's attributes, activation-checkpointing flags) is compared with the
   one recorded at the last capture. A replaced, added or removed submodule (peft's LoRA), a hook added or removed, a
   reassigned parameter or buffer (``.to()`` replaces buffers, ``tie_weights()`` parameters) or a config change drops
   every captured graph, and the call recaptures: the module tools are followed, never bypassed. Hooks on submodules
   are traced into the new graph (a warning says their side effects happen at capture only); a global module hook
   cannot be followed and is a :class:`~depthrewrite.errors.ModuleTreeChangedError`.
2. **Call structure.** The call is bound to the original signature; its structure is the training mode, the model's
   dtype and device, and per argument: ``None``, a tensor's dtype/device/rank, a Python value, or a container's
   layout (a KV cache). Each structure gets its own graphs on first use: captured with ``torch.export`` from the
   original ``forward``, rewritten by the scheme's pass, sharing the same new parameters (``model.depthrewrite``,
   sites matched by position in the chain; a structure whose chain differs is a typed error).
3. **Shapes.** Batch and sequence dimensions are dynamic. Where export fixed a dimension (or a dynamic one is 0 or 1
   in this call, which export assumes it is not), the call gets a graph of its own, as ``torch.compile`` recompiles.
4. **Caches.** A call that passes a ``transformers`` ``DynamicCache`` runs a graph that takes the cache's tensors and
   returns the new ones; they are written back into the caller's cache object, which HF models (and ``generate()``)
   expect to be updated in place.

Copies (``copy.deepcopy``, pickle, ``torch.save``) carry the module state and the conversion's recipe, never the
graphs: a copy recaptures on first use.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect as _inspect
import itertools
import logging
import operator
import threading
import time
from collections import OrderedDict
from typing import Any, Iterator, Mapping

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from .capture import CONTINUATION_META, is_cache
from .errors import ConfigError, DepthRewriteError, ModuleTreeChangedError
from .passes.lower.module_calls import HOOK_ATTRS, hook_owner, is_dtensor, traced_hook
from .passes.rewrite.msar_decode import HISTORY_META

__all__ = ["ConvertedModel", "ConversionState", "GraphEntry", "is_converted", "state_of", "converted_class"]

log = logging.getLogger(__name__)

# Set to False to skip the module-tree check (for measuring its cost only: changes then go unnoticed).
CHECK_MODULE_TREE = True


# ---- the module tree fingerprint ---------------------------------------------------------------------------------

_HOOKS = HOOK_ATTRS
_hooks_of = operator.attrgetter(*_HOOKS)
_children_of = operator.attrgetter("_modules")
_params_of = operator.attrgetter("_parameters")
_buffers_of = operator.attrgetter("_buffers")
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
_KNOWN_HOOK_OWNERS = ("transformers.", "torch.", "peft.", "accelerate.", "depthrewrite.")


def _config_state(root: nn.Module) -> dict | None:
    """A shallow copy of the model's ``config`` attributes (HF configs, nanoGPT's dataclass): export bakes them in."""
    cfg = getattr(root, "config", None)
    if cfg is None or not hasattr(cfg, "__dict__"):
        return None
    return {k: dict(vars(v)) if hasattr(v, "to_dict") and hasattr(v, "__dict__") else v for k, v in vars(cfg).items()}


_PLAIN = (torch.Tensor, nn.Parameter, getattr(nn, "Buffer", torch.Tensor))


def _direct_reads(entries: list) -> set[str]:
    """The absolute paths of the parameters and buffers the graphs of ``entries`` read with ``get_attr`` (the
    runner's or flat graph's targets, and each block program's, prefixed by its block path)."""
    out: set[str] = set()
    for e in entries:
        run = e.run
        out.update(n.target for n in run.graph.nodes if n.op == "get_attr")
        for prog in run.__dict__.get("_dr_programs", {}).values():
            out.update(f"{prog.path}.{n.target}" for n in prog.graph.nodes if n.op == "get_attr")
    return out


def _ids(dicts: list[dict]) -> list[int]:
    return list(map(id, itertools.chain.from_iterable(map(dict.values, dicts))))


class ModuleTree:
    """The submodule tree when the graphs were captured: ``names[i]``/``mods[i]``/``types[i]`` for every submodule,
    ``children[j]`` a copy of the ``_modules`` dict of ``owners[j]`` (the root, then every submodule), and the
    identities of every parameter and buffer."""

    __slots__ = ("names", "mods", "types", "owners", "children", "hooks", "hook_snapshot", "tensors", "config",
                 "ckpt_owners", "ckpt", "logical")

    def __init__(self, root: nn.Module):
        named = [(n, m) for n, m in root.named_modules() if m is not root]
        self.names = [n for n, _ in named]
        self.mods = [m for _, m in named]
        self.types = list(map(type, self.mods))
        self.owners = [root, *self.mods]
        self.children = [dict(d) for d in map(_children_of, self.owners)]
        # the hook dicts themselves (register_*_hook adds to them in place): any() over them is one C-level pass
        self.hooks = [d for m in self.mods for d in _hooks_of(m)]
        self.hook_snapshot = [dict(d) for d in self.hooks]
        # the parameter and buffer dicts themselves: those holding tensors (their tensors' identities) and the empty
        # ones (any entry added to them is a change)
        dicts = [*map(_params_of, self.owners), *map(_buffers_of, self.owners)]
        self.tensors = ([d for d in dicts if d], [d for d in dicts if not d])
        self.tensors += (_ids(self.tensors[0]),)
        self.config = _config_state(root)
        # activation checkpointing flags (HF's gradient_checkpointing_enable() sets them): export cannot follow them
        self.ckpt_owners = [m for m in self.owners if "gradient_checkpointing" in m.__dict__]
        self.ckpt = [m.__dict__["gradient_checkpointing"] for m in self.ckpt_owners]
        self.logical = self._logical()  # taken now: the modules it reads change in place

    def changed(self, root: nn.Module) -> bool:
        """Whether a submodule was replaced, added or removed, a hook added or removed on one, or a parameter or
        buffer reassigned, since recording. A few C-level passes over lists (about 90 µs for a 32-layer model: docs/contract.md)."""
        return (
            list(map(type, self.mods)) != self.types
            or list(map(_children_of, self.owners)) != self.children  # dict ==: same names, same objects
            or self.hooks != self.hook_snapshot  # the live hook dicts against copies: same keys, same functions
            or any(map(len, self.tensors[1])) or _ids(self.tensors[0]) != self.tensors[2]
            or _config_state(root) != self.config  # output_hidden_states, attention implementation, ... are baked in
            or [m.__dict__.get("gradient_checkpointing") for m in self.ckpt_owners] != self.ckpt
        )

    def _logical(self) -> tuple:
        """The tree as a block runner reads it (:mod:`depthrewrite.blocks`): every submodule object (a replaced one,
        even of the same type, may carry other settings export baked in), except that a wrapper around a converted
        block (checkpoint wrappers, ``torch.compile``'s) is left out, a converted block's class counts as its
        original class (FSDP2 subclasses it) and hooks on blocks are not compared (they fire at run time, around the
        block call); parameters and buffers by name, shape, dtype and which of them are one tensor (tied), not by
        identity (a runner reads them from the live modules at call time, so FSDP2's sharding or a reassigned tensor
        needs no recapture). Two trees with equal ``logical()`` run the same captured graphs."""
        from .blocks import _WRAPPED, ConvertedBlock, original_block_class, unwrap, unwrapped_path

        items = []
        first: dict[int, str] = {}  # tensor identity -> the first name holding it (ties)

        def tensors(prefix: str, d: dict) -> tuple:
            out = []
            for k, v in d.items():
                if v is not None:
                    shape = None if nn.parameter.is_lazy(v) else tuple(v.shape)
                    out.append((k, shape, v.dtype, first.setdefault(id(v), f"{prefix}.{k}")))
            return tuple(out)

        for i, (name, mod, typ) in enumerate(zip(self.names, self.mods, self.types)):
            if any(a in mod._modules for a in _WRAPPED) and isinstance(unwrap(mod), ConvertedBlock):
                continue
            block = isinstance(mod, ConvertedBlock)
            hooks = () if block else tuple(tuple(d.values()) for d in self.hook_snapshot[4 * i:4 * i + 4])
            cname = unwrapped_path(name)
            items.append((
                cname, id(mod), original_block_class(typ) if block else typ, hooks,
                tensors(cname, mod._parameters), tensors(cname, mod._buffers),
            ))
        return tuple(items), self.config

    def user_hooks(self) -> list[tuple[str, Any]]:
        """``(module path, hook)`` for hooks on submodules that no library we know installed (transformers records
        hidden states and attentions with hooks of its own; peft and accelerate install some too)."""
        from .blocks import ConvertedBlock

        out = []
        for name, m in zip(self.names, self.mods):
            if isinstance(m, ConvertedBlock):  # hooks on a block fire at run time, around the block call
                continue
            for d in _hooks_of(m):
                for h in d.values():
                    if not hook_owner(h).startswith(_KNOWN_HOOK_OWNERS):
                        out.append((name, h))
        return out

    def change(self, root: nn.Module) -> tuple[str, str]:
        """The first difference between this record and ``root``'s tree: ``(path, what happened)``."""
        now = _config_state(root)
        if now != self.config:
            keys = sorted(k for k in set(now or {}) | set(self.config or {}) if (now or {}).get(k) != (self.config or {}).get(k))
            return "config", f"changed ({', '.join(keys[:4])})"
        if self.hooks != self.hook_snapshot:
            i = next(i for i, (a, b) in enumerate(zip(self.hooks, self.hook_snapshot)) if a != b)
            return self.names[i // len(_HOOKS)], f"{_HOOK_WORDS[_HOOKS[i % len(_HOOKS)]]} added or removed"
        now = dict(root.named_modules())
        for name, mod, typ in zip(self.names, self.mods, self.types):
            cur = now.get(name)
            if cur is None:
                return name, "removed"
            if cur is not mod:
                return name, f"replaced (by a {type(cur).__name__})"
            if type(cur) is not typ:
                return name, f"changed from a {typ.__name__} to a {type(cur).__name__}"
        known = set(self.names)
        added = next((n for n in now if n and n not in known), None)
        if added is not None:
            return added, f"added (a {type(now[added]).__name__})"
        return "", "a parameter or buffer was reassigned"

    def check_hooks(self) -> None:
        mm = torch.nn.modules.module
        if mm._global_forward_pre_hooks or mm._global_forward_hooks or mm._global_backward_pre_hooks or mm._global_backward_hooks:
            kind = next(fn for attr, fn in _GLOBAL_HOOKS if getattr(mm, attr))
            raise ModuleTreeChangedError(
                f"a global module hook is registered (torch.nn.modules.module.{kind}; FlopCounterMode and "
                "ModuleTracker register one too): it would run for the converted model itself but for none of its "
                "submodules, whose code runs inside a captured graph. Remove the global hook before calling the "
                "converted model.",
                module=None, change="global hook",
            )


# ---- call structures ----------------------------------------------------------------------------------------------


def _describe_leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", x.dtype, x.device, x.dim())
    try:
        hash(x)
    except TypeError:
        return ("obj", type(x).__qualname__)
    if isinstance(x, (bool, int, float, str, type(None))) or x is Ellipsis:
        return ("V", type(x).__name__, x)
    return ("obj", type(x).__qualname__)


def _describe(value: Any) -> Any:
    leaves, spec = pytree.tree_flatten(value)
    if spec.is_leaf():
        return _describe_leaf(value)
    return (str(spec), tuple(map(_describe_leaf, leaves)))


@dataclasses.dataclass
class GraphEntry:
    """One captured and rewritten graph: the call structure it serves, its shape guards and how long capture took."""

    module: fx.GraphModule  # a ConvertedGraphModule (see depthrewrite.converted)
    structure: str  # readable: "train, input_ids: int64[2d], labels: int64[2d]"
    guards: tuple  # per tensor input: {dim: fixed size, or (symbol, lowest, highest or None)}
    seconds: float
    calls: int = 0
    runner: Any = None  # the module a call runs: glue plus one call per block module (depthrewrite.blocks); None: module

    @property
    def run(self) -> fx.GraphModule:
        return self.module if self.runner is None else self.runner

    def matches(self, tensors: list[torch.Tensor]) -> bool:
        if len(tensors) != len(self.guards):
            return False
        symbols: dict[str, int] = {}
        for t, dims in zip(tensors, self.guards):
            for d, g in dims.items():
                if d >= t.dim():
                    return False
                s = int(t.shape[d])
                if isinstance(g, int):
                    if s != g:
                        return False
                else:  # export assumes dynamic sizes are >= 2, within the range the trace allowed, equal per symbol
                    name, lo, hi = g
                    if s < max(2, lo) or (hi is not None and s > hi) or symbols.setdefault(name, s) != s:
                        return False
        return True


def _guards_of(gm: fx.GraphModule) -> tuple:
    out = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        v = n.meta.get("val")
        if not isinstance(v, torch.Tensor):
            continue
        dims: dict[int, Any] = {}
        for d, s in enumerate(v.shape):
            if isinstance(s, torch.SymInt):
                expr = s.node.expr
                if expr.is_number:
                    dims[d] = int(expr)
                elif expr.is_Symbol:
                    dims[d] = (str(expr), *_range(s.node.shape_env, expr))
                else:  # a derived size (2*s0): fixed by the symbols it is made of
                    continue
            else:
                dims[d] = int(s)
        out.append(dims)
    return tuple(out)


def _range(shape_env: Any, expr: Any) -> tuple[int, int | None]:
    """The value range the trace allowed a size symbol (a model's ``if T > 8`` makes T <= 8 a condition of its graph)."""
    r = getattr(shape_env, "var_to_range", {}).get(expr) if shape_env is not None else None
    if r is None:
        return 2, None
    def finite(x: Any) -> int | None:
        try:
            return int(x) if x.is_number and x.is_finite else None
        except Exception:  # noqa: BLE001 - sympy / torch infinities of several kinds
            return None

    lo, hi = finite(r.lower), finite(r.upper)
    return lo if lo is not None else 2, hi if hi is not None and hi < 2**62 else None


def _readable(training: bool, bound: Mapping[str, Any]) -> str:
    def one(x):
        if isinstance(x, torch.Tensor):
            return f"{str(x.dtype).replace('torch.', '')}[{x.dim()}d]"
        if is_cache(x):
            return f"{type(x).__name__}({x.get_seq_length()} cached)"
        if isinstance(x, (bool, int, float, str)):
            return repr(x)
        return type(x).__name__

    return ", ".join(["train" if training else "eval", *(f"{k}={one(v)}" for k, v in bound.items())])


# ---- threads ------------------------------------------------------------------------------------------------------


class _CaptureLock:
    """Captures run alone; calls that need none run concurrently (a server's thread pool).

    A capture is not confined to its thread: ``torch.export`` (non-strict) patches ``nn.Module.__call__`` and other
    process-wide state while it traces, and the model being captured runs as its original class meanwhile. So every
    call of a converted model holds this lock *shared* (:meth:`ConvertedModel.__call__`, before ``nn.Module.__call__``
    runs), and a capture holds it *exclusive*: it waits until no other thread is inside a converted model, and new
    calls wait at the door until it is done. A thread waiting to capture lets go of its own shared holds meanwhile (two
    calls that both need a capture take turns instead of waiting for each other), and new calls give way to a waiting
    capture. ``mutex`` guards the graph dicts and the module-tree record (:meth:`ConversionState.select`). One lock for
    the process: the state export patches is the process's."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._shared = 0  # shared holds, all threads (a thread waiting to capture does not count its own)
        self._owner: int | None = None  # the thread capturing
        self._depth = 0  # its nested exclusive holds
        self._waiting = 0  # threads waiting to capture
        self._mine = threading.local()  # .n: this thread's shared holds
        self.mutex = threading.RLock()

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            mine = getattr(self._mine, "n", 0)
            while self._owner not in (None, me) or (self._waiting and not mine and self._owner is None):
                self._cond.wait()
            self._shared += 1
            self._mine.n = mine + 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._mine.n -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            if self._owner != me:
                mine = getattr(self._mine, "n", 0)
                self._shared -= mine
                self._waiting += 1
                self._cond.notify_all()
                try:
                    while self._owner is not None or self._shared > 0:
                        self._cond.wait()
                except BaseException:  # interrupted while waiting: take the own holds back, give way again
                    self._waiting -= 1
                    self._shared += mine
                    self._cond.notify_all()
                    raise
                self._waiting -= 1
                self._owner = me
            self._depth += 1
        try:
            yield
        finally:
            with self._cond:
                self._depth -= 1
                if not self._depth:
                    self._owner = None
                    self._shared += getattr(self._mine, "n", 0)
                self._cond.notify_all()


_LOCK = _CaptureLock()


# ---- the conversion state -----------------------------------------------------------------------------------------


class ConversionState:
    """Everything depthrewrite keeps on a converted model (``model.__dict__["_depthrewrite"]``): the recipe (scheme
    config, original class and signature, example inputs, pipeline stages), the report of the first capture, and the
    captured graphs per call structure (dropped in copies, recaptured on use)."""

    def __init__(self, original: type, config: Any, example: tuple[tuple, dict], signature: _inspect.Signature | None):
        self.original = original
        self.config = config
        self.example = example
        self.signature = signature
        self.report: Any = None
        self.sites: tuple | None = None  # (site, sources) per change of the first capture: every later one must match
        self.pipeline_stages: int | None = None
        self.pipeline_kw: dict = {}
        self.graphs: dict[tuple, list[GraphEntry]] = {}
        self.tree: ModuleTree | None = None
        self.captures = 0  # graphs captured so far (including dropped ones)
        self.recaptures = 0  # times the module tree changed and every graph was dropped
        self.last: dict[bool, GraphEntry] = {}  # the graph the last call in each mode ran
        self.blocks: tuple[str, ...] | None = None  # the block modules' paths, once the graphs call them
        self.blocks_note: str | None = None  # why the flat graph runs instead (no block modules, pipeline stages)
        self.checkpoint = False  # convert(..., checkpoint=True): recompute every block in backward
        self.module_calls = False  # convert(..., module_calls=True / None): intact modules called as live modules (#24)
        self.module_calls_asked = False  # module_calls=True: a module whose call cannot be kept is an error
        self.ckpt_parents: list[nn.Module] = []  # ancestors of the blocks with an HF-style gradient_checkpointing flag
        self.block_infos: tuple = ()  # the report's block table (depthrewrite.blocks.BlockInfo), from the first runner

    def __getstate__(self):
        state = dict(self.__dict__)
        state["graphs"], state["tree"], state["last"] = {}, None, {}
        return state

    def __deepcopy__(self, memo):
        out = object.__new__(ConversionState)
        memo[id(self)] = out
        out.__dict__.update(copy.deepcopy(self.__getstate__(), memo))
        return out

    # -- the captured graphs

    def entries(self) -> list[GraphEntry]:
        return [e for es in self.graphs.values() for e in es]

    def drop_graphs(self) -> None:
        self.graphs.clear()
        self.last.clear()
        self.tree = None

    # -- a call

    def bind(self, args: tuple, kwargs: dict) -> OrderedDict:
        """The call's arguments by parameter name (``**kwargs`` spread out), without ``None`` where ``None`` is the
        default (passing it and leaving it out are the same call)."""
        sig = self.signature
        if sig is None:
            return OrderedDict([*((f"args[{i}]", a) for i, a in enumerate(args)), *kwargs.items()])
        try:
            bound = sig.bind(*args, **kwargs).arguments
        except TypeError as e:
            raise ConfigError(f"the converted {self.original.__name__} takes the original forward's arguments: {e}") from e
        out = OrderedDict()
        for k, v in bound.items():
            p = sig.parameters[k]
            if p.kind is p.VAR_KEYWORD:
                out.update((kk, vv) for kk, vv in v.items() if vv is not None)
            elif p.kind is p.VAR_POSITIONAL:
                out.update((f"{k}[{i}]", vv) for i, vv in enumerate(v))
            elif v is None and p.default is None:
                continue
            else:
                out[k] = v
        return out

    def split_call(self, bound: OrderedDict) -> tuple[tuple, dict]:
        """``(args, kwargs)`` to capture and call with: positional-only parameters positionally, the rest by name."""
        sig = self.signature
        if sig is None:
            pos = tuple(v for k, v in bound.items() if k.startswith("args["))
            return pos, {k: v for k, v in bound.items() if not k.startswith("args[")}
        pos, kw = [], {}
        for k, v in bound.items():
            p = sig.parameters.get(k.split("[")[0])
            if p is not None and p.kind in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL):
                pos.append(v)
            else:
                kw[k] = v
        return tuple(pos), kw

    def key(self, model: nn.Module, bound: OrderedDict) -> tuple:
        ref = _ref_param(model)
        return (
            bool(model.training),
            (ref.dtype, ref.device) if ref is not None else None,
            tuple((k, _describe(v)) for k, v in bound.items()),
        )

    def check_tree(self, model: nn.Module) -> None:
        tree = self.tree
        if tree is None:
            self.tree = ModuleTree(model)
            tree = self.tree
            if not self.module_calls:  # with module calls, a hooked module is called or refused
                _warn_user_hooks(tree)
        elif CHECK_MODULE_TREE and tree.changed(model) and not self._same_logic(model):
            path, change = tree.change(model)
            log.info("depthrewrite: %s: module tree changed (%s %s); recapturing", self.original.__name__, path, change)
            self.drop_graphs()
            self.tree = ModuleTree(model)
            tree = self.tree
            self.recaptures += 1
            if not self.module_calls:  # with module calls, a hooked module is called or refused
                _warn_user_hooks(tree)
        if CHECK_MODULE_TREE:
            tree.check_hooks()

    def _same_logic(self, model: nn.Module) -> bool:
        """After a change to the module tree: whether the block runners read the new tree as the old one (a block
        wrapped for checkpointing or compile, sharded with FSDP2, hooked; a parameter reassigned). Then the new tree
        is recorded and the graphs are kept."""
        if self.blocks is None or self.pipeline_stages is not None:
            return False
        new = ModuleTree(model)
        if new.logical != self.tree.logical:
            return False
        wrapped = self._subclass_read_inline(model)
        if wrapped is not None:  # its graphs read it as aten ops a tensor subclass may not implement: recapture
            log.info("depthrewrite: %s: %s is now a %s read by the graphs' own ops; recapturing",
                     self.original.__name__, *wrapped)
            return False
        self.tree = new
        return True

    def _subclass_read_inline(self, model: nn.Module) -> tuple[str, str] | None:
        """``(path, type name)`` of a parameter or buffer the captured graphs read directly (a ``get_attr`` of the
        runner or of a block program, not inside a module call) that is now a tensor subclass (torchao's
        ``quantize_`` swaps weights for ``Int8Tensor`` and the like): the graphs' aten ops (``aten.linear`` runs as
        ``t`` + ``mm`` below ``__torch_function__``) may not be implemented by it, so the graph is captured again,
        through the subclass. A module called live sees ``F.linear`` and needs nothing. DTensors are left to the
        tensor-parallel checks."""
        from .blocks import unwrap

        for path in _direct_reads(self.entries()):
            t: Any = model
            for part in path.split("."):  # through wrappers (checkpoint_wrapper, compile), as the graphs read it
                t = getattr(unwrap(t) if isinstance(t, nn.Module) else t, part, None)
            if isinstance(t, torch.Tensor) and type(t) not in _PLAIN and not is_dtensor(t):
                return path, type(t).__name__
        return None

    def select(self, model: nn.Module, args: tuple, kwargs: dict, *, capture: bool = True,
               fresh: bool = False) -> tuple[GraphEntry, tuple, dict]:
        """The graph for this call (captured if there is none yet) and the call's ``(args, kwargs)`` for it. While
        traced (``capture=False``) the module tree is not checked: the tracer (pipelining's export, Dynamo) may wrap
        the model, and no graph can be captured inside a trace anyway."""
        with _LOCK.mutex:
            found = self._lookup(model, args, kwargs, capture=capture, fresh=fresh)
        if found[0] is not None or not capture:
            return found[:3]
        with _LOCK.exclusive():  # no other thread inside a converted model until the graph is captured
            with _LOCK.mutex:  # another thread may have captured this structure meanwhile
                found = self._lookup(model, args, kwargs, capture=True, fresh=fresh)
            entry, pos, kw, key, bound = found
            if entry is not None:
                return entry, pos, kw
            entry = self.capture(model, pos, kw, _readable(bool(model.training), bound))
            with _LOCK.mutex:
                entries = self.graphs.setdefault(key, [])
                entries.insert(0, entry) if fresh else entries.append(entry)  # fresh: before the one that did not fit
        return entry, pos, kw

    def _lookup(self, model: nn.Module, args: tuple, kwargs: dict, *, capture: bool, fresh: bool) -> tuple:
        """``(entry or None, args, kwargs, key, bound)``: the graph for this call among those captured."""
        if capture:
            self.check_tree(model)
        bound = self.bind(args, kwargs)
        pos, kw = self.split_call(bound)
        if any(map(is_cache, bound.values())):
            from .capture import register_cache_support

            register_cache_support()  # before the key: the cache's layout is part of the call structure
        key = self.key(model, bound)
        tensors = [x for x in pytree.tree_leaves((pos, kw)) if isinstance(x, torch.Tensor)]
        for entry in self.graphs.get(key, ()) if not fresh else ():
            if entry.matches(tensors):
                return entry, pos, kw, key, bound
        if not capture:  # inside a trace: the fake shapes are the tracer's; the call structure must be one we have
            entries = self.graphs.get(key)
            if not entries:
                raise DepthRewriteError(
                    f"the converted {self.original.__name__} has no graph for this call structure "
                    f"({_readable(bool(model.training), bound)}) and cannot capture one while it is being traced "
                    "(torch.export, pipelining's pipeline()): call it once eagerly with the same kind of inputs first."
                )
            return entries[0], pos, kw, key, bound
        return None, pos, kw, key, bound

    def capture(self, model: nn.Module, args: tuple, kwargs: dict, structure: str) -> GraphEntry:
        from .api import capture_and_rewrite

        with _LOCK.exclusive():
            t0 = time.perf_counter()
            gm, result = capture_and_rewrite(model, self, args, kwargs)
            self.captures += 1
            if self.pipeline_stages is not None:
                from .pipeline import split

                split(gm, self.pipeline_stages, **self.pipeline_kw)
            runner = self.keep_blocks(model, gm)
        self.tree = ModuleTree(model)  # the first capture adds model.depthrewrite
        guards = _guards_of(gm)
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)]
        fixed = [f"{name}.shape[{d}]={g}" for name, dims in zip(names, guards) for d, g in dims.items()
                 if isinstance(g, int) and d < 2 and "cache" not in name]
        if fixed:  # dimensions export specialised: this graph runs those sizes only
            structure += f" ({', '.join(fixed)})"
        entry = GraphEntry(module=gm, structure=structure, guards=guards, seconds=time.perf_counter() - t0,
                           runner=runner)
        log.info("depthrewrite: captured a graph for %s (%s) in %.2f s", self.original.__name__, structure, entry.seconds)
        return entry

    def keep_blocks(self, model: nn.Module, gm: fx.GraphModule) -> fx.GraphModule | None:
        """The block runner of ``gm`` (:mod:`depthrewrite.blocks`): the graph as glue plus one call per block module;
        None when the flat graph runs (no block modules). Pipeline stage markers are left out of the runner (they are
        no-ops when it runs; pipelining traces and :func:`depthrewrite.pipeline.stages` cut the flat graph).

        Raises:
            ConfigError: the flat graph runs while activation checkpointing is on in a training call.
        """
        runner = self._block_runner(model, gm)
        if runner is None and model.training:
            ckpt = next((n for n, m in model.named_modules() if m.__dict__.get("gradient_checkpointing") is True), None)
            if ckpt is not None:
                raise ConfigError(
                    f"activation checkpointing is on in {self.original.__name__} ({ckpt or 'the model'}"
                    f".gradient_checkpointing), but the converted model runs one flat graph ({self.blocks_note}), in "
                    "which nothing can be recomputed per block: it is refused rather than silently dropped. Call "
                    "gradient_checkpointing_disable() to train without it."
                )
            # torch's checkpoint_wrapper / apply_activation_checkpointing (torchtitan's apply_ac, torchtune's
            # set_activation_checkpointing, OLMo-core use it): export traces through the wrapper, recomputing nothing
            wrapped = [n for n, m in model.named_modules() if "_checkpoint_wrapped_module" in m._modules]
            if wrapped:
                raise ConfigError(
                    f"{self.original.__name__}.{wrapped[0]}{f' and {len(wrapped) - 1} more' if len(wrapped) > 1 else ''}"
                    " is wrapped for activation checkpointing (checkpoint_wrapper / apply_activation_checkpointing), "
                    f"but the converted model runs one flat graph ({self.blocks_note}), in which nothing can be "
                    "recomputed per block: it is refused rather than silently dropped. Train without the wrappers."
                )
        return runner

    def _block_runner(self, model: nn.Module, gm: fx.GraphModule) -> fx.GraphModule | None:
        from .blocks import block_infos, build_runner, convert_blocks, share_live
        from .converted import as_converted

        paths = gm.meta.get("depthrewrite_blocks")
        if isinstance(paths, str) or not paths:  # no block modules: the reason
            runner, why = None, paths or "no blocks"
        else:
            if self.blocks is None:
                _check_block_hooks(model, paths)
            runner, why = build_runner(gm, model, paths, self.checkpointing)
        if runner is None:
            if self.blocks is not None:
                raise DepthRewriteError(
                    f"the converted {self.original.__name__} calls its blocks as modules, but this call structure's "
                    f"graph cannot be split into block calls: {why}. Please report it with the model and the call."
                )
            self.blocks_note = why
            return None
        convert_blocks(model, paths)
        args, kwargs = gm.meta["depthrewrite_inputs"]
        as_converted(runner, model, self.signature, args, kwargs, self.report)
        if self.blocks is None:
            self.blocks = tuple(paths)
            self.ckpt_parents = _checkpoint_parents(model, paths)
            self.block_infos = block_infos(gm, runner.__dict__["_dr_programs"],
                                           gm.meta.get("depthrewrite_block_of_site"), self.report.chain.source)
        share_live(gm, model)  # the flat graph (inspection, export traces, pipeline stages): the live modules too
        return runner

    def checkpointing(self, block: nn.Module) -> bool:
        """Whether depthrewrite checkpoints ``block`` itself in a training call (HF's own layers checkpoint
        themselves when their ``gradient_checkpointing`` flag is on)."""
        flag = getattr(block, "gradient_checkpointing", None)
        if flag is True:
            return False
        if self.checkpoint:
            return True
        if flag is not None:
            return False
        return any(m.__dict__.get("gradient_checkpointing") is True for m in self.ckpt_parents)

    def call(self, model: nn.Module, args: tuple, kwargs: dict) -> Any:
        caches = [v for v in (*args, *kwargs.values()) if is_cache(v)]
        if caches:
            _check_cache(caches[0], self.original.__name__)
        exporting = torch.compiler.is_exporting() and _traced(args, kwargs)  # the flag is the process's, not ours
        if exporting:  # inside torch.export (pipelining's tracer): use a graph we have
            entry, pos, kw = self.select(model, args, kwargs, capture=False)
        elif torch.compiler.is_dynamo_compiling():  # Dynamo: choose (and capture) eagerly, trace the chosen graph
            entry, pos, kw = _select_eagerly(self, model, args, kwargs)
        else:
            entry, pos, kw = self.select(model, args, kwargs)
        guard = entry.module.meta.get(CONTINUATION_META)
        if guard is not None and not exporting and not torch.compiler.is_dynamo_compiling():
            _check_continuation(guard, pos, kw, self.original.__name__)
        if caches and entry.module.meta.get(HISTORY_META) and caches[0].get_seq_length() > 0 \
                and not caches[0].__dict__.get(_EXTRA):
            raise ConfigError(
                f"the KV cache passed to the converted {self.original.__name__} holds {caches[0].get_seq_length()} "
                "tokens but no decoding state of this conversion (MSAR's conv history): it was filled by another model "
                "(the unconverted one?) or rebuilt from tensors. Fill it with the converted model (prefill with it), or "
                "call with use_cache=False."
            )
        tracing = exporting or torch.compiler.is_dynamo_compiling()
        try:
            out = (entry.module if exporting else entry.run)(*pos, **kw)
        except RuntimeError as e:
            # export's own input check (a relation between sizes our guards do not model, e.g. a cache length derived
            # from the new tokens at a sliding window's edge) fails before anything runs: this call gets its own graph
            if "Expected input at" not in str(e) or tracing:
                raise
            entry, pos, kw = self.select(model, args, kwargs, fresh=True)
            out = entry.run(*pos, **kw)
        self.last[bool(model.training)] = entry
        entry.calls += 1
        history = None
        if entry.module.meta.get(HISTORY_META):
            out, history = out
        if caches:
            tokens = next((kw[k] for k in ("input_ids", "inputs_embeds") if isinstance(kw.get(k), torch.Tensor)), None)
            out = _write_back(caches[0], out, tokens.shape[1] if tokens is not None and tokens.dim() >= 2 else None)
        if history is not None:
            target = caches[0] if caches else _output_cache(out)[0]
            store_history(target, history)
            target.__dict__[_SEEN] = target.get_seq_length()
        return out


def _traced(args: tuple, kwargs: dict) -> bool:
    """Whether this call is being traced (Dynamo, or torch.export with fake inputs) rather than run: per call, since
    torch's is_exporting()/is_compiling() flags are the process's and are on while another thread captures."""
    if torch.compiler.is_dynamo_compiling():
        return True
    if not torch.compiler.is_exporting():
        return False
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(x, FakeTensor) for x in pytree.tree_leaves((args, kwargs)))


_WARNED: set = set()


def warn_traced_hooks(model: nn.Module) -> None:
    """:func:`_warn_user_hooks` for ``model``'s tree now (a graph captured with its hooks traced)."""
    _warn_user_hooks(ModuleTree(model))


def _warn_user_hooks(tree: ModuleTree) -> None:
    """Hooks on submodules are traced into the captured graphs, as torch.export and torch.compile trace them: what a
    hook returns (or changes in its module's inputs and outputs) is followed on every call, but its other side effects
    (appending to a list, counting calls) happen once, at capture. Said once per hook."""
    import warnings

    for name, h in tree.user_hooks():
        if id(h) in _WARNED:
            continue
        _WARNED.add(id(h))
        warnings.warn(
            f"depthrewrite: the hook {getattr(h, '__qualname__', type(h).__name__)} on {name!r} is traced into the "
            "converted model's graph (as torch.export traces it): its effect on the module's inputs and outputs is "
            "followed on every call, but its other side effects (recording activations into a list, counting calls) "
            "happen only when the graph is captured. Register such hooks on the converted model itself, or use "
            "output_hidden_states=True.",
            stacklevel=4,
        )


@torch._dynamo.disable
def _select_eagerly(st: ConversionState, model: nn.Module, args: tuple, kwargs: dict):
    """:meth:`ConversionState.select` outside Dynamo's trace (a graph break): the module-tree check and a capture run
    as in eager mode, and Dynamo guards on the graph module returned."""
    entry, pos, kw = st.select(model, args, kwargs)
    if entry.runner is not None:  # Dynamo copies our node tags (again after torch._dynamo.reset(), which forgets)
        from .blocks import traced_with_meta

        traced_with_meta(entry.runner)
    return entry, pos, kw


def _check_block_hooks(model: nn.Module, paths: tuple[str, ...]) -> None:
    """Hooks on a block registered before conversion were written for the block's original inputs; on a converted
    block they fire around its new call (the program, then the depth state): ConfigError."""
    from .blocks import _get

    for p in paths:
        blk = _get(model, p)
        for attr in HOOK_ATTRS:
            for h in getattr(blk, attr).values():
                if not traced_hook(h):
                    if hook_owner(h).startswith("torch.distributed"):
                        raise ConfigError(
                            f"{p} is already sharded or wrapped by torch.distributed (fully_shard before convert?). "
                            "Convert first, then apply fully_shard / checkpointing per block (docs/training.md)."
                        )
                    raise ConfigError(
                        f"{p} has {_HOOK_WORDS[attr]} ({getattr(h, '__qualname__', type(h).__name__)}) registered "
                        "before conversion. A converted model calls its blocks as modules with new inputs and outputs "
                        "(the depth state), so a hook written for the original block would see other values. Remove "
                        "it before convert() and register it afterwards (it then fires once per call, around the block "
                        "call), or register it on a module inside the block (it is traced into the block's program)."
                    )


def _checkpoint_parents(model: nn.Module, paths: tuple[str, ...]) -> list[nn.Module]:
    """The model and the modules above its blocks that have a ``gradient_checkpointing`` attribute (models whose own
    loop checkpoints its layers when it is on)."""
    from .blocks import _get

    out: list[nn.Module] = []
    for p in paths:
        parts = p.split(".")
        for i in range(len(parts)):
            m = _get(model, ".".join(parts[:i]))
            if m is not None and hasattr(m, "gradient_checkpointing") and all(m is not o for o in out):
                out.append(m)
    return out


def _ref_param(model: nn.Module) -> torch.Tensor | None:
    return next((p for p in model.parameters() if p.is_floating_point()), None)


def _check_cache(cache: Any, name: str) -> None:
    """A cache a captured graph cannot continue (a full sliding window; MSAR state of a cropped cache): ConfigError."""
    from .capture import cache_problem

    problem = cache_problem(cache)
    if problem is not None:
        raise ConfigError(problem)
    if cache.__dict__.get(_EXTRA) and cache.get_seq_length() != cache.__dict__.get(_SEEN):
        raise ConfigError(
            f"the KV cache passed to the converted {name} holds {cache.get_seq_length()} tokens, but its decoding state "
            f"(MSAR's conv history) was written after {cache.__dict__.get(_SEEN)}: the cache was cropped or edited "
            "(assisted decoding's crop()), and the state cannot be rolled back. Decode without cropping, or with "
            "use_cache=False."
        )


def _check_continuation(guard: tuple, args: tuple, kwargs: dict, name: str) -> None:
    """A graph that writes state into the model's own buffers (a model-managed KV cache) while the scheme mixes across
    tokens: a call that starts a sequence (its write positions start at 0) is exact; one that continues a sequence
    held in those buffers would be computed as if it were a fresh sequence, so it is refused (ConfigError)."""
    writes, why = guard
    tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    indexed = [w for w in writes if w.positions_index is not None and w.positions_index < len(tensors)]
    if indexed and len(indexed) == len(writes):
        pos = tensors[indexed[0].positions_index]
        if pos.numel() == 0 or (pos.dim() == 0 and int(pos) == 0) or \
                (pos.dim() > 0 and bool(pos.reshape(-1, pos.shape[-1])[:, 0].eq(0).all())):  # every row from 0
            return
        where = (f"at positions {indexed[0].positions} = {pos.flatten()[:4].tolist()}"
                 f"{'...' if pos.numel() > 4 else ''}, after earlier tokens")
    else:
        where = "at positions computed inside the model from its own buffers, so a new sequence cannot be told from a " \
                "continuation"
    names = list(dict.fromkeys(w.buffer for w in writes))
    buffers = ", ".join(names[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")
    raise ConfigError(
        f"the converted {name} would continue a sequence held in the model's own KV cache ({buffers}, written in "
        f"place {where}), but with {why}, and those earlier positions are neither passed to this call nor kept by the "
        "conversion for a cache the model manages itself: the result would be computed as if the new tokens began "
        "a sequence. Recompute the whole sequence on every step instead (call without the cache: do not set it up, "
        "or clear it, e.g. litgpt's model.clear_kv_cache(), and pass no positions), or convert with a scheme that "
        "mixes each token's own values only (attnres, mhc)."
    )


def _output_cache(out: Any) -> tuple[Any, Any]:
    """``(cache, where)``: the KV cache object in a model output (a ``ModelOutput`` field, or an element of the tuple
    ``return_dict=False`` gives) and its key or index; ``(None, None)`` when there is none."""
    if hasattr(out, "items") and hasattr(out, "keys"):  # ModelOutput (an OrderedDict)
        for k, v in out.items():
            if is_cache(v):
                return v, k
        return None, None
    if isinstance(out, (tuple, list)):
        for i, v in enumerate(out):
            if is_cache(v):
                return v, i
    return None, None


def _write_back(cache: Any, out: Any, new_tokens: int | None = None) -> Any:
    """Put the graph's new cache tensors into the caller's cache object (HF updates caches in place) and return the
    output with that object in place of the graph's copy. Layers the caller's cache lacks (a ``DynamicCache()`` made
    without a config grows as it is updated) are added first."""
    new, where = _output_cache(out)
    if new is None or new is cache:
        return out
    layers_in, layers_out = getattr(cache, "layers", None), getattr(new, "layers", None)
    seen = {id(la): la.cumulative_length for la in (layers_in or ()) if getattr(la, "is_initialized", False)
            and hasattr(la, "cumulative_length")}
    if layers_in is None or layers_out is None:
        raise DepthRewriteError(
            f"depthrewrite: cannot write the new KV cache back into the caller's {type(cache).__name__} (no layers)"
        )
    extra = cache.__dict__.get(_EXTRA, 0)  # decoding state after the model's layers: passed through, stored apart
    own = len(layers_in) - extra
    layers_out = list(layers_out)[: len(layers_out) - extra]
    if own < len(layers_out):
        if extra:
            raise DepthRewriteError(
                f"depthrewrite: the caller's cache has {own} model layers and decoding state after them; the model "
                f"returned {len(layers_out)} layers"
            )
        for lo in layers_out[own:]:
            window = getattr(lo, "sliding_window", None)
            layers_in.insert(own, type(lo)(sliding_window=window) if window is not None else type(lo)())
            own += 1
    for li, lo in zip(layers_in[:own], layers_out):
        if getattr(lo, "keys", None) is None:
            continue
        if type(li) is not type(lo):
            raise DepthRewriteError(
                f"depthrewrite: layer of type {type(lo).__name__} returned for the caller's {type(li).__name__}"
            )
        if not getattr(li, "is_initialized", True):
            li.lazy_initialization(lo.keys, lo.values)
        li.keys, li.values = lo.keys, lo.values
        if hasattr(lo, "cumulative_length"):  # a sliding window counts every token, also those it no longer keeps
            li.cumulative_length = seen.get(id(li), 0) + new_tokens if new_tokens is not None else lo.cumulative_length
    if isinstance(where, int):
        out = type(out)(cache if i == where else v for i, v in enumerate(out))
    else:
        out[where] = cache
    return out


_EXTRA = "_depthrewrite_extra_layers"
_SEEN = "_depthrewrite_cached_tokens"  # the cache's length when the decoding state was last written


def history_of(cache: Any) -> list[torch.Tensor]:
    """The decoding state a converted model keeps in ``cache`` (MSAR's conv history): the keys then values of the
    extra layers it appended after the model's own, in order; ``[]`` when there are none."""
    n = cache.__dict__.get(_EXTRA, 0) if cache is not None else 0
    if not n:
        return []
    return [t for layer in cache.layers[-n:] for t in (layer.keys, layer.values)]


def store_history(cache: Any, history: list[torch.Tensor]) -> None:
    """Keep ``history`` (``[B, 1, k-1, D]`` tensors) in ``cache`` as extra layers after the model's own, two tensors
    per layer, so ``reorder_cache`` (beam search) and ``batch_select_indices`` treat it as the rest of the cache."""
    if cache is None:
        raise DepthRewriteError(
            "depthrewrite: the converted model returned decoding state but the call has no KV cache object to keep it in"
        )
    from transformers.cache_utils import DynamicLayer

    tensors = list(history) + ([torch.zeros_like(history[-1])] if len(history) % 2 else [])
    n = len(tensors) // 2
    have = cache.__dict__.get(_EXTRA, 0)
    if have not in (0, n):
        raise DepthRewriteError(f"depthrewrite: the cache holds {have} layers of decoding state, this call returns {n}")
    if not have:
        for _ in range(n):
            layer = DynamicLayer()
            layer.lazy_initialization(tensors[0], tensors[1])
            cache.layers.append(layer)
        cache.__dict__[_EXTRA] = n
    for layer, k, v in zip(cache.layers[-n:], tensors[0::2], tensors[1::2]):
        layer.keys, layer.values = k, v


def state_of(model: nn.Module) -> ConversionState:
    st = model.__dict__.get("_depthrewrite")
    if st is None:
        raise ConfigError(f"{type(model).__name__} is not a model converted by depthrewrite.convert()")
    return st


def is_converted(model: Any) -> bool:
    """Whether ``model`` was converted by :func:`depthrewrite.convert`."""
    return isinstance(model, ConvertedModel)


@contextlib.contextmanager
def as_original(model: nn.Module) -> Iterator[nn.Module]:
    """Run ``model`` as its original class (for capture): the class and the root's own hooks are put back after."""
    st = state_of(model)
    cls = type(model)
    hooks = {a: getattr(model, a) for a in (
        "_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
    ) if hasattr(model, a)}
    own_forward = model.__dict__.pop("forward", None)  # accelerate's hook wraps forward on the instance
    model.__class__ = _capture_class(st.original)
    for a in hooks:
        setattr(model, a, OrderedDict())
    model.__dict__[_CAPTURING] = threading.get_ident()
    try:
        yield model
    finally:
        model.__dict__.pop(_CAPTURING, None)
        model.__class__ = cls
        for a, v in hooks.items():
            setattr(model, a, v)
        if own_forward is not None:
            model.__dict__["forward"] = own_forward


# ---- the class ----------------------------------------------------------------------------------------------------


def _report_of(st: ConversionState):
    """:meth:`ConvertedModel.report` (under the graph mutex)."""
    notes = st.report.notes
    if st.blocks is None and st.blocks_note:
        notes += (f"blocks are not called as modules (FSDP2 per block, checkpointing and compile per block do not "
                  f"apply): {st.blocks_note}",)
    if st.recaptures:
        notes += (f"the module tree changed {st.recaptures} time(s) since conversion (a replaced submodule, a hook, "
                  f"peft, .to(), a config attribute): every graph was dropped and recaptured; {st.captures} "
                  "captured in all",)
    return dataclasses.replace(st.report, notes=notes, blocks=st.block_infos, graphs=tuple(
        (e.structure, e.seconds, e.calls) for e in st.entries()
    ))


class ConvertedModel(nn.Module):
    """What a converted model's class adds to the original class (``type(model).__mro__`` is ``(Converted,
    ConvertedModel, Original, ...)``; the class keeps the original's name and gets its ``forward`` from
    :func:`converted_class`)."""

    def __call__(self, *args, **kwargs):
        # shared hold of the capture lock around the whole call, before nn.Module.__call__ (which a capture in another
        # thread may have patched): calls run concurrently, never during another thread's capture (_CaptureLock)
        if _traced(args, kwargs):
            return super().__call__(*args, **kwargs)
        with _LOCK.shared():
            return super().__call__(*args, **kwargs)

    # -- inspection

    def report(self):
        """The :class:`~depthrewrite.views.report.ConvertReport` of this conversion, with the graphs captured so far."""
        st = state_of(self)
        with _LOCK.mutex:  # another thread may be adding a graph
            return _report_of(st)

    def graph_module(self, training: bool | None = None) -> fx.GraphModule:
        """The converted graph module the last call in ``training`` mode (default: the current mode) ran; the one
        captured at conversion before any call. Captures one from the example inputs when there is none in that
        mode yet."""
        st = state_of(self)
        mode = bool(self.training if training is None else training)
        with _LOCK.mutex:  # another thread may be adding a graph
            entry = st.last.get(mode)
            if entry is None:
                entry = next((e for k, es in st.graphs.items() if k[0] == mode for e in list(es)), None)
        if entry is None:
            was = self.training
            try:
                self.train(mode)
                args, kwargs = st.example
                entry, _, _ = st.select(self, args, kwargs)
            finally:
                self.train(was)
        return entry.module

    @property
    def graph(self) -> fx.Graph:
        """The rewritten graph of the current mode (see :meth:`graph_module`)."""
        return self.graph_module().graph

    @property
    def graphs(self) -> Mapping[bool, fx.Graph]:
        """``{True: training graph, False: eval graph}`` of the example call structure (captured when missing)."""
        return {mode: self.graph_module(mode).graph for mode in (True, False)}

    @property
    def pipeline_cuts(self) -> tuple[int, ...] | None:
        return self.graph_module().pipeline_cuts

    # -- save and load

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Save the model (its own ``save_pretrained`` for a Hugging Face model, else ``model.safetensors`` of the
        state dict) plus ``depthrewrite.json`` (scheme, config, version, original class); load it with
        :func:`depthrewrite.from_pretrained`."""
        from .saving import save_pretrained

        return save_pretrained(self, save_directory, *args, **kwargs)

    # -- copies

    def __reduce_ex__(self, protocol):
        # the converted class is made per original class at run time: rebuild it, then nn.Module.__setstate__
        return _new_converted, (state_of(self).original,), dict(self.__dict__)

    def __deepcopy__(self, memo):
        out = _new_converted(state_of(self).original)
        memo[id(self)] = out
        out.__dict__.update(copy.deepcopy(dict(self.__dict__), memo))
        return out

    def __repr__(self) -> str:
        st = self.__dict__.get("_depthrewrite")
        text = super().__repr__()
        if st is None:
            return text
        return f"{text}\n(converted by depthrewrite: {st.config.describe(getattr(st.report, 'block_size', None))}, " \
               f"{len(st.entries())} graph(s) captured)"


_CLASSES: dict[type, type] = {}


def converted_class(original: type) -> type:
    """The converted class of ``original``: a subclass with :class:`ConvertedModel` first, the original's name and
    module, and a ``forward`` with the original signature (HF ``generate()``, ``Trainer`` and peft read it)."""
    cls = _CLASSES.get(original)
    if cls is not None:
        return cls

    def forward(self, *args, **kwargs):
        return state_of(self).call(self, args, kwargs)

    cls = _subclass(original, (ConvertedModel, original), forward)
    _CLASSES[original] = cls
    return cls


def _subclass(original: type, bases: tuple, forward: Any, **attrs: Any) -> type:
    """A class with ``bases``, ``original``'s name, module and docs, and ``forward`` with the original signature."""
    try:
        forward.__signature__ = _inspect.signature(original.forward)
    except (TypeError, ValueError):
        pass
    forward.__doc__ = original.forward.__doc__
    forward.__qualname__ = f"{original.__qualname__}.forward"
    return type(original.__name__, bases, {
        "forward": forward, "__module__": original.__module__, "__qualname__": original.__qualname__,
        "__doc__": original.__doc__, **attrs,
    })


_CAPTURE_CLASSES: dict[type, type] = {}
# set in a model's __dict__ while it is captured (as_original): the capturing thread. In __dict__, not by identity:
# export's tracer calls modules through proxy objects of another identity that share the module's __dict__
_CAPTURING = "_depthrewrite_capturing"


def _capture_class(original: type) -> type:
    """The class a converted model has while it is captured (:func:`as_original`): the original class, except that
    ``forward`` runs the original forward only in the capturing thread. A call from another thread meanwhile (the
    class is the object's, not the thread's) goes to the converted forward, which waits for the capture to end
    (:class:`_CaptureLock`)."""
    cls = _CAPTURE_CLASSES.get(original)
    if cls is not None:
        return cls

    def forward(self, *args, **kwargs):
        if self.__dict__.get(_CAPTURING) == threading.get_ident():
            return original.forward(self, *args, **kwargs)
        return state_of(self).call(self, args, kwargs)

    def __call__(self, *args, **kwargs):
        if self.__dict__.get(_CAPTURING) == threading.get_ident():
            return nn.Module.__call__(self, *args, **kwargs)
        with _LOCK.shared():  # another thread: wait until the capture is over and the class is back, then call again
            pass
        return self(*args, **kwargs)

    cls = _subclass(original, (original,), forward, __call__=__call__)
    _CAPTURE_CLASSES[original] = cls
    return cls


def _new_converted(original: type) -> nn.Module:
    """An empty instance of ``original``'s converted class: what unpickling and deepcopy make first."""
    return object.__new__(converted_class(original))
