"""Modules stay modules (issue #24, docs/design/module-calls.md, steps 1 and 2): put back a ``call_module`` of the
live ``nn.Linear`` / ``nn.Embedding`` in place of each region of the rewritten flat graph that the rewrite left
intact. Opt-in: ``depthrewrite.convert(..., module_calls=True)``; nothing here runs otherwise.

* At capture (:func:`export_with_signatures`, :func:`stamp`): ``torch.export`` records each candidate module's call
  signature (``preserve_module_call_signature``); every captured node is stamped with its capture name and what its
  arguments were (internal edges by name, ``get_attr`` targets, constants), and each module call's *region* (the
  nodes with that ``nn_module_stack`` key, without ``_assert_tensor_metadata`` and no-op casts) is recorded.
* After the rewrite (:func:`lower_module_calls`), on a copy of the flat graph: a region becomes
  ``call_module(path, *inputs)`` when its ops are exactly the captured ones, each reads what it read at capture,
  the edges from outside bind consistently to the signature's inputs, every value read outside is a signature
  output, and the call's inputs come before the region. Nodes a rewrite made (they carry a ``NodeRole``) or copied
  (their stamp is on two nodes) are never taken for the module's own. The call gets its parent's module stack, so
  the block split places it like the ops it replaces; its output keeps the replaced node's name.

The flat graph itself is left as it was (the report, export of a converted model and pipeline stages read it); the
lowered copy is what the block runner and the block programs run (``gm.meta[LOWERED_META]``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import operator
import re
import sys
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

from ...flexattention import is_block_mask_type
from ..analyse.ops import alias_of
from ..meta import role_of

__all__ = ["CALL_META", "HOOK_ATTRS", "LOWERED_META", "SIGNATURES_META", "STAMP_META", "ModuleCallInfo",
           "as_local_shard", "autocast_blocks", "candidate_paths", "check_live_modules", "check_local_shape",
           "export_with_signatures", "hooks_out_for_capture", "hook_owner", "is_dtensor", "lower_module_calls", "redistributes_only",
           "sequence_parallel", "stamp", "take_hooks_out", "tensor_parallel", "traced_hook"]

log = logging.getLogger(__name__)

#: node.meta key: ``(capture name, argument fingerprint)`` of a node as captured
STAMP_META = "depthrewrite_capture"
#: gm.meta key: the :class:`ModuleCallInfo` of a capture with ``module_calls=True``
SIGNATURES_META = "depthrewrite_module_signatures"
#: gm.meta key: ``(graph, called, refused)``, the lowered copy of the flat graph the block runner splits
LOWERED_META = "depthrewrite_module_call_graph"
#: node.meta key of a call_module this pass made: the module's path
CALL_META = "depthrewrite_module_call"

_ASSERT = "aten._assert_tensor_metadata.default"
#: containers: never called (their forward is not a computation of their own)
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


@dataclasses.dataclass
class ModuleCallInfo:
    """What a capture recorded for the lowering: signatures by module path, regions (capture names of the region's
    ops) by ``nn_module_stack`` key, the canonical node (through no-op casts) of each capture name, and the paths
    export refused (with why)."""

    signatures: dict[str, Any]
    regions: dict[str, frozenset[str]]
    canon: dict[str, str]
    dropped: tuple[tuple[str, str], ...] = ()


def candidate_paths(model: nn.Module) -> list[str]:
    """The paths whose call signature is recorded: every submodule that holds a parameter or buffer (itself or
    below it) and is not a container (``ModuleList`` / ``ModuleDict``) or one of depthrewrite's own new modules.
    Chosen by what sits at the path at capture, never by class: whether a call is put back is decided by the
    lowering's checks against the recorded signature (a block, whose region the rewrite changes, stays inlined).
    A module held at several paths (one RoPE module shared by every layer) is left out: export records signatures
    by path."""
    from ..rewrite.editor import PARAM_PREFIX

    seen: dict[int, int] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        seen[id(m)] = seen.get(id(m), 0) + 1
    out = []
    for n, m in model.named_modules():
        if not n or isinstance(m, _CONTAINERS) or n == PARAM_PREFIX or n.startswith(PARAM_PREFIX + "."):
            continue
        if seen[id(m)] > 1:  # one module at several paths (torchtune's RoPE shared by every layer): export keys
            continue  # signatures by path and cannot record it; it stays inlined
        if next(m.parameters(), None) is None and next(m.buffers(), None) is None:
            continue
        if n not in out:
            out.append(n)
    return out


#: the hook dicts of an ``nn.Module``
HOOK_ATTRS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def hook_owner(fn: Any) -> str:
    """The module that defined a hook (``""`` when it cannot be told)."""
    return getattr(fn, "__module__", None) or getattr(type(fn), "__module__", "") or ""


def traced_hook(fn: Any) -> bool:
    """Hooks transformers installs to record outputs: inactive outside the original forward, traced at capture."""
    return hook_owner(fn).startswith("transformers.")


def take_hooks_out(mod: nn.Module, undo: list) -> int:
    """Remove ``mod``'s run-time hooks (all but :func:`traced_hook`'s) for a capture; a callable that puts them back
    goes to ``undo``. Returns how many were removed."""
    removed = 0
    for attr in HOOK_ATTRS:
        hooks = getattr(mod, attr)
        drop = [k for k, h in hooks.items() if not traced_hook(h)]
        if drop:
            saved = OrderedDict(hooks)
            for k in drop:
                del hooks[k]
            undo.append(lambda d=hooks, s=saved: (d.clear(), d.update(s)))
            removed += len(drop)
    return removed


def take_forward_out(mod: nn.Module, undo: list) -> int:
    """Take out a ``forward`` set on the instance (torchtitan's ``Module.parallelize`` wraps each sharded module's
    forward with the redistribution of its inputs and outputs, ``self.forward = ...``) for a capture, so the trace
    sees the class's computation; a callable that puts it back goes to ``undo``. Returns 1 if one was taken out:
    like a hook, it then runs only where the module is called live."""
    own = mod.__dict__.get("forward")
    if own is None or getattr(own, "__func__", None) is getattr(type(mod), "forward", None):
        return 0
    del mod.__dict__["forward"]
    undo.append(lambda m=mod, f=own: m.__dict__.__setitem__("forward", f))
    return 1


FORWARD_REPLACED = ("its forward replaced on the instance (torchtitan's Module.parallelize, say), which runs only "
                    "where it is called")


def redistributes_only(mod: nn.Module) -> bool:
    """Whether ``mod``'s forward set on the instance is torchtitan's ``Module.parallelize`` wrapper: it only
    redistributes its inputs and outputs to the placements its sharding config names (DTensors with the
    ``partial_dtensor`` backend, collectives on plain local tensors with ``spmd_types``) around the module's own
    computation (a ``local_map`` region on local shards). Inlined on whole tensors, as a rewritten sublayer runs
    (MoDA's attention), the module computes what it computes sharded, provided it reads no sharded state itself
    (:func:`check_live_modules`); the redistributions come back at the live calls around it (:func:`as_replicated`
    or :func:`as_tp_input` before a call, :func:`check_local_shape` gathering a sharded output, :func:`as_local_shard`
    before a row-parallel one), whose autograd carries the backward communication. A sequence-parallel plan never
    gets this far (its activations between modules are refused first)."""
    return getattr(_titan_dims(mod), "spmd_backend", None) in ("partial_dtensor", "spmd_types")


def _titan_dims(mod: nn.Module) -> Any:
    """The ``ParallelDims`` of torchtitan's ``Module.parallelize`` wrapper set as ``mod``'s forward, or None."""
    fn = mod.__dict__.get("forward")
    if fn is None:
        return None
    hit = mod.__dict__.get(_DIMS_KEY)
    if hit is not None and hit[0] is fn:  # what a compiled block reads (the wrapper's name cannot be read in a trace)
        return hit[1]
    found = None
    if getattr(fn, "__module__", "").startswith("torchtitan.") and \
            getattr(fn, "__qualname__", "").endswith("parallelize.<locals>.forward_with_redistribution"):
        try:
            import inspect

            found = inspect.getclosurevars(fn).nonlocals.get("parallel_dims")
        except (TypeError, ValueError):  # pragma: no cover - another torchtitan layout
            found = None
    mod.__dict__[_DIMS_KEY] = (fn, found)
    return found


#: instance attribute of a module with a forward of its own: ``(that forward, its ParallelDims or None)``, read once
#: (it runs at every call of a tensor-parallel model) and kept with the forward it describes
_DIMS_KEY = "_depthrewrite_titan_dims"


def known_before_tracing(module: nn.Module) -> None:
    """Read now, outside any trace, what the calls in a block's graph ask of the modules below ``module`` at every call
    (torchtitan's wrapper and its mesh): ``torch.compile`` of the block then reads the answers (Dynamo cannot read a
    function's name)."""
    for m in module.modules():
        _titan_dims(m)


def _spmd_state(mod: nn.Module) -> tuple[Any, dict[str, Any]] | None:
    """Under torchtitan's ``spmd_types`` backend (plain local shards): ``(tp mesh, {state name: placement on it})`` of
    ``mod`` parallelised by it, or None."""
    dims = _titan_dims(mod)
    if getattr(dims, "spmd_backend", None) != "spmd_types":
        return None
    fn = mod.__dict__["forward"]
    state = _SPMD_STATE.get(fn, _SPMD_STATE)
    if state is _SPMD_STATE:
        state = _SPMD_STATE[fn] = _spmd_state_of(mod, dims)
    return state


def _spmd_state_of(mod: nn.Module, dims: Any) -> tuple[Any, dict[str, Any]] | None:
    from torchtitan.protocols.sharding import resolve_placements

    mesh = dims.get_optional_mesh("tp")  # None: no tensor parallelism (torchtitan wraps every module for FSDP too)
    if mesh is None:
        return None
    placements = {}
    for k, v in (mod._sharding_config.state_shardings or {}).items():
        try:
            placements[k] = resolve_placements(v, mesh)[0]
        except ValueError:  # a layout without the tp axis (expert parallelism's): nothing sharded on it
            continue
    return mesh, placements


def _pending_on_tp(mod: nn.Module) -> list[str]:
    """The parameters of ``mod`` whose ``spmd_types`` layout on the tp axis is ``R`` (replicated, each rank's gradient
    a partial sum that torchtitan leaves to a later reduction), not ``I`` (invariant: complete on every rank)."""
    return [k for k in _replicated_on_tp(mod) if mod._parameters[k].requires_grad]


def _replicated_on_tp(mod: nn.Module) -> list[str]:
    """The parameters of ``mod`` whose ``spmd_types`` layout on the tp axis is ``R``, by layout alone."""
    if _spmd_state(mod) is None:  # not spmd_types, or no tp axis
        return []
    return [k for k, v in (mod._sharding_config.state_shardings or {}).items()
            if mod._parameters.get(k) is not None and _tp_type(v) == "R"]


def _tp_type(layout: Any) -> str | None:
    """The ``spmd_types`` type of a torchtitan layout on the tp axis, as written: ``"R"``, ``"I"``, ``"S(1)"``..."""
    for axis, t in layout.per_axis_spmd_types().items():
        if getattr(axis, "value", axis) == "tp":
            return str(t).rpartition(".")[2]  # an enum member prints with its class name
    return None


def _pending_shard_input(mod: nn.Module, name: str | None = None) -> tuple[Any, int] | None:
    """``(tp mesh, d)`` when ``mod`` holds a parameter its layout declares ``R`` on the tp axis (a partial gradient
    torchtitan completes later, :func:`_pending_on_tp`) and its wrapper takes its input ``name`` (its only one when
    None) as a shard along ``d`` (Qwen3's QK-norm: the heads): called with this rank's slice of a whole input, as in
    the original, its weight gets the partial gradient of that slice, which torchtitan's reduction then completes.
    Else None. Read once per wrapper and name (it runs at every call of such a module)."""
    fn = mod.__dict__.get("forward")
    if fn is None or _spmd_state(mod) is None:
        return None
    known = _PENDING_INPUT.setdefault(fn, {})
    if name not in known:
        known[name] = _pending_shard_input_of(mod, name)
    return known[name]


def _pending_shard_input_of(mod: nn.Module, name: str | None) -> tuple[Any, int] | None:
    # by layout, not by requires_grad: a call lowered to take its shard keeps taking it if the weight is frozen later
    if not _replicated_on_tp(mod):
        return None
    cfg = mod._sharding_config
    if name is None:
        names = list(cfg.in_src_shardings or {})
        if len(names) != 1:
            return None
        name = names[0]
    placed = _titan_input(mod, name)
    if placed is None or placed[0].ndim != 1 or not placed[1][0].is_shard():
        return None
    return placed[0], placed[1][0].dim


#: torchtitan wrapper function -> {input name or None: _pending_shard_input's answer}
_PENDING_INPUT: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
#: torchtitan wrapper function (one per parallelised module) -> (tp mesh, its state's placements on it)
_SPMD_STATE: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def _spmd_weight_dim(mod: nn.Module) -> tuple[Any, int] | None:
    """``(tp mesh, d)`` when ``mod``'s weight is a plain local shard along ``d`` (``spmd_types``), else None."""
    state = _spmd_state(mod)
    p = state[1].get("weight") if state is not None else None
    return (state[0], p.dim) if p is not None and p.is_shard() else None


def _whole_stand_ins(mod: nn.Module, undo: list) -> None:
    """While capturing with module calls: each plain local shard ``mod`` holds under torchtitan's ``spmd_types`` (a
    parameter or buffer its sharding config shards) stood in for by zeros of the whole tensor's shape, as FSDP2's and
    DTensor parameters are (``blocks_for_capture``): the graph is traced with whole tensors (a rewritten attention
    then splits every head, not this rank's), and the module calls around it take and give shards at run time."""
    state = _spmd_state(mod)
    for k, p in (state[1].items() if state is not None else ()):
        owner = mod._parameters if k in mod._parameters else mod._buffers
        t = owner.get(k)
        if t is None or not p.is_shard():
            continue
        shape = list(t.shape)
        shape[p.dim] *= state[0].size()
        whole = torch.zeros(shape, dtype=t.dtype, device=t.device)
        owner[k] = nn.Parameter(whole, requires_grad=t.requires_grad) if owner is mod._parameters else whole
        undo.append(lambda d=owner, k=k, v=t: d.__setitem__(k, v))


def _spmd_sharded_below(mod: nn.Module) -> Any:
    """The tp mesh when ``mod`` or a module below it holds plain local shards (``spmd_types``), else None."""
    return next((w[0] for m in mod.modules() if (w := _spmd_weight_dim(m)) is not None), None)


@contextlib.contextmanager
def hooks_out_for_capture(model: nn.Module) -> Iterator[dict[str, str]]:
    """While capturing with module calls: the run-time hooks of every candidate module (tensor parallelism's input
    and output redistribution, a user's forward hook) and a forward set on any module's instance (torchtitan's
    parallelize, accelerate's hooks) are taken out, so the trace sees the module's own computation and nothing
    torch.export cannot follow (DTensor). A module that is then called runs its hooks at run time; one
    that stays inlined would skip them, which :func:`check_live_modules` refuses. Yields ``{path: what was taken
    out}``; everything is put back after."""
    removed: dict[str, str] = {}
    undo: list[Any] = []
    try:
        for path in candidate_paths(model):
            n = take_hooks_out(model.get_submodule(path), undo)
            if n:
                removed[path] = f"{n} hook(s) that fire at run time"
        for path, mod in model.named_modules():  # a stateless module's too (torchtitan's inner attention)
            _whole_stand_ins(mod, undo)
            if path and take_forward_out(mod, undo):
                removed[path] = f"{removed[path]} and {FORWARD_REPLACED}" if path in removed else FORWARD_REPLACED
        yield removed
    finally:
        for u in reversed(undo):
            u()


def is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)


def is_fsdp(module: nn.Module) -> bool:
    """Whether ``module`` is wrapped by FSDP (``fully_shard``'s FSDPModule, or the older FullyShardedDataParallel)."""
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(module, (FSDPModule, FullyShardedDataParallel))


def _fsdp_managed(model: nn.Module, path: str) -> bool:
    """Whether ``path`` is ``fully_shard``'s (itself or a module above it): its DTensor parameters are gathered into
    plain tensors before the module runs."""
    return _fsdp_owner(model, path) is not None


def _fsdp_owner(model: nn.Module, path: str) -> nn.Module | None:
    """The innermost module at or above ``path`` that ``fully_shard`` wraps (the one whose FSDP2 state holds the
    parameters of ``path`` itself), or None."""
    owner, mod = None, model
    for part in [*(path.split(".") if path else []), None]:
        if is_fsdp(mod):
            owner = mod
        if part is not None:
            mod = mod._modules.get(part)
            if mod is None:
                return owner
    return owner


def _holds_tp(model: nn.Module, path: str) -> bool:
    """Whether the module at ``path`` is tensor-parallel, itself or below: a hook of a ``ParallelStyle``
    (``parallelize_module``'s), a DTensor parameter that FSDP2 does not manage, or a DTensor buffer (torchtitan's
    replicated RoPE cache)."""
    try:
        mod = model.get_submodule(path)
    except AttributeError:
        return False
    if any(next(_styles_of(h), None) is not None for m in mod.modules()
           for attr in ("_forward_pre_hooks", "_forward_hooks") for h in getattr(m, attr).values()):
        return True
    for n, p in mod.named_parameters():
        if is_dtensor(p):
            owner = _fsdp_owner(model, ".".join(x for x in (path, n.rpartition(".")[0]) if x))
            if owner is None or _sharded_before_fsdp(owner, p):
                return True
    return any(is_dtensor(b) for b in mod.buffers())


def _sharded_before_fsdp(owner: nn.Module, param: torch.Tensor) -> bool:
    """Whether ``param``, which the ``fully_shard`` of ``owner`` manages, was a DTensor before it (a tensor-parallel
    weight of a 2-D FSDP × TP model, as torchtitan's ``parallelize_llama`` makes them): it runs as a DTensor on the TP
    mesh inside the module's forward. Read from the owner's FSDP2 per-parameter records (``FSDPParam.is_dtensor``),
    which also give the mesh it runs on (kept for :func:`_dtensor_mesh`)."""
    if param in _RUNS_ON:
        return True
    try:
        group = owner._get_fsdp_state()._fsdp_param_group
        records = list(group.fsdp_params) if group is not None else []
    except Exception:  # noqa: BLE001 - FSDP1, or FSDP2 internals of another torch: no answer
        return False
    for fp in records:
        spec = getattr(fp, "_unsharded_dtensor_spec", None)
        if getattr(fp, "is_dtensor", False) and spec is not None:
            _RUNS_ON[fp.sharded_param] = spec
    return param in _RUNS_ON


#: FSDP2-sharded parameters that were DTensors before ``fully_shard`` -> the DTensor spec they run as in forward (their
#: TP mesh and placements)
_RUNS_ON: Any = WeakIdKeyDictionary()


def _runs_on(param: Any) -> Any:
    """The DTensor spec an FSDP2-sharded tensor-parallel ``param`` runs as in forward (:data:`_RUNS_ON`), or None. None
    in a compiled block's trace (Dynamo does not trace a weak dictionary): inside the forward FSDP2 has registered the
    unsharded parameter, which already is the DTensor on the TP mesh."""
    return None if torch.compiler.is_compiling() else _RUNS_ON.get(param)


def tensor_parallel(model: nn.Module) -> bool:
    """Whether ``model`` holds a tensor-parallel parameter (a DTensor FSDP2 does not manage)."""
    return _holds_tp(model, "")


def _styles_of(hook: Any, depth: int = 0) -> Iterator[tuple[str, list]]:
    """``(style name, its layout values)`` for each tensor-parallel style a hook acts for: a ``ParallelStyle`` its
    closure holds (``PrepareModuleInput``'s hooks), or a ``functools.partial`` of a style's (static) method with its
    layouts bound (``distribute_module``'s lambdas close over such a partial)."""
    try:
        from torch.distributed.tensor.parallel.style import ParallelStyle
    except ImportError:  # pragma: no cover - torch without distributed
        return
    if depth > 3:
        return
    if isinstance(hook, ParallelStyle):
        yield type(hook).__name__, [v for k, v in vars(hook).items() if "layout" in k and v is not None]
        return
    if isinstance(hook, functools.partial):
        owner = getattr(hook.func, "__self__", None)
        cls = owner if isinstance(owner, type) else type(owner) if owner is not None else None
        qual = getattr(hook.func, "__qualname__", "").split(".")[0]
        mod = sys.modules.get(getattr(hook.func, "__module__", "") or "")
        found = getattr(mod, qual, None) if cls is None or not issubclass(cls, ParallelStyle) else cls
        if isinstance(found, type) and issubclass(found, ParallelStyle):
            yield found.__name__, [*hook.args, *hook.keywords.values()]
            return
    for x in (getattr(hook, "__self__", None), getattr(hook, "func", None)):
        if x is not None:
            yield from _styles_of(x, depth + 1)
    for cell in getattr(hook, "__closure__", None) or ():
        try:
            yield from _styles_of(cell.cell_contents, depth + 1)
        except ValueError:  # an empty cell
            continue


def sequence_parallel(model: nn.Module) -> tuple[str, str] | None:
    """``(module path, style)`` of the first tensor-parallel style on ``model`` that shards activations along the
    sequence (``SequenceParallel``, or an activation layout ``Shard(1)``: the sequence of ``(batch, sequence, hidden)``),
    or None."""
    try:
        from torch.distributed.tensor import Shard
    except ImportError:  # pragma: no cover - torch without distributed
        return None

    def seq_shard(v: Any) -> bool:
        vals = v if isinstance(v, (tuple, list)) else (v.values() if isinstance(v, dict) else (v,))
        return any(isinstance(x, Shard) and x.dim == 1 for x in vals)

    for path, mod in model.named_modules():
        for attr in ("_forward_pre_hooks", "_forward_hooks"):
            for h in getattr(mod, attr).values():
                for name, layouts in _styles_of(h):
                    if name == "SequenceParallel" or any(seq_shard(v) for v in layouts):
                        return path, name
        if _titan_sequence_sharded(mod):
            return path, "torchtitan's sequence-parallel sharding config"
    return None


def _titan_sequence_sharded(mod: nn.Module) -> bool:
    """Whether ``mod``'s torchtitan sharding config takes or gives an activation sharded along the sequence on the tp
    axis (``S(1)`` of ``(batch, sequence, hidden)``: its ``enable_sp`` plans). With ``spmd_types`` those activations
    are plain tensors, so the module calls' checks cannot see it."""
    if _titan_dims(mod) is None:
        return False
    cfg = mod._sharding_config
    layouts = [*(cfg.in_src_shardings or {}).values(), *(cfg.in_dst_shardings or {}).values(),
               *(x for x in (cfg.out_src_shardings, cfg.out_dst_shardings)
                 if x is not None and not isinstance(x, tuple))]
    return any(_tp_type(v) == "S(1)" for v in layouts)


def _waited(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor: the local tensor of a DTensor a collective just made is an ``AsyncCollectiveTensor``
    (waited for at its first use), and a compiled block given one as its input returned its gradient in a form the
    collective's backward could not take (torchtitan's ``partial_dtensor`` embedding under ``apply_compile``). A
    copy made at once (its backward the identity); anything else unchanged."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.clone() if isinstance(t, AsyncCollectiveTensor) else t


@torch.fx.wrap
def check_local_shape(t: Any, dims: tuple | None, path: str, parent: str, why: str, to_output: bool = False,
                      module: nn.Module | None = None) -> Any:
    """Run-time check after a call of a module with tensor-parallel parameters: its output has the sizes the graph
    around it was traced with (static dimensions). A plan that leaves the output sharded (``ColwiseParallel``'s
    local output) fails here, with a ConfigError, instead of in a reshape further down.

    A DTensor output (torchtitan's ``Module.parallelize`` keeps activations as DTensors between its modules) that
    every rank holds whole (replicated) continues as its local tensor: the graph's own ops (the depth mixing, with
    plain replicated parameters) compute on plain tensors, and the next module call takes it back as a DTensor. A
    sharded one is a ConfigError unless it is what the model returns (``to_output``: torchtitan's vocabulary-sharded
    logits, as the original returns them)."""
    if is_dtensor(t):
        if all(p.is_replicate() for p in t.placements):
            t = _waited(t.to_local())
        elif to_output:
            return t
        elif _features_sharded(t, dims):  # a column-parallel output the graph expects whole (MoDA's attention)
            return t.full_tensor()
        else:
            from ...errors import ConfigError

            raise ConfigError(
                f"{path} returned a DTensor placed as {tuple(t.placements)}: its tensor-parallel plan leaves the "
                "activations between modules sharded (sequence parallelism, or a sharded output), but the converted "
                "model's graph computes its depth mixing on whole tensors between module calls. Use a plan whose "
                "modules return replicated activations (torchtitan: enable_sequence_parallel=False; docs/training.md)."
            )
    if dims is None or not isinstance(t, torch.Tensor):
        return t
    if t.dim() == len(dims) and all(d is None or d == s for d, s in zip(dims, t.shape)):
        return t
    if to_output and module is not None and _spmd_sharded_below(module) is not None:
        return t  # what the model returns, a plain shard as the original returns it (torchtitan's vocabulary shard)
    whole = _gathered(t, dims, module)
    if whole is not None:
        return whole
    from ...errors import ConfigError

    want = tuple("*" if d is None else d for d in dims)
    inside = (f" The scheme changes {parent}, which contains it ({why}), so {parent} runs as graph operations traced "
              "with whole tensors, not as the module." if parent else "")
    raise ConfigError(
        f"{path} returned a tensor of shape {tuple(t.shape)} where the converted model's graph expects {want}: its "
        f"tensor-parallel plan leaves its output sharded (a local shard).{inside} Shard only modules the scheme "
        "keeps whole (the report's 'modules called'), or give this module output_layouts=Replicate() "
        "(docs/training.md, tensor parallelism)."
    )


def _features_sharded(t: Any, dims: tuple | None) -> bool:
    """Whether the DTensor ``t`` is sharded on a 1-D mesh along a dimension the graph was traced with as a static
    size equal to the whole tensor's (features, heads), not a dynamic one (batch, sequence): a column-parallel
    Linear's output under torchtitan's ``partial_dtensor`` plan, which the graph of a sublayer the scheme rewrote
    (MoDA's attention) expects whole; gathered (``full_tensor``: its backward hands each rank its slice of the
    gradient every rank computed whole). A sequence-sharded one is not."""
    if dims is None or t.device_mesh.ndim != 1 or len(dims) != t.dim():
        return False
    (p,) = t.placements
    if not p.is_shard():
        return False
    d = p.dim % t.dim()
    return isinstance(dims[d], int) and dims[d] == t.shape[d]


def _sharded_weight(module: nn.Module | None, dim: int) -> Any:
    """``module.weight`` when it is a DTensor sharded along ``dim`` on a 1-D mesh (``dim`` 0: ``ColwiseParallel``'s
    Linear, whose local output is a slice of the features; 1: ``RowwiseParallel``'s, which takes a slice), else None."""
    w = getattr(module, "weight", None) if module is not None else None
    if not is_dtensor(w) or w.dim() != 2:
        return None
    spec = _runs_on(w)  # FSDP2 x TP between steps: as it runs inside the forward
    mesh, placements = (w.device_mesh, w.placements) if spec is None else (spec.mesh, spec.placements)
    if mesh.ndim != 1 or not placements[0].is_shard() or placements[0].dim != dim:
        return None
    return w


def _gathered(t: Any, dims: tuple, module: nn.Module | None) -> Any:
    """A column-parallel Linear's local output, which the graph expects whole (a sublayer the scheme changes, such as
    MoDA's attention, runs as graph operations traced with every head): every rank's slices gathered into the whole
    tensor, differentiably (its backward hands each rank its slice of the gradient, which every rank computed
    whole). None when ``t`` is not such a slice."""
    mesh = _spmd_sharded_below(module) if module is not None else None
    if mesh is None and module is not None and (pending := _pending_shard_input(module)) is not None:
        mesh = pending[0]  # its output from this rank's slice of the input (as_input_shard)
    if mesh is not None:
        return _gathered_local(t, dims, mesh)
    w = _sharded_weight(module, 0)
    if w is None or not isinstance(t, torch.Tensor) or is_dtensor(t) or t.dim() != len(dims):
        return None
    full = w.shape[0]
    if dims[-1] != full or t.shape[-1] != w.to_local().shape[0] or \
            any(d is not None and d != s for d, s in zip(dims[:-1], t.shape[:-1])):
        return None
    return _whole_from_shards(t, w.device_mesh, t.dim() - 1, torch.Size((*t.shape[:-1], full)))


def _gathered_local(t: Any, dims: tuple, mesh: Any) -> Any:
    """A plain local shard (torchtitan's ``spmd_types``: a column-parallel output, or a container's, split along
    features or heads) gathered whole along the one dimension the graph was traced with as ``mesh.size()`` times its
    size, differentiably (the backward hands each rank its slice); None when no single dimension fits."""
    if not isinstance(t, torch.Tensor) or is_dtensor(t) or t.dim() != len(dims):
        return None
    n = mesh.size()
    split = [d for d, (want, got) in enumerate(zip(dims, t.shape)) if want is not None and want != got]
    if len(split) != 1 or dims[split[0]] != t.shape[split[0]] * n:
        return None
    shape = torch.Size(dims[d] if d == split[0] else t.shape[d] for d in range(t.dim()))
    return _whole_from_shards(t.contiguous(), mesh, split[0], shape)


def _whole_from_shards(t: torch.Tensor, mesh: Any, dim: int, shape: torch.Size) -> torch.Tensor:
    """Every rank's slice ``t`` along ``dim`` gathered into the whole (contiguous) tensor of ``shape``,
    differentiably: the backward hands each rank its slice of the gradient every rank computed whole."""
    from torch.distributed.tensor import DTensor, Shard

    stride = tuple(int(shape[i + 1:].numel()) for i in range(len(shape)))
    return DTensor.from_local(t, mesh, [Shard(dim)], run_check=False, shape=shape, stride=stride).full_tensor()


@torch.fx.wrap
def as_tp_input(t: Any, module: nn.Module) -> Any:
    """A whole plain tensor going into a call of ``module`` whose column-parallel Linears hold plain local shards
    (torchtitan's ``spmd_types``) and whose own wrapper does not take it in: the identity forward, the sum of every
    rank's gradient backward (each rank's projection saw only its slice of the weight), which the wrapper of the
    inlined module around it (MoDA's attention) did in the original."""
    return _summed_backward(t, _spmd_sharded_below(module))


def _summed_backward(t: Any, mesh: Any) -> Any:
    """``t`` itself forward, the sum over ``mesh``'s ranks of its gradient backward; unchanged without a mesh or when
    ``t`` is no plain floating tensor."""
    if mesh is None or not isinstance(t, torch.Tensor) or is_dtensor(t) or not t.is_floating_point():
        return t
    from torch.distributed.tensor import DTensor, Partial, Replicate

    return DTensor.from_local(t, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


@torch.fx.wrap
def as_local_shard(t: Any, module: nn.Module) -> Any:
    """A whole tensor going into a row-parallel Linear (``RowwiseParallel``, which takes this rank's slice of the
    features): this rank's slice, differentiably (its backward gathers every rank's slice of the gradient). Anything
    else unchanged (a tensor already of the local width)."""
    if not isinstance(t, torch.Tensor) or is_dtensor(t) or not t.is_floating_point() or t.dim() == 0:
        return t
    spmd = _spmd_weight_dim(module)
    if spmd is not None:  # torchtitan's spmd_types: a plain local shard [out, in / n]
        mesh, d = spmd
        if d != 1 or t.shape[-1] != module.weight.shape[1] * mesh.size():
            return t
    else:
        w = _sharded_weight(module, 1)
        if w is None or t.shape[-1] != w.shape[1] or t.shape[-1] == w.to_local().shape[1]:
            return t
        mesh = w.device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor.from_local(t, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(t.dim() - 1)]).to_local()


@torch.fx.wrap
def as_input_shard(t: Any, module: nn.Module, name: str | None = None) -> Any:
    """A whole tensor going into a call of ``module`` whose partial-gradient parameter needs the input as this rank's
    shard (:func:`_pending_shard_input`): that slice, differentiably (the backward gathers every rank's slice of the
    input's gradient into the whole one every rank computes). A non-floating input unchanged; a floating one the
    layout does not split is a ConfigError (passed whole, the gradient would be counted once per rank)."""
    if not isinstance(t, torch.Tensor) or is_dtensor(t) or not t.is_floating_point():
        return t
    placed = _pending_shard_input(module, name) or _pending_shard_input(module)
    if placed is None or t.dim() <= placed[1] % max(t.dim(), 1) or t.shape[placed[1]] % placed[0].size():
        from ...errors import ConfigError

        # passed whole, its partial-gradient weight would get a complete gradient, counted once per rank later
        raise ConfigError(
            f"{type(module).__name__} (called live with a partial-gradient parameter, torchtitan spmd_types R on "
            f"tp) got an input of shape {tuple(t.shape)} that its plan's shard layout "
            f"{'(none found)' if placed is None else f'Shard({placed[1]}) over {placed[0].size()} ranks'} does not "
            "split: its gradient would be counted once per rank. Convert before parallelising with a plan whose "
            "sharded inputs divide evenly, or use spmd_backend='partial_dtensor' (docs/training.md)."
        )
    mesh, d = placed
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor.from_local(t, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(d)]).to_local()


