"""The public verbs: :func:`inspect` and :func:`convert`."""

from __future__ import annotations

import logging
from typing import Any, Callable, TypeVar

import torch.fx as fx
import torch.nn as nn

from .capture import capture
from .converted import ConvertedGraphModule, as_converted, drop_dead_code, graft_graph
from .errors import ConfigError, DepthRewriteError
from .passes.analyse.chain import detect_chain
from .passes.rewrite import SchemeConfig, get_handler, scheme_config
from .passes.rewrite.blocks import block_size_for
from .passes.rewrite.editor import PARAM_PREFIX
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
    model = resolve(model)
    if isinstance(model, ConvertedGraphModule):
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
    **options: Any,
) -> fx.GraphModule:
    """Rewrite the PreNorm residual chain of ``model`` into ``scheme``.

    Args:
        model (nn.Module | str): the model; it is not modified, and the converted model shares its parameters. Or a
            model spec as the CLI takes it (``"hf:llama"``, ``"timm:vit_tiny_patch16_224"``, ``"pkg.module:factory"``).
        scheme (str | SchemeConfig): a registered scheme's name, any case (``depthrewrite.schemes()`` lists them;
            today ``"attnres"``, ``"msar"``, ``"mhc"``, ``"moda"``), or ``"block-<name>"`` for a scheme with a block
            form (the same with ``blocks=4``; an explicit ``blocks=`` wins), with that scheme's options as keywords
            (see its config class: ``depthrewrite.scheme(name).config``, e.g. :class:`AttnResConfig`), or a config
            instance such as ``AttnResConfig(blocks=8)``.
        example_inputs, example_kwargs: inputs for capture, as for :func:`capture`.
        pipeline_stages (int, optional): place ``pipeline_stages - 1`` stage boundaries
            (``torch.ops.pippy._pipe_split``) in both graphs, balanced by parameter count and on block boundaries for
            Block schemes, so ``torch.distributed.pipelining.pipeline(converted, mb_args)`` splits it; the report then
            lists what crosses each boundary. See :mod:`depthrewrite.pipeline` and docs/pipelines.md.

    Returns:
        A GraphModule that trains like the original: the original state-dict keys plus new parameters under
        ``depthrewrite.``; ``.train()``/``.eval()``, ``.to(dtype/device)``, any batch and sequence length, the original
        call signature and output type. ``converted.report()`` describes the rewrite.
    """
    config = scheme_config(scheme, **options)
    model = resolve(model)
    if pipeline_stages is not None and (not isinstance(pipeline_stages, int) or isinstance(pipeline_stages, bool) or pipeline_stages < 1):
        raise ConfigError(f"pipeline_stages must be an integer >= 1, got {pipeline_stages!r}")
    if isinstance(model, fx.GraphModule):
        raise ConfigError(
            f"convert() takes the original nn.Module, not a captured {type(model).__name__}: it captures the model in "
            "training and in eval mode itself. Pass the model you captured from."
        )
    handler = get_handler(config)
    was_training = model.training
    # Export bakes the mode into the graph (dropout, attention dropout, training-only routing), so capture and rewrite
    # both modes; the eval graph shares the training graph's parameters, and .train()/.eval() swap graphs.
    graphs, chains, results = {}, {}, {}
    try:
        for mode in (True, False):
            model.train(mode)
            graphs[mode] = capture(model, example_inputs, example_kwargs)
    finally:
        model.train(was_training)
    name = type(model).__name__
    for mode in (True, False):
        where = f"{'training' if mode else 'eval'} graph of {name}"
        chains[mode] = _run_pass("detect_chain", where, detect_chain, graphs[mode])
        if not mode:  # share the new parameters with the training graph
            graphs[False].add_submodule(PARAM_PREFIX, getattr(graphs[True], PARAM_PREFIX))
        results[mode] = _run_pass(f"rewrite[{config.name}]", where, handler, graphs[mode], chains[mode], config)
        _run_pass("drop_dead_code", where, drop_dead_code, graphs[mode])
        if not results[mode].modified:
            raise DepthRewriteError(
                f"{config.name}: the rewrite changed nothing on {type(model).__name__}; not returning an unconverted model"
            )
    if [c.site for c in results[True].changes] != [c.site for c in results[False].changes]:
        raise DepthRewriteError(
            f"{type(model).__name__} has different residual chains in training and eval mode; cannot convert both"
        )
    gm, chain, result = graphs[True], chains[True], results[True]
    model_params = sum(p.numel() for p in model.parameters())
    eval_graph = graft_graph(gm, graphs[False])
    box = getattr(gm, PARAM_PREFIX)
    sites = []
    for c in result.changes:
        mod = getattr(box, c.params) if c.params else None
        params = sum(p.numel() for p in mod.parameters()) if mod is not None else 0
        where = chain.sublayers[c.site].branch_module if isinstance(c.site, int) else chain.final_norm.module
        sites.append(SiteInfo(site=c.site, module=where, sources=c.sources, params=params, detail=c.detail,
                              state_elements=c.state_elements))
    S = block_size_for(config, len(chain))
    ref = next((p for p in model.parameters() if p.is_floating_point()), None)
    report = ConvertReport(
        model_class=type(model).__name__,
        config=config,
        chain=chain,
        sites=tuple(sites),
        new_params=sum(p.numel() for p in box.parameters()),
        model_params=model_params,
        stored_sources=len(sites[-1].sources),
        bytes_per_element=ref.element_size() if ref is not None else 4,
        block_size=S,
        notes=result.notes,
        state_elements=result.state[0] if result.state else None,
        state_label=result.state[1] if result.state else "stored depth state",
    )
    args, kwargs = gm.meta["depthrewrite_inputs"]
    gm = as_converted(gm, eval_graph, model, args, kwargs, report)
    gm.train(was_training)
    if pipeline_stages is not None:
        from .pipeline import split

        split(gm, pipeline_stages)
    log.info("converted %s: %d mixing sites, %d new parameters", type(model).__name__, len(sites), report.new_params)
    return gm
