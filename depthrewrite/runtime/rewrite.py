"""One capture of a converted model, rewritten: capture the call (the model run as its original class), detect the
chain, run the scheme's pass, lower the intact modules to module calls, and make the :class:`ConvertedGraphModule`
the runtime runs; the first capture also makes the conversion's report."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, TypeVar

import torch.fx as fx
import torch.nn as nn

from ..blocks import (block_paths, blocks_for_capture, hf_checkpointing_drops_cache, live_target, split_problem,
                      unwrapped_path)
from ..capture import CONTINUATION_META, capture, is_cache, state_writes
from ..converted import as_converted, drop_dead_code, drop_empty_concats
from ..errors import CaptureError, ConfigError, DepthRewriteError, ModuleCallError
from ..passes.analyse.chain import detect_chain
from ..passes.lower.module_calls import (LOWERED_META, check_live_modules, hooks_out_for_capture, is_fsdp,
                                         lower_module_calls, sequence_parallel, tensor_parallel)
from ..passes.rewrite import SchemeConfig, get_handler
from ..passes.rewrite import scheme as scheme_record
from ..passes.rewrite.blocks import block_size_for
from ..passes.rewrite.editor import PARAM_PREFIX
from ..passes.rewrite.msar_decode import DECODE_META
from ..views.report import ConvertReport, SiteInfo
from .caches import history_inputs
from .classes import as_original
from .offload import offload_hooks
from .tree import warn_traced_hooks

log = logging.getLogger(__name__)

T = TypeVar("T")


def run_pass(pass_name: str, where: str, fn: Callable[..., T], *args: Any) -> T:
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



def _fsdp1_wrapped(model: nn.Module) -> str | None:
    """The path of the first submodule that is a ``FullyShardedDataParallel`` wrapper (FSDP1), or None."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return next((n for n, m in model.named_modules() if n and isinstance(m, FullyShardedDataParallel)), None)