def _pending_whole(live: nn.Module, path: str) -> bool:
    """Whether the module at ``path`` holds a partial-gradient parameter (:func:`_pending_on_tp`), takes no input as a
    shard (:func:`_pending_shard_input`) and sits inside a module whose torchtitan wrapper was skipped (inlined and
    computed on whole tensors): called live, its gradient would be complete on every rank (DeepSeek-V3's MLA
    ``wkv_a`` and ``kv_norm`` inside MoDA's attention)."""
    mod = live.get_submodule(path)
    if not _pending_on_tp(mod) or _pending_shard_input(mod) is not None:
        return False
    parts = path.split(".")
    return any(redistributes_only(live.get_submodule(".".join(parts[:i]))) for i in range(1, len(parts)))


@torch.fx.wrap
def as_summed_input(t: Any, module: nn.Module) -> Any:
    """A whole tensor going into a call of ``module`` (:func:`_pending_whole`) whose outputs keep ``1/n`` of their
    gradient (:func:`as_gradient_share`): the identity forward, the sum over the tp ranks of the input's gradient
    backward, which makes the ``1/n`` shares whole again (the original sums the partial gradients where the skipped
    wrapper turned the attention's input into a replicated one)."""
    state = _spmd_state(module)
    return _summed_backward(t, state[0] if state is not None else None)


