"""The module-tree fingerprint a converted model compares on every call (step 1 of :mod:`depthrewrite.runtime`),
and the checks and warnings about hooks on its submodules."""

from __future__ import annotations

import contextlib
import itertools
import operator
from collections import Counter, OrderedDict
from typing import Any, Iterator

import torch
import torch.nn as nn

from ..blocks import WRAPPER_ATTRS, ConvertedBlock, get_path, original_block_class, unwrap, unwrapped_path
from ..errors import ConfigError, ModuleTreeChangedError
from ..passes.lower.module_calls import CALL_META, HOOK_ATTRS, hook_owner, is_dtensor, traced_hook

# Set to False to skip the module-tree check (for measuring its cost only: changes then go unnoticed).
CHECK_MODULE_TREE = True


# ---- the module tree fingerprint ---------------------------------------------------------------------------------

_HOOKS = HOOK_ATTRS
_hooks_of = operator.attrgetter(*_HOOKS)
_children_of = operator.attrgetter("_modules")
_params_of = operator.attrgetter("_parameters")
_buffers_of = operator.attrgetter("_buffers")
_dict_of = operator.attrgetter("__dict__")


def _own_forwards(mods: list[nn.Module]) -> list[Any]:
    """Each module's ``forward`` set on the instance (torchtitan's parallelize, accelerate's hooks, a user's
    wrapper), or None: C-level passes."""
    return list(map(dict.get, map(_dict_of, mods), itertools.repeat("forward")))


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


PLAIN_TENSORS = (torch.Tensor, nn.Parameter, getattr(nn, "Buffer", torch.Tensor))


def direct_reads(entries: list) -> set[str]:
    """The absolute paths of the parameters and buffers the graphs of ``entries`` read with ``get_attr`` (the
    runner's or flat graph's targets, and each block program's, prefixed by its block path)."""
    out: set[str] = set()
    for e in entries:
        run = e.run
        out.update(n.target for n in run.graph.nodes if n.op == "get_attr")
        for prog in run.__dict__.get("_dr_programs", {}).values():
            out.update(f"{prog.path}.{n.target}" for n in prog.graph.nodes if n.op == "get_attr")
    return out


def called_modules(entries: list) -> dict[str, bool]:
    """The modules every graph of ``entries`` calls as live modules (``convert``'s module calls), by path (without
    wrapper segments): ``{path: whether its output is a container}``. A module is left out when some graph inlines
    its ops instead, or reads one of its parameters or buffers directly (a tied weight read in the parent): those
    graphs depend on what is inside it."""
    if not entries:
        return {}
    every: set[str] | None = None
    structured: set[str] = set()
    for e in entries:
        mine = set()
        for g in e.graphs():
            for n in g.nodes:
                path = n.meta.get(CALL_META) if n.op == "call_module" else None
                if path is not None:
                    mine.add(unwrapped_path(path))
                    if any(u.target is operator.getitem for u in n.users):
                        structured.add(unwrapped_path(path))
        every = mine if every is None else every & mine
    reads = {unwrapped_path(r) for r in direct_reads(entries)}
    return {p: p in structured for p in sorted(every or ())
            if not any(r.startswith(p + ".") for r in reads)}


def _called_root(path: str, called: dict[str, bool]) -> str | None:
    """The called module ``path`` is (or is inside), or None."""
    if not called:
        return None
    parts = path.split(".")
    return next((p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if p in called), None)


def _inside(mod: nn.Module) -> tuple:
    """What a graph around a called module still depends on inside it: the dtypes it holds, and whether it holds
    DTensors (tensor parallelism and FSDP2 change the local shapes the graph sees: recaptured and checked)."""
    ts = [*mod.parameters(), *mod.buffers()]
    return frozenset(t.dtype for t in ts), any(map(is_dtensor, ts))


def _ids(dicts: list[dict]) -> list[int]:
    return list(map(id, itertools.chain.from_iterable(map(dict.values, dicts))))