def capture_and_rewrite(model: nn.Module, st: Any, args: tuple, kwargs: dict) -> tuple[fx.GraphModule, Any]:
    """Capture ``model`` (a converted model, run as its original class) on one call and rewrite the graph with the
    conversion's scheme; the new parameters are ``model.depthrewrite`` (created by the first capture). Returns the
    :class:`ConvertedGraphModule` and the rewrite's result; the first capture also fills ``st.report``."""
    config = st.config
    handler = get_handler(config)
    name = st.original.__name__
    where = f"{'training' if model.training else 'eval'} graph of {name}"
    blocks = getattr(st, "blocks", None)
    sharded = next((n for n, m in model.named_modules()
                    if n and is_fsdp(m) and unwrapped_path(n) not in (blocks or ())), None)
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
    fsdp1 = _fsdp1_wrapped(model)
    if fsdp1 is not None:
        raise ConfigError(
            f"{name}.{fsdp1} is wrapped by FullyShardedDataParallel (FSDP1: Lightning's FSDPStrategy, litgpt's "
            "pretrain and full fine-tuning recipes), whose flat parameters a converted model does not support (it "
            "needs a GPU and is untested). Shard with fully_shard (FSDP2) after converting: Lightning's "
            "ModelParallelStrategy, litgpt's LoRA parallelize_fn, or fully_shard per block (docs/training.md)."
        )
    offloaded = next((n or "(the model)" for n, _, _ in offload_hooks(model)), None)
    module_calls = getattr(st, "module_calls", False)
    tp = tensor_parallel(model)
    sp = sequence_parallel(model)  # torchtitan's spmd_types plans hold plain tensors: tensor_parallel() is False
    if sp is not None:
        raise ConfigError(
            f"{name}.{sp[0]} is tensor-parallel with activations sharded along the sequence ({sp[1]}: sequence "
            "parallelism). A converted model does not support that yet: its depth-mixing parameters are replicated "
            "plain tensors whose gradients would see only this rank's positions, and MSAR's causal convolutions need "
            "the previous rank's last positions. Use a plan that keeps activations replicated between sublayers "
            "(RowwiseParallel(output_layouts=Replicate()), no SequenceParallel norms; torchtitan: "
            "enable_sequence_parallel=False; docs/training.md)."
        )
    # a tensor-parallel plan, fully_shard on a module that is not a block (torchtitan's apply_fsdp shards the
    # embedding and the output) and accelerate's offload act on modules through their hooks: they must stay calls
    # (check_live_modules refuses one whose call cannot be kept)
    kept_calls = tp or sharded is not None or offloaded is not None
    if not module_calls and kept_calls:
        log.info("depthrewrite: %s: %s; converting with module calls", name,
                 "tensor-parallel parameters" if tp else f"{sharded} is sharded with FSDP" if sharded is not None
                 else f"{offloaded} is offloaded by accelerate")
        st.module_calls = module_calls = True

    def captured(module_calls: bool, keep_cache: bool) -> tuple:
        """``(gm, hooks taken out, keep_cache, chain, blocks found)`` for one capture of this call."""
        hooks_out = hooks_out_for_capture(model) if module_calls else contextlib.nullcontext({})
        with as_original(model), blocks_for_capture(model, blocks), hooks_out as removed_hooks:
            # the paths whose hooks or forward were taken out must run live (a module taking a BlockMask included)
            extra = {"module_calls": True, "live": tuple(removed_hooks)} if module_calls else {}
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
        chain = run_pass("detect_chain", where, detect_chain, gm)
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
        result = run_pass(f"rewrite[{config.name}]", where, handler, gm, chain, config)
        run_pass("drop_empty_concats", where, drop_empty_concats, gm)
        run_pass("drop_dead_code", where, drop_dead_code, gm)
        lowered = None
        if module_calls and isinstance(found, tuple):
            # the graph the block runner splits: the flat one with a call of each intact module
            lowered = run_pass("module_calls", where, lower_module_calls, gm, found[0], model)
            unsplit = split_problem(gm, found[0], lowered[0], live_target(model))
            if unsplit is not None:  # the flat graph runs, calling no module: checked as such below
                log.info("module calls: the lowered graph cannot be split at the blocks (%s)", unsplit)
                lowered = None
        if lowered is not None:
            check_live_modules(model, gm, lowered[1], lowered[2], removed_hooks, where)
            gm.meta[LOWERED_META] = lowered
            log.info("module calls: %d called, %d inlined%s", len(lowered[1]), len(lowered[2]),
                     "".join(f"; {p}: {w}" for p, w in lowered[2][:4]))
        elif module_calls:  # a flat graph (no block modules, or no split) runs every module inlined
            check_live_modules(model, gm, [], [], removed_hooks, where)
        return gm, chain, result, keep_cache, box

    try:
        gm, chain, result, keep_cache, box = rewritten(module_calls, keep_cache)
    except ModuleCallError as e:
        # module calls by default (not asked for, not needed by TP or FSDP): a hooked module whose call cannot be
        # kept (one flat graph inlines every module; MoDA's attention is rewritten) is traced into the graph instead,
        # as without module calls (the module-tree check warns that its side effects happen at capture only)
        if getattr(st, "module_calls_asked", True) or kept_calls:
            raise
        log.info("depthrewrite: %s; capturing without module calls (hooks traced)", e)
        module_calls = False
        try:
            gm, chain, result, keep_cache, box = rewritten(False, keep_cache)
        except DepthRewriteError as retry:  # refused inlined too (a plan's collectives traced): the first reason
            raise e from retry
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


def _block_notes(config: SchemeConfig, num_sublayers: int) -> tuple[str, ...]:
    """A note when a block form was asked for but the model is too shallow for it (S = 1 is the Full scheme)."""
    blocks, size = getattr(config, "blocks", None), getattr(config, "block_size", None)
    if (blocks is None and size is None) or block_size_for(config, num_sublayers) != 1:
        return ()
    asked = f"blocks={blocks}" if blocks is not None else f"block_size={size}"
    return (f"{asked} on {num_sublayers} sublayers gives one sublayer per block (S = 1): this is the Full form of "
            f"the scheme; use fewer blocks (blocks <= {max(num_sublayers // 2, 1)}) for a Block form",)


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