def _dtensor_mesh(module: nn.Module) -> Any:
    """The device mesh of the first DTensor parameter or buffer of ``module`` itself (not its submodules), or None."""
    for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
        if is_dtensor(t):
            spec = _runs_on(t)  # FSDP2 x TP: the TP mesh, not the sharded parameter's 2-D one
            return t.device_mesh if spec is None else spec.mesh
    return None


def _takes_dtensors(model: nn.Module, path: str) -> bool:
    """Whether the module at ``path`` computes on DTensors it does not make itself: it holds tensor-parallel
    parameters or buffers of its own but no ``ParallelStyle`` hook turns plain inputs into DTensors (torchtitan's
    ``Module.parallelize``: a norm with a replicated weight expects a DTensor stream; a module whose children hold
    the DTensors, such as an attention, takes what its children's hooks or wrapped forwards redistribute)."""
    mod = model.get_submodule(path)
    if any(next(_styles_of(h), None) is not None for attr in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs")
           for h in getattr(mod, attr, {}).values()):
        return False
    if _dtensor_mesh(mod) is not None:
        return True
    # torchtitan: a module without DTensors of its own (a fused q/k/v container) called with what its parent's wrapped
    # forward would have made a DTensor (the parent inlined, MoDA's attention), whose parallelised children take
    # their inputs as they come
    return not _converts_inputs(mod) and any(redistributes_only(m) and not _converts_inputs(m)
                                             and _dtensor_mesh(m) is not None for m in mod.modules())


