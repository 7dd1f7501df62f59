"""The conversion state (``model.__dict__["_depthrewrite"]``): the recipe, the graphs per call structure, and a call
(:meth:`ConversionState.call`: check the module tree, choose or capture the graph, run it, write the cache back)."""

from __future__ import annotations

import contextlib
import copy
import inspect as _inspect
import logging
import time
from collections import OrderedDict
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from ..blocks import block_infos, build_runner, convert_blocks, get_path, share_live, traced_with_meta, unwrap
from ..capture import CONTINUATION_META, is_cache, register_cache_support
from ..converted import as_converted
from ..errors import ConfigError, DepthRewriteError
from ..flexattention import is_block_mask, register_block_mask_for
from ..passes.analyse.graph import describe_collective, first_collective
from ..passes.lower.module_calls import is_dtensor
from ..passes.rewrite.msar_decode import HISTORY_META
from ..pipeline import split
from .caches import EXTRA_LAYERS, SEEN_TOKENS, check_cache, output_cache, store_history, write_back
from .entries import LOCK, GraphEntry, call_graph, describe_value, guards_of, readable_structure, traced_call
from .offload import loaded, offload_hooks, offloaded_reads
from . import tree as tree_module
from .rewrite import capture_and_rewrite
from .tree import (PLAIN_TENSORS, ModuleTree, called_modules, check_block_hooks, check_global_hooks, direct_reads,
                   outside_the_call, warn_user_hooks)

log = logging.getLogger(__name__)


# ---- the conversion state -----------------------------------------------------------------------------------------


def _run(entry: GraphEntry, pos: tuple, kw: dict, exporting: bool = False) -> Any:
    """One call of ``entry``'s graphs (inside torch.export: the flat graph, as a module call), with what they read of
    accelerate's offloaded modules loaded around it. Outside a trace the call's sizes were matched against the
    entry's guards when it was chosen (or captured from this very call), which is export's input check when the
    guards are complete."""
    with loaded(entry.offloaded) if entry.offloaded else contextlib.nullcontext():
        return entry.module(*pos, **kw) if exporting else call_graph(entry.run, pos, kw, checked=entry.complete)


