"""The public verbs: :func:`inspect` and :func:`convert`."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect as _inspect
import logging
import types as _types
from typing import Any, Callable, TypeVar

import torch

import torch.fx as fx
import torch.nn as nn

from .blocks import block_paths, blocks_for_capture, hf_checkpointing_drops_cache, unwrapped_path
from .capture import CONTINUATION_META, capture, example_inputs_for, is_cache, state_writes
from .converted import as_converted, drop_dead_code
from .errors import CaptureError, ConfigError, DepthRewriteError, ModuleCallError, NotFunctionPreservingWarning
from .passes.analyse.chain import detect_chain
from .passes.rewrite import SchemeConfig, get_handler, scheme_config
from .passes.rewrite import scheme as scheme_record
from .passes.rewrite.blocks import block_size_for
from .passes.rewrite.editor import PARAM_PREFIX
from .passes.lower.module_calls import (LOWERED_META, check_live_modules, hooks_out_for_capture, lower_module_calls,
                                        sequence_parallel, tensor_parallel)
from .passes.rewrite.msar_decode import DECODE_META
from .views.report import ChainReport, ConvertReport, SiteInfo
from .demo.zoo import resolve

__all__ = ["inspect", "convert"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def inspect(
    model: nn.Module | fx.GraphModule | str,
    example_inputs: tuple | None = None,
    example_kwargs: dict | None = None,
) -> ChainReport:
    """Capture ``model`` and detect its PreNorm residual chain; for a converted model, its conversion report.

    Args:
        model (nn.Module | fx.GraphModule): a model (captured with :func:`~depthrewrite.capture`), a graph that is
            already captured (``torch.export`` or a Dynamo graph as a ``torch.compile`` backend receives it), or a
            model returned by :func:`convert`; or a model spec as the CLI takes it (``"hf:llama"``,
            ``"timm:vit_tiny_patch16_224"``, ``"package.module:factory"``; see :func:`depthrewrite.demo.zoo.build`).
        example_inputs (tuple, optional): positional inputs for capture; built for HF and timm models when None.
        example_kwargs (dict, optional): keyword inputs for capture.

    Returns:
        A :class:`ChainReport`; for a converted model its :class:`ConvertReport` (a ``ChainReport`` subclass with the
        conversion's sites and totals). ``print()`` shows a table.

    Raises:
        CaptureError, NotPreNormError, NoResidualChainError (all :class:`DepthRewriteError`).
    """
    from .model import is_converted

    model = resolve(model)
    if is_converted(model):
        return model.report()
    gm = capture(model, example_inputs, example_kwargs)
    chain = detect_chain(gm)
    name = gm.meta.get("depthrewrite_model_class") or type(model).__name__
    return ChainReport(model_class=name, chain=chain, graph=gm)


def _run_pass(pass_name: str, where: str, fn: Callable[..., T], *args: Any) -> T:
    """Run one phase of :func:`convert`; a crash that is not already a :class:`DepthRewriteError` becomes one that
    names the pass and the graph, chained to the cause (a bug in depthrewrite: the text asks for a report)."""
    try:
        return fn(*args)
    except DepthRewriteError:
        raise
    except Exception as e:
        raise DepthRewriteError(
            f"the {pass_name} pass failed on the {where}: {type(e).__name__}: {e}. This is a bug in depthrewrite, not "
            "in your model; please report it with the model's config (the cause is chained below)."
        ) from e


def convert(
    model: nn.Module | str,
    scheme: str | SchemeConfig = "attnres",
    *,
    example_inputs: tuple | None = None,
    example_kwargs: dict | None = None,
    pipeline_stages: int | None = None,
    inplace: bool = True,
    checkpoint: bool = False,
    module_calls: bool | None = False,
    **options: Any,
) -> nn.Module:
    """Rewrite the PreNorm residual chain of ``model`` into ``scheme``, in place.

    Args:
        model (nn.Module | str): the model. It is converted in place and returned (as ``torchao``'s ``quantize_``
            does): the same object, of a subclass of its class, keeps ``.config``, ``generate()``,
            ``save_pretrained()`` and its own methods; its ``forward`` runs rewritten graphs. Or a model spec as the
            CLI takes it (``"hf:llama"``, ``"timm:vit_tiny_patch16_224"``, ``"pkg.module:factory"``).
        scheme (str | SchemeConfig): a registered scheme's name, any case (``depthrewrite.schemes()`` lists them;
            today ``"attnres"``, ``"msar"``, ``"mhc"``, ``"moda"``), or ``"block-<name>"`` for a scheme with a block
            form (the same with ``blocks=4``; an explicit ``blocks=`` wins), with that scheme's options as keywords
            (see its config class: ``depthrewrite.scheme(name).config``, e.g. :class:`AttnResConfig`), or a config
            instance such as ``AttnResConfig(blocks=8)``.
        example_inputs, example_kwargs: inputs for the first capture, as for :func:`capture` (built for HF and timm
            models when None). Later calls with other arguments capture graphs of their own on first use.
        pipeline_stages (int, optional): place ``pipeline_stages - 1`` stage boundaries
            (``torch.ops.pippy._pipe_split``) in every graph, balanced by parameter count and on block boundaries for
            Block schemes, so ``torch.distributed.pipelining.pipeline(converted, mb_args)`` splits it; the report then
            lists what crosses each boundary. See :mod:`depthrewrite.pipeline` and docs/pipelines.md.
        inplace (bool): convert ``model`` itself (default). ``False`` converts a deep copy and leaves ``model`` as it
            was (nothing is shared between the two).
        checkpoint (bool): recompute every transformer block in backward (activation checkpointing) in training
            calls, for models that have no switch of their own. HF models' ``activation_checkpointing_enable()`` and
            torch's ``checkpoint_wrapper`` / ``apply_activation_checkpointing`` on the block modules work too: the
            converted model calls its blocks as modules (docs/training.md).
        module_calls (bool, optional): inside the block programs and the runner, every module the rewrite left
            intact (a whole attention or MLP sublayer, a norm, a Linear, the embedding and the head) is called as the
            live module (its hooks fire, a tensor-subclass weight sees ``F.linear``, a TP plan's hooks run) instead
            of running its inlined aten ops (docs/design/module-calls.md). Default ``False``: every graph runs aten
            ops only (tensor parallelism and FSDP2 on non-block modules still turn module calls on). ``True``: on,
            and a hooked module whose call cannot be kept (one flat graph, a module the rewrite changed) is a
            :class:`ModuleCallError`. ``None``: on, and such a module's hook is traced into the graph instead, with
            a warning (the mode planned to become the default, issue #24).

    Returns:
        The converted model: the original state-dict keys plus new parameters under ``depthrewrite.``; any call the
        original accepts (a graph is captured per call structure on first use), ``.train()``/``.eval()``,
        ``.to(dtype/device)``, the original output type. ``converted.report()`` describes the rewrite.
    """
    from .model import ConversionState, converted_class, is_converted

    config = scheme_config(scheme, **options)
    model = resolve(model)
    if pipeline_stages is not None and (not isinstance(pipeline_stages, int) or isinstance(pipeline_stages, bool) or pipeline_stages < 1):
        raise ConfigError(f"pipeline_stages must be an integer >= 1, got {pipeline_stages!r}")
    if isinstance(model, fx.GraphModule):
        raise ConfigError(
            f"convert() takes the original nn.Module, not a captured {type(model).__name__}: it captures the model "
            "itself, per call structure. Pass the model you captured from."
        )
    if is_converted(model):
        raise ConfigError(
            f"this {type(model).__name__} is already converted ({model.report().describe()}); convert the "
            "original model (depthrewrite.convert(..., inplace=False) keeps the original)"
        )
    get_handler(config)  # an unregistered config class fails here, before anything is touched
    if not inplace:
        model = copy.deepcopy(model)
    original = type(model)
    try:
        signature = _inspect.signature(model.forward)
    except (TypeError, ValueError):
        signature = None
    if example_inputs is None and example_kwargs is None:
        args, kwargs = example_inputs_for(model)
    else:
        args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs or ())
        kwargs = dict(example_kwargs or {})
    st = ConversionState(original, config, (args, kwargs), signature)
    st.checkpoint = bool(checkpoint)
    st.module_calls = module_calls is not False
    st.module_calls_asked = module_calls is True
    own_forward = model.__dict__.get("forward")
    if own_forward is not None and "_old_forward" not in model.__dict__:
        raise ConfigError(
            f"{original.__name__}.forward is replaced on this instance (model.forward = ...): the converted forward "
            "would never run. Remove the instance attribute (del model.forward) before converting."
        )
    model.__dict__["_depthrewrite"] = st
    model.__class__ = converted_class(original)
    if own_forward is not None:  # accelerate's hook (dispatch_model, device_map): it calls _old_forward, made here
        old_forward = model.__dict__["_old_forward"]
        model.__dict__["_old_forward"] = _types.MethodType(type(model).forward, model)
    try:
        # the first capture, in the model's mode: detects the chain, creates model.depthrewrite, makes the report
        st.select(model, args, kwargs)
        if checkpoint and st.blocks is None:
            raise ConfigError(
                f"convert(..., checkpoint=True) recomputes each transformer block in backward, but the converted "
                f"{original.__name__} runs as one graph: {st.blocks_note}. Convert without checkpoint=True."
            )
    except BaseException:
        model.__class__ = original
        model.__dict__.pop("_depthrewrite", None)
        if own_forward is not None:
            model.__dict__["_old_forward"] = old_forward
        model._modules.pop(PARAM_PREFIX, None)
        from .blocks import restore_blocks

        restore_blocks(model)
        raise
    if pipeline_stages is not None:
        from .pipeline import split

        split(model, pipeline_stages)
    log.info("converted %s: %d mixing sites, %d new parameters", original.__name__, len(st.report.sites),
             st.report.new_params)
    _not_exact_warning(config)
    return model


def capture_and_rewrite(model: nn.Module, st: Any, args: tuple, kwargs: dict) -> tuple[fx.GraphModule, Any]:
    """Capture ``model`` (a converted model, run as its original class) on one call and rewrite the graph with the
    conversion's scheme; the new parameters are ``model.depthrewrite`` (created by the first capture). Returns the
    :class:`ConvertedGraphModule` and the rewrite's result; the first capture also fills ``st.report``."""
    from .model import as_original

    config = st.config
    handler = get_handler(config)
    name = st.original.__name__
    where = f"{'training' if model.training else 'eval'} graph of {name}"
    blocks = getattr(st, "blocks", None)
    sharded = next((n for n, m in model.named_modules()
                    if n and _is_fsdp(m) and unwrapped_path(n) not in (blocks or ())), None)
    explicit = any(is_cache(v) for v in kwargs.values()) or kwargs.get("use_cache") is True
    # an HF model whose config turns the cache on returns one when the call does not say (the original does)
    implied = not explicit and "use_cache" not in kwargs and getattr(getattr(model, "config", None), "use_cache", False) is True \
        and hasattr(model, "main_input_name")
    # ... unless HF's activation checkpointing turns it off (training with gradients: the original returns none then;
    # blocks_for_capture turns the flags off while capturing, so the capture would keep it)
    implied = implied and not hf_checkpointing_drops_cache(model)
    keep_cache = explicit or implied
    why = scheme_record(config).no_cached_decoding
    filled = [v for v in kwargs.values() if is_cache(v) and v.get_seq_length() > 0]
    if why and filled:
        raise ConfigError(
            f"the converted {name} ({config.name}) cannot decode with a filled KV cache: {why}. Call it without a "
            "cache (use_cache=False; generate(..., use_cache=False) recomputes the sequence at every step)."
        )
    module_calls = getattr(st, "module_calls", False)
    tp = tensor_parallel(model)
    sp = sequence_parallel(model) if tp else None
    if sp is not None:
        raise ConfigError(
            f"{name}.{sp[0]} is tensor-parallel with activations sharded along the sequence ({sp[1]}: sequence "
            "parallelism). A converted model does not support that yet: its depth-mixing parameters are replicated "
            "plain tensors whose gradients would see only this rank's positions, and MSAR's causal convolutions need "
            "the previous rank's last positions. Use a plan that keeps activations replicated between sublayers "
            "(RowwiseParallel(output_layouts=Replicate()), no SequenceParallel norms; docs/training.md)."
        )
    if not module_calls and (tp or sharded is not None):
        # a tensor-parallel plan, or fully_shard on a module that is not a block (torchtitan's apply_fsdp shards the
        # embedding and the output), acts on modules through their hooks: they must stay calls (check_live_modules
        # refuses one whose call cannot be kept)
        log.info("depthrewrite: %s: %s; converting with module calls", name,
                 "tensor-parallel parameters" if tp else f"{sharded} is sharded with FSDP")
        st.module_calls = module_calls = True

    def captured(module_calls: bool, keep_cache: bool) -> tuple:
        """``(gm, hooks taken out, keep_cache, chain, blocks found)`` for one capture of this call."""
        extra = {"module_calls": True} if module_calls else {}
        hooks_out = hooks_out_for_capture(model) if module_calls else contextlib.nullcontext({})
        with as_original(model), blocks_for_capture(model, blocks), hooks_out as removed_hooks:
            try:
                gm = capture(model, args, kwargs, keep_cache=keep_cache, **extra)
            except CaptureError:
                if not implied:
                    raise
                log.warning("depthrewrite: %s could not be captured with the cache its config turns on; this call "
                            "structure returns no cache (pass use_cache=True to see why)", name)
                keep_cache = False
                gm = capture(model, args, kwargs, keep_cache=False, **extra)
        if keep_cache:  # a scheme with decoding state of its own (MSAR) reads it from extra cache layers
            gm.meta[DECODE_META] = history_inputs(gm, args, kwargs)
        mixes_tokens = scheme_record(config).mixes_tokens
        writes = state_writes(gm) if mixes_tokens else []
        if writes:  # state kept in the model's own buffers (a KV cache): the converted model checks every call's positions
            gm.meta[CONTINUATION_META] = (tuple(writes), f"{scheme_record(config).title} {mixes_tokens}")
        chain = _run_pass("detect_chain", where, detect_chain, gm)
        return gm, removed_hooks, keep_cache, chain, block_paths(model, chain)

    def rewritten(module_calls: bool, keep_cache: bool) -> tuple:
        """``(gm, chain, rewrite result, keep_cache, box)``: one capture of this call, rewritten, its module calls
        lowered."""
        gm, removed_hooks, keep_cache, chain, found = captured(module_calls, keep_cache)
        gm.meta["depthrewrite_blocks"] = found[0] if isinstance(found, tuple) else found
        gm.meta["depthrewrite_block_of_site"] = found[1] if isinstance(found, tuple) else None
        box = model._modules.get(PARAM_PREFIX)
        if box is not None:  # share the new parameters (export made a shell module holding the same tensors)
            gm._modules[PARAM_PREFIX] = box
        result = _run_pass(f"rewrite[{config.name}]", where, handler, gm, chain, config)
        _run_pass("drop_dead_code", where, drop_dead_code, gm)
        if module_calls and isinstance(found, tuple):
            # the graph the block runner splits: the flat one with a call of each intact module
            lowered = _run_pass("module_calls", where, lower_module_calls, gm, found[0], model)
            check_live_modules(model, gm, lowered[1], lowered[2], removed_hooks, where)
            gm.meta[LOWERED_META] = lowered
            log.info("module calls: %d called, %d inlined%s", len(lowered[1]), len(lowered[2]),
                     "".join(f"; {p}: {w}" for p, w in lowered[2][:4]))
        elif module_calls:  # a flat graph (no block modules) runs every module inlined
            check_live_modules(model, gm, [], [], removed_hooks, where)
        return gm, chain, result, keep_cache, box

    try:
        gm, chain, result, keep_cache, box = rewritten(module_calls, keep_cache)
    except ModuleCallError as e:
        # module calls by default (not asked for, not needed by TP or FSDP): a hooked module whose call cannot be
        # kept (one flat graph inlines every module; MoDA's attention is rewritten) is traced into the graph instead,
        # as without module calls (the module-tree check warns that its side effects happen at capture only)
        if getattr(st, "module_calls_asked", True) or tp or sharded is not None:
            raise
        log.info("depthrewrite: %s; capturing without module calls (hooks traced)", e)
        module_calls = False
        gm, chain, result, keep_cache, box = rewritten(False, keep_cache)
        from .model import warn_traced_hooks

        warn_traced_hooks(model)
    if not result.modified:
        raise DepthRewriteError(f"{config.name}: the rewrite changed nothing on {name}; not returning an unconverted model")
    sites = tuple((c.site, tuple(c.sources)) for c in result.changes)
    if st.sites is None:
        st.sites = sites
    elif sites != st.sites:
        raise DepthRewriteError(
            f"{name}: this call ({where}) gives a residual chain with sites {[s for s, _ in sites]}, the conversion's "
            f"has {[s for s, _ in st.sites]}: the new parameters are matched by position in the chain, so this call "
            "structure cannot share them. Call the model the way it was converted, or convert a copy for this use."
        )
    if box is None:
        model.add_module(PARAM_PREFIX, getattr(gm, PARAM_PREFIX))
    if st.report is None:
        st.report = _report(model, gm, chain, result, config)
        if module_calls and LOWERED_META in gm.meta:
            st.report = dataclasses.replace(st.report, notes=st.report.notes + (
                _module_calls_note(gm.meta[LOWERED_META], gm.meta["depthrewrite_blocks"]),))
    bound_args, bound_kwargs = gm.meta["depthrewrite_inputs"]
    return as_converted(gm, model, st.signature, bound_args, bound_kwargs, st.report), result


def _is_fsdp(module: nn.Module) -> bool:
    """Whether ``module`` is wrapped by FSDP (``fully_shard``'s FSDPModule, or the older FullyShardedDataParallel)."""
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(module, (FSDPModule, FullyShardedDataParallel))


def history_inputs(gm: fx.GraphModule, args: tuple, kwargs: dict) -> list[str]:
    """The placeholders of ``gm`` that carry decoding state: the tensors of the extra layers a converted model
    appended to the call's KV cache (:func:`depthrewrite.model.store_history`), keys then values per layer."""
    from .model import history_of

    cache = next((v for v in (*args, *kwargs.values()) if is_cache(v)), None)
    wanted = history_of(cache) if cache is not None else []
    if not wanted:
        return []
    leaves = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    tensors = [n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)]
    if len(leaves) != len(tensors):
        raise DepthRewriteError(
            f"depthrewrite: the captured graph has {len(tensors)} tensor inputs for the call's {len(leaves)}; cannot "
            "find the decoding state in the KV cache (a bug: please report it)"
        )
    index = {id(t): i for i, t in enumerate(leaves)}
    return [tensors[index[id(t)]].name for t in wanted]


def _block_notes(config: SchemeConfig, num_sublayers: int) -> tuple[str, ...]:
    """A note when a block form was asked for but the model is too shallow for it (S = 1 is the Full scheme)."""
    blocks, size = getattr(config, "blocks", None), getattr(config, "block_size", None)
    if (blocks is None and size is None) or block_size_for(config, num_sublayers) != 1:
        return ()
    asked = f"blocks={blocks}" if blocks is not None else f"block_size={size}"
    return (f"{asked} on {num_sublayers} sublayers gives one sublayer per block (S = 1): this is the Full form of "
            f"the scheme; use fewer blocks (blocks <= {max(num_sublayers // 2, 1)}) for a Block form",)


def _not_exact_warning(config: SchemeConfig) -> None:
    """Warn when the options chosen make the converted model another function than the original at init."""
    import warnings

    record = scheme_record(config)
    off = {k: (getattr(config, k), v) for k, v in record.exact.items() if getattr(config, k, v) != v}
    if off:
        chosen = ", ".join(f"{k}={a!r}" for k, (a, _) in off.items())
        exact = ", ".join(f"{k}={b!r}" for k, (_, b) in off.items())
        warnings.warn(
            f"depthrewrite: {record.title} with {chosen} is not the original function at initialisation (the new "
            f"parameters change the outputs from the first call; a pretrained checkpoint will not behave as before "
            f"until trained). Pass {exact} for a function-preserving conversion.",
            NotFunctionPreservingWarning, stacklevel=3,
        )


def _module_calls_note(lowered: tuple, blocks: tuple[str, ...]) -> str:
    """The report's line on module calls: how many modules run as live modules, and which stayed inlined (blocks
    and the modules holding them are left out: the rewrite always changes those)."""
    _, called, inlined = lowered
    shown = [(p, w) for p, w in inlined
             if not any(b == p or b.startswith(p + ".") for b in blocks)]
    text = f"module calls: {len(called)} modules run as the live modules"
    if shown:
        text += "; inlined: " + "; ".join(f"{p} ({w})" for p, w in shown[:4]) + (
            f"; and {len(shown) - 4} more" if len(shown) > 4 else "")
    return text


def _report(model: nn.Module, gm: fx.GraphModule, chain: Any, result: Any, config: SchemeConfig) -> ConvertReport:
    box = getattr(gm, PARAM_PREFIX)
    sites = []
    for c in result.changes:
        mod = getattr(box, c.params) if c.params else None
        params = sum(p.numel() for p in mod.parameters()) if mod is not None else 0
        where = chain.sublayers[c.site].branch_module if isinstance(c.site, int) else chain.final_norm.module
        sites.append(SiteInfo(site=c.site, module=where, sources=c.sources, params=params, detail=c.detail,
                              state_elements=c.state_elements))
    new_params = sum(p.numel() for p in box.parameters())
    ref = next((p for p in model.parameters() if p.is_floating_point()), None)
    return ConvertReport(
        model_class=model.__dict__["_depthrewrite"].original.__name__,
        config=config,
        chain=chain,
        sites=tuple(sites),
        new_params=new_params,
        model_params=sum(p.numel() for p in model.parameters()) - new_params,  # model.depthrewrite is attached by now
        stored_sources=len(sites[-1].sources),
        bytes_per_element=ref.element_size() if ref is not None else 4,
        block_size=block_size_for(config, len(chain)),
        notes=result.notes + _block_notes(config, len(chain)),
        state_elements=result.state[0] if result.state else None,
        state_label=result.state[1] if result.state else "stored depth state",
    )