def _converts_inputs(mod: nn.Module) -> bool:
    """Whether ``mod``'s torchtitan wrapper takes its inputs in itself (its sharding config names input placements:
    a plain input becomes a DTensor with ``partial_dtensor``, is redistributed with ``spmd_types``)."""
    cfg = getattr(mod, "_sharding_config", None)
    return redistributes_only(mod) and bool(getattr(cfg, "in_src_shardings", None))


def _titan_input(module: nn.Module, name: str | None) -> tuple[Any, tuple] | None:
    """``(mesh, placements)`` torchtitan's wrapper of ``module`` makes its input ``name`` (from a plain tensor: its
    sharding config's source placements), or None (no such input, or no such wrapper)."""
    if name is None or not _converts_inputs(module):
        return None
    from torchtitan.protocols.sharding import resolve_placements

    cfg = module._sharding_config
    if name not in cfg.in_src_shardings and len(cfg.in_src_shardings) == 1 and module._cache_pos_arg_names() == [name]:
        # Qwen3's QK-norm declares "input" for RMSNorm.forward(x): its one input
        name = next(iter(cfg.in_src_shardings))
    src = cfg.in_src_shardings.get(name)
    mesh = _titan_dims(module).resolve_shared_mesh([src, (cfg.in_dst_shardings or {}).get(name)])
    return None if src is None or mesh is None else (mesh, tuple(resolve_placements(src, mesh)))


@torch.fx.wrap
def as_replicated(t: Any, module: nn.Module, name: str | None = None) -> Any:
    """A plain floating tensor going into a call of ``module`` (see :func:`_takes_dtensors`) as a replicated DTensor on
    the module's mesh: every rank computed the same values (the graph's ops between module calls run on whole
    tensors), which is what a replicated DTensor stream held in the original. An input ``name`` torchtitan's wrapper
    of ``module`` takes as a sharded DTensor (Qwen3's QK-norm: heads sharded) is that rank's slice of it, as a
    DTensor of those placements (from the replicated one: the backward gathers the gradient)."""
    if not isinstance(t, torch.Tensor) or is_dtensor(t) or not t.is_floating_point():
        return t
    from torch.distributed.tensor import DTensor, Replicate

    placed = _titan_input(module, name)
    if placed is not None:
        mesh, placements = placed
        if any(p.is_partial() for p in placements):  # pragma: no cover - no plan hands a module a partial sum
            return t
        whole = DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return whole if all(p.is_replicate() for p in placements) else whole.redistribute(mesh, placements)
    mesh = _dtensor_mesh(module)
    if mesh is None:  # a container of parallelised modules (torchtitan's fused q/k/v): theirs
        mesh = next((m for m in map(_dtensor_mesh, module.modules()) if m is not None), None)
    if mesh is None:
        return t
    return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _wrapped(fn: Callable, graph: fx.Graph, x: Any, module: fx.Node, stack: dict, *extra: Any) -> Any:
    """``fn(x, module, *extra)`` (:func:`as_replicated`, :func:`as_local_shard`) for a floating tensor node ``x`` going
    into a call of ``module`` (anything else unchanged)."""
    v = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(v, torch.Tensor) or not v.is_floating_point():
        return x
    r = graph.create_node("call_function", fn, (x, module, *extra), name=f"{x.name}_{fn.__name__.removeprefix('as_')}")
    r.meta.update({k: v for k, v in x.meta.items() if k in ("val", "tensor_meta")})
    r.meta["nn_module_stack"] = stack
    return r