def _block_mask_leaves(args: tuple, kwargs: dict) -> list[bool]:
    """For each tensor of a call's inputs, in flattening order: whether it belongs to a FlexAttention ``BlockMask``."""
    out: list[bool] = []
    for x in pytree.tree_leaves((args, kwargs), is_leaf=is_block_mask):
        if is_block_mask(x):
            out += [True] * sum(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(x))
        elif isinstance(x, torch.Tensor):
            out.append(False)
    return out


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
            tuple((k, describe_value(v)) for k, v in bound.items()),
        )

    def check_tree(self, model: nn.Module) -> None:
        tree = self.tree
        if tree is None:
            self.tree = ModuleTree(model)
            tree = self.tree
            if not self.module_calls:  # with module calls, a hooked module is called or refused
                warn_user_hooks(tree)
        elif tree_module.CHECK_MODULE_TREE and tree.changed(model) and not self._same_logic(model):
            path, change = tree.change(model)
            log.info("depthrewrite: %s: module tree changed (%s %s); recapturing", self.original.__name__, path, change)
            self.drop_graphs()
            self.tree = ModuleTree(model)
            tree = self.tree
            self.recaptures += 1
            if not self.module_calls:  # with module calls, a hooked module is called or refused
                warn_user_hooks(tree)

    def _same_logic(self, model: nn.Module) -> bool:
        """After a change to the module tree: whether the block runners read the new tree as the old one (a block
        wrapped for checkpointing or compile, sharded with FSDP2, hooked; a parameter reassigned). Then the new tree
        is recorded and the graphs are kept."""
        if self.blocks is None or self.pipeline_stages is not None:
            return False
        new = ModuleTree(model, self.tree.called)
        if new.logical != self.tree.logical:
            return False
        resharded = self.tree.resharded(new)
        if resharded is not None:  # a called module's output may change size: the graphs around it recaptured
            log.info("depthrewrite: %s: %s no longer holds a tensor of shape %s (resharded); recapturing",
                     self.original.__name__, *resharded)
            return False
        wrapped = self._subclass_read_inline(model)
        if wrapped is not None:  # its graphs read it as aten ops a tensor subclass may not implement: recapture
            log.info("depthrewrite: %s: %s is now a %s read by the graphs' own ops; recapturing",
                     self.original.__name__, *wrapped)
            return False
        self.tree = new
        for e in self.entries():  # accelerate may have offloaded what a kept graph reads directly (dispatch_model)
            e.offloaded = offloaded_reads(model, direct_reads([e]))
        return True

    def _subclass_read_inline(self, model: nn.Module) -> tuple[str, str] | None:
        """``(path, type name)`` of a parameter or buffer the captured graphs read directly (a ``get_attr`` of the
        runner or of a block program, not inside a module call) that is now a tensor subclass (torchao's
        ``quantize_`` swaps weights for ``Int8Tensor`` and the like): the graphs' aten ops (``aten.linear`` runs as
        ``t`` + ``mm`` below ``__torch_function__``) may not be implemented by it, so the graph is captured again,
        through the subclass. A module called live sees ``F.linear`` and needs nothing. DTensors are left to the
        tensor-parallel checks."""
        for path in direct_reads(self.entries()):
            t: Any = model
            for part in path.split("."):  # through wrappers (checkpoint_wrapper, compile), as the graphs read it
                t = getattr(unwrap(t) if isinstance(t, nn.Module) else t, part, None)
            if isinstance(t, torch.Tensor) and type(t) not in PLAIN_TENSORS and not is_dtensor(t):
                return path, type(t).__name__
        return None

    def select(self, model: nn.Module, args: tuple, kwargs: dict, *, capture: bool = True,
               fresh: bool = False) -> tuple[GraphEntry, tuple, dict]:
        """The graph for this call (captured if there is none yet) and the call's ``(args, kwargs)`` for it. While
        traced (``capture=False``) the module tree is not checked: the tracer (pipelining's export, Dynamo) may wrap
        the model, and no graph can be captured inside a trace anyway."""
        with LOCK.mutex:
            found = self._lookup(model, args, kwargs, capture=capture, fresh=fresh)
        if found[0] is not None or not capture:
            return found[:3]
        with LOCK.exclusive():  # no other thread inside a converted model until the graph is captured
            with LOCK.mutex:  # another thread may have captured this structure meanwhile
                found = self._lookup(model, args, kwargs, capture=True, fresh=fresh)
            entry, pos, kw, key, bound = found
            if entry is not None:
                return entry, pos, kw
            entry = self.capture(model, pos, kw, readable_structure(bool(model.training), bound))
            with LOCK.mutex:
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
            register_cache_support()  # before the key: the cache's layout is part of the call structure
        register_block_mask_for(bound.values())  # before the key, as the cache's: a FlexAttention mask's structure
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
                    f"({readable_structure(bool(model.training), bound)}) and cannot capture one while it is being traced "
                    "(torch.export, pipelining's pipeline()): call it once eagerly with the same kind of inputs first."
                )
            return entries[0], pos, kw, key, bound
        return None, pos, kw, key, bound

    def capture(self, model: nn.Module, args: tuple, kwargs: dict, structure: str) -> GraphEntry:
        # accelerate's offloaded modules hold meta weights outside their own forward: loaded while capturing
        with LOCK.exclusive(), outside_the_call(), loaded(offload_hooks(model)):
            t0 = time.perf_counter()
            gm, result = capture_and_rewrite(model, self, args, kwargs)
            self.captures += 1
            if self.pipeline_stages is not None:
                split(gm, self.pipeline_stages, **self.pipeline_kw)
            runner = self.keep_blocks(model, gm)
        guards = guards_of(gm)
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)]
        in_mask = _block_mask_leaves(args, kwargs)  # a BlockMask's sizes are its structure: not listed
        if len(in_mask) != len(names):
            in_mask = [False] * len(names)
        fixed = [f"{name}.shape[{d}]={g}" for name, dims, m in zip(names, guards, in_mask) for d, g in dims.items()
                 if isinstance(g, int) and d < 2 and "cache" not in name and not m]
        if fixed:  # dimensions export specialised: this graph runs those sizes only
            structure += f" ({', '.join(fixed)})"
        entry = GraphEntry(module=gm, structure=structure, guards=guards, seconds=time.perf_counter() - t0,
                           runner=runner)
        entry.offloaded = offloaded_reads(model, direct_reads([entry]))
        traced = first_collective(entry.graphs())
        entry.collective = describe_collective(traced) if traced is not None else None
        # the first capture adds model.depthrewrite; what is opaque depends on every graph kept, this one too
        self.tree = ModuleTree(model, called_modules([*self.entries(), entry]))
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
        paths = gm.meta.get("depthrewrite_blocks")
        if isinstance(paths, str) or not paths:  # no block modules: the reason
            runner, why = None, paths or "no blocks"
        else:
            if self.blocks is None:
                check_block_hooks(model, paths)
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
            check_cache(caches[0], self.original.__name__)
        exporting = torch.compiler.is_exporting() and traced_call(args, kwargs)  # the flag is the process's, not ours
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
                and not caches[0].__dict__.get(EXTRA_LAYERS):
            raise ConfigError(
                f"the KV cache passed to the converted {self.original.__name__} holds {caches[0].get_seq_length()} "
                "tokens but no decoding state of this conversion (MSAR's conv history): it was filled by another model "
                "(the unconverted one?) or rebuilt from tensors. Fill it with the converted model (prefill with it), or "
                "call with use_cache=False."
            )
        tracing = exporting or torch.compiler.is_dynamo_compiling()
        refuse = None
        if entry.collective is not None and torch.is_grad_enabled() and not exporting:
            refuse = _traced_collectives_error(entry, self.original.__name__,
                                               self.blocks_note if entry.runner is None else None)
            if torch.compiler.is_dynamo_compiling():  # no backward hook in a trace: refused before it
                raise refuse
        if not tracing and tree_module.CHECK_MODULE_TREE:
            check_global_hooks(entry, self.original.__name__)
        try:
            out = _run(entry, pos, kw, exporting)
        except RuntimeError as e:
            # export's own input check (a relation between sizes our guards do not model, e.g. a cache length derived
            # from the new tokens at a sliding window's edge) fails before anything runs: this call gets its own graph
            if "Expected input at" not in str(e) or tracing:
                raise
            entry, pos, kw = self.select(model, args, kwargs, fresh=True)
            if tree_module.CHECK_MODULE_TREE:
                check_global_hooks(entry, self.original.__name__)
            out = _run(entry, pos, kw)
        if refuse is not None:
            _no_backward(out, refuse)
        self.last[bool(model.training)] = entry
        entry.calls += 1
        history = None
        if entry.module.meta.get(HISTORY_META):
            out, history = out
        if caches:
            tokens = next((kw[k] for k in ("input_ids", "inputs_embeds") if isinstance(kw.get(k), torch.Tensor)), None)
            out = write_back(caches[0], out, tokens.shape[1] if tokens is not None and tokens.dim() >= 2 else None)
        if history is not None:
            target = caches[0] if caches else output_cache(out)[0]
            store_history(target, history)
            target.__dict__[SEEN_TOKENS] = target.get_seq_length()
        return out