class ModuleTree:
    """The submodule tree when the graphs were captured: ``names[i]``/``mods[i]``/``types[i]`` for every submodule,
    ``children[j]`` a copy of the ``_modules`` dict of ``owners[j]`` (the root, then every submodule), and the
    identities of every parameter and buffer."""

    __slots__ = ("names", "mods", "types", "owners", "children", "hooks", "hook_snapshot", "forwards", "tensors",
                 "config", "ckpt_owners", "ckpt", "called", "logical", "called_shapes")

    def __init__(self, root: nn.Module, called: dict[str, bool] | None = None):
        named = [(n, m) for n, m in root.named_modules() if m is not root]
        self.names = [n for n, _ in named]
        self.mods = [m for _, m in named]
        self.types = list(map(type, self.mods))
        self.owners = [root, *self.mods]
        self.children = [dict(d) for d in map(_children_of, self.owners)]
        # the hook dicts themselves (register_*_hook adds to them in place): any() over them is one C-level pass
        self.hooks = [d for m in self.mods for d in _hooks_of(m)]
        self.hook_snapshot = [dict(d) for d in self.hooks]
        self.forwards = _own_forwards(self.mods)  # a forward set on an instance runs only where it is called
        # the parameter and buffer dicts themselves: those holding tensors (their tensors' identities) and the empty
        # ones (any entry added to them is a change)
        dicts = [*map(_params_of, self.owners), *map(_buffers_of, self.owners)]
        self.tensors = ([d for d in dicts if d], [d for d in dicts if not d])
        self.tensors += (_ids(self.tensors[0]),)
        self.config = _config_state(root)
        # activation checkpointing flags (HF's gradient_checkpointing_enable() sets them): export cannot follow them
        self.ckpt_owners = [m for m in self.owners if "gradient_checkpointing" in m.__dict__]
        self.ckpt = [m.__dict__["gradient_checkpointing"] for m in self.ckpt_owners]
        self.called = dict(called or {})  # called_modules() of the graphs this tree runs: opaque in logical
        self.called_shapes: dict[str, Counter] = {}  # filled by _logical: the shapes each called module holds
        self.logical = self._logical()  # taken now: the modules it reads change in place

    def changed(self, root: nn.Module) -> bool:
        """Whether a submodule was replaced, added or removed, a hook added or removed on one, a forward set on one's
        instance, or a parameter or buffer reassigned, since recording. A few C-level passes over lists (about 90 µs for a 32-layer model: docs/contract.md)."""
        return (
            list(map(type, self.mods)) != self.types
            or list(map(_children_of, self.owners)) != self.children  # dict ==: same names, same objects
            or self.hooks != self.hook_snapshot  # the live hook dicts against copies: same keys, same functions
            or _own_forwards(self.mods) != self.forwards
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
        needs no recapture). A module every graph calls as a live module (:attr:`called`) is opaque: what is
        inside it (its hooks, parameters, children, a replacement at its path: a peft LoRA layer, a torchao swap) is
        read when it is called, so only its path, the dtypes it holds, whether it holds DTensors and (when the graph
        unpacks its output) its class count. Two trees with equal ``logical()`` run the same captured graphs."""
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
            if any(a in mod._modules for a in WRAPPER_ATTRS) and isinstance(unwrap(mod), ConvertedBlock):
                continue
            cname = unwrapped_path(name)
            root = _called_root(cname, self.called)
            if root is not None:
                if root == cname:  # inside a called module: nothing the graphs read
                    items.append((cname, "called", typ if self.called[cname] else None, _inside(mod)))
                    self.called_shapes[cname] = Counter(tuple(t.shape) for t in (*mod.parameters(), *mod.buffers())
                                                        if not nn.parameter.is_lazy(t))
                continue
            block = isinstance(mod, ConvertedBlock)
            # a forward set on the instance runs only where the module is called: an inlined module's is a change,
            # except accelerate's (its offload hook loads weights; what the graphs read directly is loaded around
            # the whole call: runtime/offload.py)
            forward = None if "_hf_hook" in mod.__dict__ else self.forwards[i]
            hooks = () if block else (*(tuple(d.values()) for d in self.hook_snapshot[4 * i:4 * i + 4]), forward)
            items.append((
                cname, id(mod), original_block_class(typ) if block else typ, hooks,
                tensors(cname, mod._parameters), tensors(cname, mod._buffers),
            ))
        return tuple(items), self.config

    def resharded(self, new: "ModuleTree") -> tuple[str, tuple] | None:
        """``(path, shape)`` of a module every graph calls that no longer holds a tensor of a shape it held when
        recorded: its weights were replaced by smaller local shards (tensor parallelism with plain local tensors, as
        torchtitan's ``spmd_types`` backend shards them), so its output may have other sizes than the graph around
        it was traced with. Tensors added beside the old ones (a LoRA layer) or of the same shape (a quantized or
        FSDP2-sharded weight, which keep their logical shape) are no change. None when nothing was resharded."""
        for path, had in self.called_shapes.items():
            now = new.called_shapes.get(path)
            if now is not None and not had <= now:
                return path, next(s for s in had if had[s] > now[s])
        return None

    def user_hooks(self) -> list[tuple[str, Any]]:
        """``(module path, hook)`` for hooks on submodules that no library we know installed (transformers records
        hidden states and attentions with hooks of its own; peft and accelerate install some too)."""
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
        forwards = _own_forwards(self.mods)
        if forwards != self.forwards:
            i = next(i for i, (a, b) in enumerate(zip(forwards, self.forwards)) if a != b)
            return self.names[i], "its forward set or removed on the instance"
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

def global_hooks() -> str | None:
    """The register function of a global module hook that is registered now (``register_module_forward_hook``;
    FlopCounterMode and ModuleTracker register them), or None."""
    mm = torch.nn.modules.module
    return next((fn for attr, fn in _GLOBAL_HOOKS if getattr(mm, attr)), None)


def check_global_hooks(entry: Any, name: str) -> None:
    """A global module hook runs for every module called. A graph with module calls calls the model's intact
    modules (each block, its attention and MLP, every Linear, Embedding and norm), so the hook fires for them as in
    the original; the modules whose computation the rewrite changed (the model holding the residual chain, MoDA's
    attention) run inside their parent's call. A graph without module calls inlines every module below the blocks:
    ModuleTreeChangedError rather than a hook that silently skips them."""
    kind = global_hooks()
    if kind is None or entry.module_calls:
        return
    why = "its graph for this call has every module inlined (converted with module_calls=False, or one flat graph)"
    raise ModuleTreeChangedError(
        f"a global module hook is registered (torch.nn.modules.module.{kind}; FlopCounterMode and ModuleTracker "
        f"register one too), but the converted {name} cannot run it for its submodules: {why}. Convert with the "
        "default module calls, or remove the global hook before calling the converted model.",
        module=None, change="global hook",
    )


@contextlib.contextmanager
def outside_the_call() -> Iterator[None]:
    """A capture traces the model; it is not a call of it. The global module hooks and the dispatch modes the caller
    runs under (FlopCounterMode, DebugMode, a mode logging ops) are suspended while it traces, so they see the
    captured graph run, not export's fake tensors. Under a tracer's own mode (fake tensors, make_fx) nothing is
    suspended."""
    from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

    mm = torch.nn.modules.module
    stack = _get_current_dispatch_mode_stack()
    infra = any(type(m).__module__.startswith(("torch._subclasses", "torch.fx", "torch._functorch", "torch._export"))
                for m in stack)
    saved = [(d, OrderedDict(d)) for d in (getattr(mm, attr) for attr, _ in _GLOBAL_HOOKS)]
    for d, _ in saved:
        d.clear()
    try:
        with contextlib.nullcontext() if infra or not stack else _disable_current_modes():
            yield
    finally:
        for d, s in saved:
            d.clear()
            d.update(s)


_WARNED: set = set()


def warn_traced_hooks(model: nn.Module) -> None:
    """:func:`warn_user_hooks` for ``model``'s tree now (a graph captured with its hooks traced)."""
    warn_user_hooks(ModuleTree(model))


def warn_user_hooks(tree: ModuleTree) -> None:
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


def check_block_hooks(model: nn.Module, paths: tuple[str, ...]) -> None:
    """Hooks on a block registered before conversion were written for the block's original inputs; on a converted
    block they fire around its new call (the program, then the depth state): ConfigError."""
    for p in paths:
        blk = get_path(model, p)
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