def check_live_modules(model: nn.Module, gm: fx.GraphModule, called: list[str], inlined: list[tuple[str, str]],
                       removed_hooks: dict[str, str], where: str) -> None:
    """After the lowering: every module whose hooks were taken out for the capture, and every module holding a
    tensor-parallel (DTensor, not FSDP2's) parameter, must run as a live module (called itself or inside a called
    module). Otherwise its hooks would not fire, or the graph would read a DTensor as a plain tensor: ConfigError
    naming the module and why its call stayed inlined."""
    from ...errors import ModuleCallError

    live = {c.partition("@")[0] for c in called}
    why = dict(inlined)

    def runs_live(path: str) -> bool:
        return any(path == c or path.startswith(c + ".") for c in live)

    in_graph = {v[0] for n in gm.graph.nodes for v in (n.meta.get("nn_module_stack") or {}).values()
                if isinstance(v, tuple) and v}  # the modules whose code this capture ran
    problems: list[str] = []
    modules: list[tuple[str, str]] = []
    wholes: list[str] = []  # torchtitan modules computed on whole tensors inlined (their wrappers skipped)
    for path, n in removed_hooks.items():
        if path in in_graph and not runs_live(path):
            if n == FORWARD_REPLACED and redistributes_only(model.get_submodule(path)):
                wholes.append(path)
                continue  # computed on whole tensors inlined; its state is checked below
            what = ("is sharded with FSDP (fully_shard): its parameters are gathered by hooks around its call"
                    if is_fsdp(model.get_submodule(path)) else f"has {n}")
            modules.append((path, why.get(path, "not a call of its own")))
            problems.append(f"{path} {what}, but its call stays inlined ({modules[-1][1]})")
    for path, mod in model.named_modules():
        if path in in_graph and not runs_live(path) and not _fsdp_managed(model, path):
            own = [k for k, p in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]
                   if is_dtensor(p) and not all(pl.is_replicate() for pl in p.placements)]  # replicated: read whole
            spmd = _spmd_state(mod)
            own += [k for k, pl in (spmd[1].items() if spmd is not None else ()) if not pl.is_replicate()]
            if own:
                modules.append((path, why.get(path, "not a call of its own")))
                problems.append(f"{path}.{own[0]} is sharded (tensor parallelism), but {path}'s call stays inlined "
                                f"({modules[-1][1]})")
    # a partial-gradient parameter (spmd_types R) inside an inlined whole module: read inline, or by its own live call
    # (on its input's shard, or whole with its outputs' gradient shared), it gets its share of the gradient; inside
    # another module's live call it would get a complete one
    pending = [(p, k) for p, m in model.named_modules() for k in _pending_on_tp(m)
               if runs_live(p) and p not in live and any(p.startswith(w + ".") for w in wholes)]
    if pending:
        path, k = pending[0]
        modules.append((path, "its plan leaves a gradient reduction to later"))
        problems.append(
            f"{path}.{k} is replicated on the tensor-parallel axis with each rank's gradient a partial sum that "
            "torchtitan reduces later (spmd_types R), but the rewrite computes the sublayer around it on whole "
            f"tensors and {path} is called with a whole input, so its gradient is already complete: the later "
            "reduction would count it once per rank")
    if problems:
        raise ModuleCallError(
            f"the {where} cannot keep these modules as module calls: " + "; ".join(problems[:4])
            + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
            + ". A converted model calls a module live only where the rewrite leaves its computation intact. "
            "Register such hooks, or apply the parallel plan, on modules the scheme leaves intact (the report's "
            "'modules called' line lists them), or remove them before converting.",
            modules,
        )


class ConstStr(str):
    """A string argument of a preserved module call, as export records it: a pytree node with no leaves and the
    string as its context. Export's call marker (``_export_tracepoint``) cannot take a ``str`` leaf (torch 2.14:
    ``AssertionError: Expected code to be unreachable, but got: 'mean'`` from ``proxy_tensor.extract_val``), so a
    module called with one (OLMo-core's ``LMHead``, ``loss_reduction="mean"``) would stay inlined. Wrapped, the
    string travels in the call's input spec; the module sees a ``str`` (this subclass) at capture, and the lowered
    call passes it as a constant (the generated code writes its ``repr``: a plain string)."""

    __slots__ = ()
    __module__ = __name__


pytree.register_pytree_node(ConstStr, lambda c: ([], str(c)), lambda _, context: ConstStr(context),
                            serialized_type_name=f"{__name__}.ConstStr")


def _strings_as_specs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward pre-hook (first of all) for a capture: every string in the call's inputs as a :class:`ConstStr`."""
    def wrap(x: Any) -> Any:
        return ConstStr(x) if type(x) is str else x

    return pytree.tree_map(wrap, args), pytree.tree_map(wrap, kwargs)


@contextlib.contextmanager
def _string_arguments_kept(model: nn.Module, paths: list[str]) -> Iterator[None]:
    handles = [model.get_submodule(p).register_forward_pre_hook(_strings_as_specs, with_kwargs=True, prepend=True)
               for p in paths]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _held_enter(*vals: Any) -> Any:  # pragma: no cover - a stand-in target while export's pass runs; never called
    return torch.amp._enter_autocast(*vals)


def _held_exit(mode: Any) -> Any:  # pragma: no cover - as above
    return torch.amp._exit_autocast(mode)


def autocast_blocks(nodes: Iterable[fx.Node]) -> Iterator[tuple[fx.Node, list[fx.Node], fx.Node]]:
    """Each ``torch.autocast`` block kept as nodes, innermost first: ``(_enter_autocast node, the nodes between, in
    order and nested blocks' included, _exit_autocast node)``."""
    open_: list[tuple[fx.Node, list[fx.Node]]] = []
    for n in nodes:
        if n.op == "call_function" and n.target is torch.amp._enter_autocast:
            open_.append((n, []))
        elif n.op == "call_function" and n.target is torch.amp._exit_autocast and open_:
            enter, body = open_.pop()
            if open_:
                open_[-1][1].extend((enter, *body, n))
            yield enter, body, n
        elif open_:
            open_[-1][1].append(n)


def reopen_autocast_at(graph: fx.Graph, points: Iterable[fx.Node]) -> int:
    """Close every ``torch.autocast`` block (kept as nodes) open at each node of ``points`` just before it and open it
    again just after, so the graph cut there (a pipeline stage boundary) leaves each part with whole blocks: the part
    before exits what it entered, the part after enters it anew, as the original ran those operations. Leaving and
    re-entering autocast between two operations changes no result. Returns the number of blocks reopened."""
    at, open_, reopened, seen = set(points), [], 0, set()
    for n in list(graph.nodes):
        seen.add(n)
        if n.op == "call_function" and n.target is torch.amp._enter_autocast:
            open_.append(n)
        elif n.op == "call_function" and n.target is torch.amp._exit_autocast and open_:
            open_.pop()
        elif n in at and open_:
            with graph.inserting_before(n):
                for e in reversed(open_):
                    seen.add(graph.call_function(torch.amp._exit_autocast, (e,)))
            after = n
            for k, e in enumerate(open_):
                with graph.inserting_after(after):
                    after = graph.call_function(torch.amp._enter_autocast, e.args, e.kwargs)
                after.meta = dict(e.meta)
                seen.add(after)
                for u in list(e.users):
                    if u not in seen:
                        u.replace_input_with(e, after)
                open_[k] = after
                reopened += 1
    return reopened


def _regions_around_calls(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node]]:
    """The ``(_enter_autocast, _exit_autocast)`` node pairs of ``graph`` (at any nesting) whose body holds an
    export call marker (a preserved module call made inside a ``torch.autocast`` block)."""
    marker = torch.ops.higher_order._export_tracepoint
    return [(enter, exit_) for enter, body, exit_ in autocast_blocks(graph.nodes)
            if any(x.op == "call_function" and x.target is marker for x in body)]


@contextlib.contextmanager
def _autocast_regions_kept() -> Iterator[None]:
    """While exporting: keep a ``torch.autocast`` block that holds a preserved module call as its plain
    ``_enter_autocast`` / ``_exit_autocast`` nodes in the root graph. Pre-dispatch export
    (``replace_autocast_with_hop_pass``, always run, no flag) moves every autocast block into a higher-order op's
    subgraph, and export collects the module-call markers of the root graph only, so a module called inside one
    (torchtitan's MoE router computes its ``gate`` under ``torch.autocast(dtype=float32)``) kept markers with no
    autograd formula and stayed inlined. The two nodes are ops export's verifier allows and the graph runs them as
    the block did (the autocast state set and restored around the call), so the lowered call runs in the same
    region, under any outer autocast as the original does."""
    with _KEEP_LOCK:
        if _KEEP["depth"] == 0:
            from torch._export.passes import replace_autocast_with_hop_pass as hop_pass

            _KEEP["real"] = hop_pass.replace_autocast_with_hop_pass
            hop_pass.replace_autocast_with_hop_pass = _keep_regions
        _KEEP["depth"] += 1
    outer, _KEEP_HERE.on = getattr(_KEEP_HERE, "on", False), True
    try:
        yield
    finally:
        _KEEP_HERE.on = outer
        with _KEEP_LOCK:
            _KEEP["depth"] -= 1
            if _KEEP["depth"] == 0:
                from torch._export.passes import replace_autocast_with_hop_pass as hop_pass

                hop_pass.replace_autocast_with_hop_pass = _KEEP.pop("real")


#: the export pass is patched once for all threads exporting at a time (a count under a lock: two conversions in two
#: threads would otherwise restore each other's patch and leave it installed) and acts only in a thread inside
#: :func:`_autocast_regions_kept` (another thread's own export meets the real pass)
_KEEP_LOCK = threading.Lock()
_KEEP: dict[str, Any] = {"depth": 0}
_KEEP_HERE = threading.local()