def _traced_collectives_error(entry: GraphEntry, name: str, flat_because: str | None) -> ConfigError:
    """A graph that runs a tensor-parallel plan's communication inlined (traced from the modules' own code, as
    torchtitan's ``spmd_types`` backend does) computes the forward right, but the plan's backward communication (the
    gradient all-reduce of a column-parallel layer's input, an autograd function whose forward is the identity) was
    not traced: gradients would be wrong, silently. The error a backward through such a call raises."""
    why = (f"the model runs one flat graph ({flat_because}), which calls no module" if flat_because is not None else
           "this conversion inlines the modules (module_calls=False, or a module whose call cannot be kept)")
    return ConfigError(
        f"the converted {name} cannot compute gradients through this call: its graph for it ({entry.structure}) runs "
        f"the model's own cross-rank communication inlined ({entry.collective}), because {why}. Traced into a graph, "
        "tensor parallelism keeps its forward communication (the forward is exact) but loses what its modules do in "
        "backward (the gradient all-reduce of a column-parallel layer's input), so the gradients would be wrong. "
        "Convert with module calls (the default, module_calls=None) so the parallelised modules run live, or use this "
        "call for inference only (under torch.no_grad() nothing is refused)."
    )


def _no_backward(out: Any, error: Exception) -> None:
    """Make a backward through any tensor of ``out`` raise ``error`` (the forward stays usable)."""
    def refuse(grad):
        raise error

    for t in pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(refuse)


FULLGRAPH_REASON = (
    "depthrewrite: a converted model picks the captured graph for each call (module-tree checks, a capture on a new "
    "call structure) outside Dynamo's trace, so torch.compile(converted, fullgraph=True) cannot make the whole model "
    "one graph. Compile per block instead (block.compile(fullgraph=True, backend='depthrewrite') on each transformer "
    "block module: docs/backend.md), or compile the whole model without fullgraph=True (one graph break here)"
)


def _select_eagerly(st: ConversionState, model: nn.Module, args: tuple, kwargs: dict):
    """:meth:`ConversionState.select` outside Dynamo's trace (a graph break): the module-tree check and a capture run
    as in eager mode, and Dynamo guards on the graph module returned."""
    entry, pos, kw = st.select(model, args, kwargs)
    if entry.runner is not None:  # Dynamo copies our node tags (again after torch._dynamo.reset(), which forgets)
        traced_with_meta(entry.runner)
    return entry, pos, kw


try:  # a graph break under torch.compile; with fullgraph=True Dynamo's error carries the reason
    _select_eagerly = torch._dynamo.disable(_select_eagerly, reason=FULLGRAPH_REASON)
except TypeError:  # pragma: no cover - a torch without disable(reason=)
    _select_eagerly = torch._dynamo.disable(_select_eagerly)


def _checkpoint_parents(model: nn.Module, paths: tuple[str, ...]) -> list[nn.Module]:
    """The model and the modules above its blocks that have a ``gradient_checkpointing`` attribute (models whose own
    loop checkpoints its layers when it is on)."""
    out: list[nn.Module] = []
    for p in paths:
        parts = p.split(".")
        for i in range(len(parts)):
            m = get_path(model, ".".join(parts[:i]))
            if m is not None and hasattr(m, "gradient_checkpointing") and all(m is not o for o in out):
                out.append(m)
    return out


def _ref_param(model: nn.Module) -> torch.Tensor | None:
    return next((p for p in model.parameters() if p.is_floating_point()), None)


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