def _keep_regions(gm: fx.GraphModule, signature: Any) -> Any:
    real = _KEEP["real"]
    regions = _regions_around_calls(gm.graph) if getattr(_KEEP_HERE, "on", False) else []
    for enter, exit_ in regions:
        enter.target, exit_.target = _held_enter, _held_exit
    out = real(gm, signature)
    if regions:  # the pass may have copied the nodes into new graphs: put the real targets back everywhere
        for m in (gm, out[0]):
            for sub in m.modules():
                held = [n for n in (sub.graph.nodes if isinstance(sub, fx.GraphModule) else ())
                        if n.target is _held_enter or n.target is _held_exit]
                for n in held:
                    n.target = torch.amp._enter_autocast if n.target is _held_enter else torch.amp._exit_autocast
                if held:
                    sub.recompile()
    return out


def export_with_signatures(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any,
                           live: tuple[str, ...] = ()):
    """``torch.export.export`` (non-strict) preserving the call signatures of :func:`candidate_paths`. A path export
    refuses (named in its error) is dropped and the export retried; when the error names none, it is retried with
    no signatures at all (the lowering then calls nothing). The refused paths go to ``ep.meta``-less storage on the
    returned program as ``_dr_dropped``. ``live``: the paths that must run live (hooks or a forward taken out for the
    capture); a module taking a FlexAttention ``BlockMask`` is called only if it holds one of them or tensor-parallel
    parameters, else the lowering keeps it inlined (listed in ``_dr_dropped``, its signature kept: no second export):
    FlexAttention then runs as depthrewrite's operator, which the ``depthrewrite`` backend compiles and which trains
    on a CPU, where the model's own module may compile it itself or refuse a backward (torchtitan's)."""
    paths = candidate_paths(model)
    dropped: list[tuple[str, str]] = []

    def must_run_live(path: str) -> bool:
        return any(p == path or p.startswith(path + ".") for p in live) or _holds_tp(model, path)

    for _ in range(8):
        try:
            with _string_arguments_kept(model, paths), _autocast_regions_kept():
                ep = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False,
                                         preserve_module_call_signature=tuple(paths))
        except Exception as e:  # noqa: BLE001 - a refusal of one path; the plain export below reports the rest
            if not paths:
                raise
            text = str(e)
            named = _refused_path(e, paths) or [p for p in paths if re.search(rf"(?<![\w.]){re.escape(p)}(?![\w])", text)]
            why = f"{type(e).__name__}: {text.strip().splitlines()[0] if text.strip() else ''}"[:200]
            if named:
                worst = max(named, key=len)
                dropped.append((worst, "export refused its call signature: " + why))
                paths.remove(worst)
            else:
                dropped += [(p, "export refused the signatures: " + why) for p in paths]
                paths = []
            log.info("module calls: export refused %s; retrying without", dropped[-1][0] if named else "signatures")
            continue
        left = _tracepoints_left(ep)
        if left:
            # export removes its call markers from every graph it knows (collect_tracepoints_pass); one it left (a
            # region inside a higher-order op's subgraph: torchtitan's DeepSeek-V3 MoE) has no autograd formula, so
            # backward through it fails. Export those paths inlined.
            named = [p for p in paths if p in left]
            if not named:
                dropped += [(p, "export left its call markers in the graph") for p in paths]
                paths = []
            for path in named:
                dropped.append((path, "export left its call markers in the graph (kept inlined)"))
                paths.remove(path)
            log.info("module calls: export left call markers of %s; exporting them inlined", named or "signatures")
            continue
        held = [(e.fqn, t) for e in ep.module_call_graph
                if e.fqn in paths and e.signature is not None and (t := _object_input(e.signature.in_spec))]
        if held:
            # an object passed into the module (a KV cache its attention updates in place): at a preserved call
            # boundary export flattens and rebuilds the inputs, so the module would update a copy and the caller's
            # cache would never see the new keys and values (silently wrong decoding). Export it inlined.
            for path, t in held:
                dropped.append((path, f"it takes a {t}, which it updates in place (kept inlined)"))
                paths.remove(path)
            log.info("module calls: %s take an object input; exporting them inlined", [p for p, _ in held])
            continue
        masks = [e.fqn for e in ep.module_call_graph if e.fqn in paths and e.signature is not None
                 and _value_leaves(e.signature.in_spec) and not must_run_live(e.fqn)]
        # kept inlined by the lowering (their signatures stay recorded: no second export for them)
        dropped += [(path, "it takes a BlockMask and nothing needs it live: FlexAttention runs as depthrewrite's "
                           "operator") for path in masks]
        ep.__dict__["_dr_dropped"] = tuple(dropped)
        return ep
    ep = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
    ep.__dict__["_dr_dropped"] = tuple(dropped) + tuple((p, "too many refusals") for p in paths)
    return ep


def _tracepoints_left(ep: Any) -> set[str]:
    """The module paths of ``_export_tracepoint`` nodes still in any graph of ``ep`` (``_export_root.`` stripped)."""
    marker = torch.ops.higher_order._export_tracepoint
    found = set()
    for m in ep.graph_module.modules():
        if isinstance(m, fx.GraphModule):
            for n in m.graph.nodes:
                if n.op == "call_function" and n.target is marker:
                    p = str(n.kwargs.get("path", ""))
                    found.add(p[len("_export_root."):] if p.startswith("_export_root.") else p)
    return found


def _refused_path(e: BaseException, paths: list[str]) -> list[str]:
    """The preserved path whose call export's signature hooks (``torch/_export/wrappers.py``) refused in ``e``'s
    tracebacks (a SymInt or another non-tensor leaf among its inputs or outputs)."""
    seen: set[int] = set()
    found: list[str] = []
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            if frame.f_code.co_filename.replace("\\", "/").endswith("_export/wrappers.py"):
                p = frame.f_locals.get("path")
                if isinstance(p, str) and p.startswith("_export_root."):  # export wraps the model under this name
                    p = p[len("_export_root."):]
                if isinstance(p, str) and p in paths and p not in found:
                    found.append(p)
            tb = tb.tb_next
        e = e.__cause__ or e.__context__
    return found


def _canon(n: fx.Node) -> fx.Node:
    for _ in range(32):
        a = alias_of(n)
        if a is None:
            return n
        n = a
    return n


def _is_aux(n: fx.Node) -> bool:
    return str(n.target) == _ASSERT or alias_of(n) is not None


def _fingerprint(n: fx.Node) -> Any:
    def f(a: Any) -> Any:
        if isinstance(a, fx.Node):
            c = _canon(a)  # a no-op cast of a buffer (RoPE's inv_freq.to(device)) reads the buffer
            return ("attr", c.target) if c.op == "get_attr" else ("node", c.name)
        return ("const", repr(a))

    return pytree.tree_map(f, (n.args, n.kwargs), is_leaf=lambda a: isinstance(a, fx.Node))


def _leaves(fp: Any) -> list:
    return pytree.tree_leaves(fp, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str))


def stamp(gm: fx.GraphModule, ep: Any) -> None:
    """Stamp every node of the unlifted ``gm`` with its capture name and argument fingerprint and keep the
    signatures export recorded in ``gm.meta[SIGNATURES_META]``."""
    sigs = {e.fqn: e.signature for e in ep.module_call_graph if e.fqn and e.signature is not None}
    dead = _dead_at_capture(gm.graph)
    regions: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        n.meta[STAMP_META] = (n.name, _fingerprint(n))
        if n.op in ("call_function", "call_method") and not _is_aux(n) and n not in dead:
            for key, v in (n.meta.get("nn_module_stack") or {}).items():
                if isinstance(v, tuple) and v and v[0] in sigs:
                    regions.setdefault(key, []).append(n)
    gm.meta[SIGNATURES_META] = ModuleCallInfo(
        signatures=sigs, regions={k: frozenset(n.name for n in _own_ops(v)) for k, v in regions.items()},
        canon={n.name: _canon(n).name for n in gm.graph.nodes}, dropped=ep.__dict__.get("_dr_dropped", ()))


def _own_ops(nodes: list[fx.Node]) -> list[fx.Node]:
    """A region's ops less the size reads of tensors made outside it: export reuses the first symbol it saw for a
    size, so an op of the module may take the size of the caller's tensor (litgpt Gemma-2's attention reads the
    caller's mask slice's length). Such a read stays in the enclosing graph, where that tensor is; the live module
    computes the sizes it needs from its own inputs."""
    inside = set(nodes)
    return [n for n in nodes
            if not (n.target is torch.ops.aten.sym_size.int and isinstance(n.args[0], fx.Node) and n.args[0] not in inside)]


def _dead_at_capture(graph: fx.Graph) -> set[fx.Node]:
    """The ops nothing reads in the captured graph (an unused ``getitem`` of a multi-output op, a view litgpt computes
    and drops): the rewrite's dead-code pass removes them, which leaves the module that computes them unchanged, so
    they are not part of its region. Export's ``_assert_tensor_metadata`` checks keep nothing alive (the pass drops them
    too)."""
    dead: set[fx.Node] = set()
    for n in reversed(graph.nodes):
        if n.op not in ("call_function", "call_method"):
            continue
        if str(n.target) == _ASSERT or (not n.is_impure() and all(u in dead for u in n.users)):
            dead.add(n)
    return dead


def _name(n: Any) -> str | None:
    s = n.meta.get(STAMP_META) if isinstance(n, fx.Node) else None
    return s[0] if s else None


def _block_of(path: str, blocks: tuple[str, ...]) -> str | None:
    return next((b for b in blocks if path.startswith(b + ".")), None)


def _check(key: str, path: str, R: list[fx.Node], info: ModuleCallInfo, sig: Any, pos: dict,
           stack_paths: set[str], blocks: tuple[str, ...], by_name: dict[str, fx.Node]) -> tuple | str:
    """``(inputs by signature name, outputs [(signature name, node)], {no-op cast in R: the input it aliases})`` for
    region ``R``, or why it stays inlined. ``by_name``: the graph's nodes by capture name (a call input no op of the
    region reads, e.g. ``position_ids`` of an attention that takes its RoPE tables as arguments, is bound to the node
    captured under its name when that node is still in the graph)."""
    from torch.export.exported_program import ConstantArgument, TensorArgument

    canon = info.canon
    region = info.regions.get(key, frozenset())
    names = {_name(n) for n in R if not _is_aux(n)}
    if names != region:
        return f"region changed ({len(names & region)} of {len(region)} ops left, {len(names - region)} other)"
    if {b for b in blocks if b in stack_paths} != ({_block_of(path, blocks)} - {None}):
        return "called from another block than the one holding it"
    Rs = set(R)
    sig_in = {canon.get(a.name, a.name): a.name for a in sig.inputs if isinstance(a, TensorArgument)}
    internal = {canon.get(x, x) for x in region}
    bind: dict[str, fx.Node] = {}
    for n in R:
        if str(n.target) == _ASSERT:
            continue
        was = _leaves(n.meta[STAMP_META][1])
        now = pytree.tree_leaves((n.args, n.kwargs), is_leaf=lambda a: isinstance(a, fx.Node))
        if len(was) != len(now):
            return f"the arguments of {n.name} changed"
        for (kind, v), a in zip(was, now):
            if kind == "const":
                if isinstance(a, fx.Node) or repr(a) != v:
                    return f"a constant of {n.name} changed"
            elif kind == "attr":
                if not (isinstance(a, fx.Node) and _canon(a).op == "get_attr" and _canon(a).target == v):
                    return f"{n.name} reads another attribute"
            elif v in internal:
                c = _canon(a) if isinstance(a, fx.Node) else None
                if c is None or c not in Rs or canon.get(_name(c), _name(c)) != v:
                    return f"an internal input of {n.name} changed"
            elif isinstance(a, fx.Node) and isinstance(a.meta.get("val"), (torch.SymInt, int)):
                continue  # a size: the live module recomputes it from its tensor inputs
            elif v in sig_in:
                cur = _canon(a) if isinstance(a, fx.Node) else None
                if cur is None or bind.setdefault(sig_in[v], cur) is not cur:
                    return f"call input {v} is bound inconsistently"
            else:
                return f"{n.name} reads {v}, which is not an input of the module call"
    inputs: dict[str, Any] = {}
    for a in sig.inputs:
        if isinstance(a, TensorArgument):
            if a.name not in bind:
                unread = by_name.get(a.name)
                if unread is None or unread in Rs:
                    return f"call input {a.name} is read by no op of the region and is no longer in the graph"
                bind[a.name] = unread
            inputs[a.name] = bind[a.name]
        elif not isinstance(a, ConstantArgument):
            return f"call input {a} is not a tensor or a constant"
    first = min(pos[n] for n in R)
    if any(pos[x] > first for x in inputs.values()):
        return "a call input is computed after the region starts"
    outs = []
    for a in sig.outputs:
        if isinstance(a, ConstantArgument):  # attention's (output, None): nothing in the graph reads the None
            outs.append((None, None))
            continue
        if not isinstance(a, TensorArgument):
            return f"call output {a} is not a tensor or a constant"
        want = canon.get(a.name, a.name)
        src = [n for n in R if not _is_aux(n) and canon.get(_name(n), _name(n)) == want]
        if len(src) != 1:
            return f"call output {a.name} is not one op of the region"
        outs.append((a.name, src[0]))
    out_nodes = {o for _, o in outs if o is not None}
    bound = set(inputs.values())
    redirect: dict[fx.Node, fx.Node] = {}
    for n in R:
        if n not in out_nodes and any(u not in Rs for u in n.users):
            c = _canon(n)
            if c is n or (c in Rs and c not in out_nodes) or (c not in Rs and c not in bound):
                return f"{n.name} is read outside the module but is not a call output"
            redirect[n] = c  # a no-op cast of a call input (RMSNorm's h.to(float32)) or output: readers read that
    return inputs, outs, redirect


_CONTAINERS = (tuple, list, dict)


def _object_input(spec: pytree.TreeSpec) -> str | None:
    """The type name of a non-container pytree node in a module's input spec (a transformers ``DynamicCache`` passed
    to an attention module), or None: such a call cannot be rebuilt from the graph's tensors. A FlexAttention
    ``BlockMask`` can: nothing updates it in place, and its unflatten rebuilds it (mask function included)."""
    if spec.is_leaf():
        return None
    if (spec.type not in _CONTAINERS and not (isinstance(spec.type, type) and issubclass(spec.type, _CONTAINERS))
            and not is_block_mask_type(spec.type) and spec.type is not ConstStr):
        return spec.type.__name__
    return next((t for c in _children(spec) if (t := _object_input(c)) is not None), None)


def lower_module_calls(gm: fx.GraphModule, blocks: tuple[str, ...] = (), live: nn.Module | None = None
                       ) -> tuple[fx.Graph, list[str], list[tuple[str, str]]]:
    """A copy of ``gm``'s (rewritten, flat) graph with a ``call_module`` of each intact candidate region; the node
    names of everything kept are ``gm``'s. Returns ``(graph, called paths, [(path, why) stayed inlined])``.
    ``blocks``: the block paths; a module is called only from inside the block that holds it (or from outside
    every block when no block holds it). ``live``: the model; a called module holding tensor-parallel parameters
    gets its outputs' sizes checked at run time (:func:`check_local_shape`)."""
    info: ModuleCallInfo = gm.meta[SIGNATURES_META]
    tp = {p for p in info.signatures
          if live is not None and (_holds_tp(live, p) or _spmd_sharded_below(live.get_submodule(p)) is not None
                                   or _pending_shard_input(live.get_submodule(p)) is not None
                                   or _pending_whole(live, p))}
    graph = gm.graph
    pos = {n: i for i, n in enumerate(graph.nodes)}
    count: dict[str, int] = {}
    for n in graph.nodes:
        nm = _name(n)
        if nm is not None:
            count[nm] = count.get(nm, 0) + 1
    by_key: dict[str, tuple[str, list[fx.Node]]] = {}
    for n in graph.nodes:
        if n.op in ("call_function", "call_method"):
            for key, v in (n.meta.get("nn_module_stack") or {}).items():
                if isinstance(v, tuple) and v and v[0] in info.signatures:
                    by_key.setdefault(key, (v[0], []))[1].append(n)
    by_name = {nm: n for n in graph.nodes if (nm := _name(n)) is not None and count[nm] == 1}
    refused: list[tuple[str, str]] = list(info.dropped)
    kept_inlined = {p for p, _ in info.dropped}  # decided at the export (a module taking a BlockMask)
    plan: dict[fx.Node, tuple] = {}  # first node of a region -> (path, inputs, outs, stack)
    gone: set[fx.Node] = set()
    redirect: dict[fx.Node, fx.Node] = {}
    for key, (path, nodes) in sorted(by_key.items(), key=lambda kv: kv[1][0].count(".")):
        if path in kept_inlined:
            continue
        R = _own_ops([n for n in nodes if n not in gone and role_of(n) is None and _name(n) is not None])
        if not R:
            continue
        if any(count[_name(n)] > 1 for n in R):
            refused.append((path, "its ops were copied by the rewrite"))
            continue
        held = _object_input(info.signatures[path].in_spec)
        if held is not None:  # a KV cache object: the caller's cache is written back around the whole graph instead
            refused.append((path, f"it takes a {held} (the graph carries its tensors, not the object)"))
            continue
        stack = dict(R[0].meta.get("nn_module_stack") or {})
        keys = list(stack)
        parent = {k: stack[k] for k in keys[:keys.index(key)]} if key in stack else {}
        got = _check(key, path, R, info, info.signatures[path], pos, {v[0] for v in parent.values()}, blocks,
                     by_name)
        if isinstance(got, str):
            refused.append((path, got))
            continue
        inputs, outs, aliases = got
        plan[min(R, key=pos.__getitem__)] = (path, inputs, outs, parent, key)
        gone.update(R)
        redirect.update(aliases)

    out = fx.Graph()
    out._codegen = graph._codegen
    env: dict[fx.Node, fx.Node] = {}
    called: list[str] = []
    for n in graph.nodes:
        if n in plan:
            path, inputs, outs, parent, key = plan[n]
            sig = info.signatures[path]
            flat = [env[inputs[a.name]] if a.name in inputs else a.value for a in sig.inputs]
            checked = path in tp
            mod_node = None
            if checked:
                mod_node = out.create_node("get_attr", path, name=f"_dr_module_{len(called)}")
                mod_node.meta["nn_module_stack"] = parent
            if checked and _takes_dtensors(live, path):
                values = _value_leaves(sig.in_spec)  # a BlockMask's tensors stay as they are
                names = _input_names(sig.in_spec, live.get_submodule(path))
                flat = [x if i in values else _wrapped(as_replicated, out, x, mod_node, parent, names[i])
                        for i, x in enumerate(flat)]
            share = _spmd_state(live.get_submodule(path))[0].size() if checked and _pending_whole(live, path) else None
            if share is not None:  # its outputs keep 1/n of their gradient (below)
                flat = [_wrapped(as_summed_input, out, x, mod_node, parent) for x in flat]
            elif checked and _pending_shard_input(live.get_submodule(path)) is not None:  # as its wrapper takes it
                names = _input_names(sig.in_spec, live.get_submodule(path))
                flat = [_wrapped(as_input_shard, out, x, mod_node, parent, names[i]) for i, x in enumerate(flat)]
            elif checked and _row_parallel(live.get_submodule(path)):  # its input's shard
                flat = [_wrapped(as_local_shard, out, x, mod_node, parent) for x in flat]
            elif checked and _takes_whole_into_columns(live.get_submodule(path)):
                flat = [_wrapped(as_tp_input, out, x, mod_node, parent) for x in flat]
            args, kwargs = _unflatten_inputs(out, flat, sig.in_spec, parent)
            leaf = sig.out_spec.is_leaf()
            call = out.create_node("call_module", path, tuple(args), dict(kwargs),
                                   name=outs[0][1].name if leaf and outs[0][1] is not None and not checked
                                   else f"_dr_call_{len(called)}")
            call.meta["nn_module_stack"] = parent
            call.meta[CALL_META] = path
            names = iter([(f"_dr_out_{len(called)}_{i}" if checked else src.name) if src is not None else None
                          for i, (_, src) in enumerate(outs)])
            results = [call] if leaf else _spec_outputs(out, call, sig.out_spec, names)
            if len(results) != len(outs):  # pragma: no cover - export's spec and outputs disagree
                raise AssertionError(f"module call {path}: {len(results)} outputs for {len(outs)} signature outputs")
            for r, (_, src) in zip(results, outs):
                if src is None:  # a constant output (no node)
                    continue
                r.meta.update({k: v for k, v in src.meta.items() if k in ("val", "tensor_meta", "stack_trace")})
                if r is not call:
                    r.meta["nn_module_stack"] = parent
                if checked:
                    v = src.meta.get("val")
                    dims = tuple(d if isinstance(d, int) else None for d in v.shape) if isinstance(v, torch.Tensor) else None
                    parent_path = path.rpartition(".")[0]
                    why = next((w for p, w in refused if p == parent_path), "")
                    to_output = bool(src.users) and all(u.op == "output" for u in src.users)
                    r = out.create_node("call_function", check_local_shape,
                                        (r, dims, path, parent_path, why, to_output, mod_node), name=src.name)
                    r.meta.update({k: v for k, v in src.meta.items() if k in ("val", "tensor_meta")})
                    r.meta["nn_module_stack"] = parent
                    if share is not None:
                        kept = out.create_node("call_function", as_gradient_share, (r, share), name=f"{src.name}_share")
                        kept.meta.update(r.meta)
                        r = kept
                env[src] = r
            called.append(f"{path}@{key.rpartition('@')[2]}" if "@" in key else path)
        if n in redirect:
            env[n] = env[_final(redirect, n)]
            continue
        if n in gone:
            continue
        if n.op == "call_module" and n.target == "_guards_fn" and not n.users:
            # export's input-guard call: the converted model checks inputs itself; kept, it would leave the block
            # runner a `_guards_fn` attribute of None, and export's input-constraint pre-hook skips its check when
            # that attribute exists (a relation such as a cache length would go unchecked)
            continue
        env[n] = out.node_copy(n, env.__getitem__)
    for n in [n for n in out.nodes if n.op == "get_attr" and not n.users]:  # the called modules' own weights
        out.erase_node(n)
    if live is not None:
        _replicated_reads_local(out, live)
        _pending_reads_shared(out, live)
    out.lint()
    return out, called, refused


def _live_tensor(live: nn.Module, path: str) -> torch.Tensor | None:
    """The parameter or buffer of ``live`` at ``path``, or None (a submodule, or nothing there)."""
    for get in (live.get_parameter, live.get_buffer):
        try:
            return get(path)
        except AttributeError:
            pass
    return None


@torch.fx.wrap
def whole_local(t: Any) -> Any:
    """A replicated DTensor parameter or buffer the graph reads directly (an inlined module's state under torchtitan's
    plan: a RoPE cache), as the plain whole tensor every rank holds; its gradient a replicated DTensor (every rank
    computed it whole). Anything else unchanged."""
    if is_dtensor(t):
        return t.to_local(grad_placements=t.placements)
    return t


def _replicated_reads_local(graph: fx.Graph, live: nn.Module) -> None:
    """Each ``get_attr`` of a replicated DTensor (in ``live`` now) read through :func:`whole_local`."""
    for n in [n for n in graph.nodes if n.op == "get_attr"]:
        t = _live_tensor(live, n.target)
        if not is_dtensor(t) or not all(p.is_replicate() for p in t.placements):
            continue
        with graph.inserting_after(n):
            r = graph.create_node("call_function", whole_local, (n,), name=f"{n.name}_local")
        r.meta.update(n.meta)
        n.replace_all_uses_with(r, delete_user_cb=lambda u: u is not r)


class _GradientShare(torch.autograd.Function):
    """The identity forward; the gradient divided by ``n`` backward."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, n: int) -> torch.Tensor:
        ctx.n = n
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad / ctx.n, None


@torch.fx.wrap
def as_gradient_share(t: Any, n: int) -> Any:
    """A parameter torchtitan declares ``R`` on the tp axis (``spmd_types``: each rank's gradient a partial sum over
    its shard, which a later reduction over the ranks completes), read by an inlined module computed on whole
    tensors, whose gradient is complete on every rank: each rank keeps ``1/n`` of it, so the reduction sums the whole
    once (n = 2: exactly)."""
    if isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled():
        return _GradientShare.apply(t, n)
    return t


def _pending_reads_shared(graph: fx.Graph, live: nn.Module) -> None:
    """Each ``get_attr`` of a partial-gradient parameter (:func:`_pending_on_tp`) read through
    :func:`as_gradient_share`."""
    for n in [n for n in graph.nodes if n.op == "get_attr"]:
        owner, _, name = n.target.rpartition(".")
        try:
            mod = live.get_submodule(owner)
        except AttributeError:
            continue
        if name not in _pending_on_tp(mod):
            continue
        with graph.inserting_after(n):
            r = graph.create_node("call_function", as_gradient_share, (n, _spmd_state(mod)[0].size()),
                                  name=f"{n.name}_share")
        r.meta.update(n.meta)
        n.replace_all_uses_with(r, delete_user_cb=lambda u: u is not r)


def _row_parallel(mod: nn.Module) -> bool:
    """A row-parallel Linear: a DTensor weight sharded along its inputs, or a plain local shard of one (spmd_types)."""
    spmd = _spmd_weight_dim(mod)
    return (spmd[1] == 1) if spmd is not None else _sharded_weight(mod, 1) is not None


def _takes_whole_into_columns(mod: nn.Module) -> bool:
    """Under ``spmd_types``: ``mod`` or a module below it is a column-parallel Linear of plain local shards, and no
    wrapper on the way takes the input in (its own ``in_src_shardings``): :func:`as_tp_input` before the call."""
    mods = list(mod.modules())
    return not any(_converts_inputs(m) for m in mods) and any(
        (w := _spmd_weight_dim(m)) is not None and w[1] == 0 for m in mods)


def _input_names(spec: pytree.TreeSpec, module: nn.Module) -> list[str | None]:
    """Per flat leaf of a module call's ``(args, kwargs)`` spec: the argument it is (positional arguments named by
    torchtitan's record of the forward's parameters), or None (inside a container, or not known)."""
    args, kwargs = _children(spec)
    pos = module._cache_pos_arg_names() if callable(getattr(module, "_cache_pos_arg_names", None)) else []
    names: list[str | None] = []
    for i, c in enumerate(_children(args)):
        names += [pos[i] if i < len(pos) and c.is_leaf() else None] * c.num_leaves
    for k, c in zip(kwargs.context, _children(kwargs)):
        names += [k if c.is_leaf() else None] * c.num_leaves
    return names


def _children(spec: pytree.TreeSpec) -> list:
    return spec.children() if callable(getattr(spec, "children", None)) else spec.children_specs  # torch < 2.13


class RebuildValue:
    """A graph target rebuilding a value object (a FlexAttention ``BlockMask``) from its pytree leaves, as a module
    call takes it: ``TreeSpec.unflatten`` on graph nodes would run its constructor on the nodes themselves."""

    __module__ = __name__

    def __init__(self, spec: pytree.TreeSpec):
        self.spec = spec
        self.__name__ = f"rebuild_{spec.type.__name__}"

    def __call__(self, *leaves: Any) -> Any:
        return pytree.tree_unflatten(list(leaves), self.spec)

    def __repr__(self) -> str:
        return self.__name__

    def __reduce__(self) -> tuple:  # pickled by its class and spec (its __name__ names no module attribute)
        return RebuildValue, (self.spec,)


def _value_leaves(spec: pytree.TreeSpec) -> set[int]:
    """The flat indices of the leaves inside a ``BlockMask`` of ``spec``."""
    out: set[int] = set()

    def walk(s: pytree.TreeSpec, start: int) -> None:
        if is_block_mask_type(s.type):
            out.update(range(start, start + s.num_leaves))
        elif not s.is_leaf():
            for c in _children(s):
                walk(c, start)
                start += c.num_leaves

    walk(spec, 0)
    return out


def _unflatten_inputs(g: fx.Graph, flat: list, spec: pytree.TreeSpec, stack: dict) -> Any:
    """``tree_unflatten(flat, spec)`` for a module call's inputs, each ``BlockMask`` in them one node rebuilding it."""
    leaves = iter(flat)

    def walk(s: pytree.TreeSpec) -> Any:
        if s.is_leaf():
            return next(leaves)
        if is_block_mask_type(s.type):
            node = g.create_node("call_function", RebuildValue(s), tuple(next(leaves) for _ in range(s.num_leaves)),
                                 name="_dr_block_mask")
            node.meta["nn_module_stack"] = stack
            return node
        kids = [walk(c) for c in _children(s)]
        return pytree.SUPPORTED_NODES[s.type].unflatten_fn(kids, s.context)

    return walk(spec)


def _final(redirect: dict[fx.Node, fx.Node], n: fx.Node) -> fx.Node:
    """Where a redirected no-op cast's readers read: through redirects of nested called regions too."""
    while n in redirect:
        n = redirect[n]
    return n


def _spec_outputs(g: fx.Graph, call: fx.Node, spec: Any, names: Any) -> list[fx.Node | None]:
    """The flat outputs of ``call`` by its pytree ``spec`` (tuples, lists and dicts): a ``getitem`` per output leaf,
    named by ``names`` (the replaced nodes' names, which the report and the block split read), None for a constant
    leaf (``names`` gives None)."""
    if spec.is_leaf():
        name = next(names)
        return [call if name is not None else None]
    if spec.type not in (tuple, list, dict):
        raise ValueError(f"output container {spec.type.__name__}")
    keys = spec.context if spec.type is dict else range(spec.num_children)
    flat: list[fx.Node | None] = []
    for k, child in zip(keys, spec.children()):
        if child.is_leaf():
            name = next(names)
            flat.append(None if name is None else g.create_node("call_function", operator.getitem, (call, k),
                                                                name=name))
        else:
            flat += _spec_outputs(g, g.create_node("call_function", operator.getitem, (call, k),
                                                   name=f"{call.name}_item_{k}"), child, names)
    return flat
