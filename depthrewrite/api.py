"""The public verbs: :func:`inspect`, :func:`convert` and :func:`from_pretrained`."""

from __future__ import annotations

import copy
import inspect as _inspect
import logging
import types as _types
import os
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from . import saving
from .blocks import restore_blocks
from .capture import capture, example_inputs_for
from .errors import ConfigError, NotFunctionPreservingWarning
from .passes.analyse.chain import detect_chain
from .passes.rewrite import SchemeConfig, get_handler, scheme_config
from .passes.rewrite import scheme as scheme_record
from .passes.rewrite.editor import PARAM_PREFIX
from .pipeline import split
from .runtime.classes import converted_class
from .runtime.handle import is_converted
from .runtime.state import ConversionState
from .views.report import ChainReport
from .zoo import resolve

__all__ = ["inspect", "convert", "from_pretrained"]

log = logging.getLogger(__name__)


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
            ``"timm:vit_tiny_patch16_224"``, ``"package.module:factory"``; see :func:`depthrewrite.zoo.build`).
        example_inputs (tuple, optional): positional inputs for capture; built for HF and timm models when None.
        example_kwargs (dict, optional): keyword inputs for capture.

    Returns:
        A :class:`ChainReport`; for a converted model its :class:`ConvertReport` (a ``ChainReport`` subclass with the
        conversion's sites and totals). ``print()`` shows a table.

    Raises:
        CaptureError, NotPreNormError, NoResidualChainError (all :class:`DepthRewriteError`).
    """
    model = resolve(model)
    if is_converted(model):
        return model.report()
    gm = capture(model, example_inputs, example_kwargs)
    chain = detect_chain(gm)
    name = gm.meta.get("depthrewrite_model_class") or type(model).__name__
    return ChainReport(model_class=name, chain=chain, graph=gm)


def convert(
    model: nn.Module | str,
    scheme: str | SchemeConfig = "attnres",
    *,
    example_inputs: tuple | None = None,
    example_kwargs: dict | None = None,
    pipeline_stages: int | None = None,
    inplace: bool = True,
    checkpoint: bool = False,
    module_calls: bool | None = None,
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
            of running its inlined aten ops (docs/design/module-calls.md). Default ``None``: on, and where a hooked
            module's call cannot be kept (one flat graph, a module the rewrite changed) that call structure is
            captured without module calls and the hook traced into the graph, with a warning. ``True``: on, and such
            a module is a :class:`ModuleCallError`. ``False``: every graph runs aten ops only (tensor parallelism
            and FSDP2 on non-block modules still turn module calls on).

    Returns:
        The converted model: the original state-dict keys plus new parameters under ``depthrewrite.``; any call the
        original accepts (a graph is captured per call structure on first use), ``.train()``/``.eval()``,
        ``.to(dtype/device)``, the original output type. ``converted.report()`` describes the rewrite.
    """
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
        restore_blocks(model)
        raise
    if pipeline_stages is not None:
        split(model, pipeline_stages)
    log.info("converted %s: %d mixing sites, %d new parameters", original.__name__, len(st.report.sites),
             st.report.new_params)
    _not_exact_warning(config)
    return model


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


def from_pretrained(
    directory: str | os.PathLike,
    model: nn.Module | None = None,
    *,
    example_inputs: tuple | None = None,
    example_kwargs: dict | None = None,
    allowed_modules: tuple[str, ...] | list[str] = (),
    **load_kwargs: Any,
) -> nn.Module:
    """Load a converted model saved with ``converted.save_pretrained(directory)``.

    Args:
        directory: the saved directory.
        model (nn.Module, optional): the original (unconverted) model to load into; required for models that have no
            ``from_pretrained`` of their own (a hand-written model: build it with the same configuration). Default:
            ``OriginalClass.from_pretrained(directory, **load_kwargs)``.
        example_inputs, example_kwargs: inputs for the first capture, as for :func:`depthrewrite.convert`.
        allowed_modules (tuple of str): packages, besides transformers, whose classes the saved recipe may name
            (``("mypackage",)`` allows ``mypackage`` and its submodules). The recipe's ``original_class`` is read
            from the directory, and loading it imports that module and calls its class's ``from_pretrained``; by
            default only ``transformers.`` modules and ``PreTrainedModel`` subclasses are accepted, and any other
            name is a :class:`ConfigError` raised before anything is imported. Not needed with ``model=``, which
            imports nothing.
        load_kwargs: passed to the original class's ``from_pretrained`` (``torch_dtype=...``, ...).

    Returns:
        The converted model, with every saved parameter (original and ``depthrewrite.*``) loaded.
    """
    directory = Path(directory)
    recipe = saving.read_recipe(directory)
    config = saving.config_from(recipe)
    ours_prefix = PARAM_PREFIX + "."
    if model is None:
        if isinstance(allowed_modules, str):
            allowed_modules = (allowed_modules,)
        cls = saving.import_class(recipe.get("original_class"), tuple(allowed_modules))
        if not hasattr(cls, "from_pretrained"):
            raise ConfigError(
                f"{recipe['original_class']} has no from_pretrained: build the model with the configuration it was "
                "saved with and pass it, depthrewrite.from_pretrained(dir, model=MyModel(cfg))"
            )
        try:  # the depthrewrite.* keys are unknown to the original class: they are loaded below, not warned about
            from transformers.utils import logging as hf_logging

            level = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()
        except ImportError:  # pragma: no cover
            hf_logging = None
        try:
            model = cls.from_pretrained(str(directory), **load_kwargs)
        finally:
            if hf_logging is not None:
                hf_logging.set_verbosity(level)
        model.eval()
        ours = saving.saved_state(directory, ours_prefix)  # the rest was loaded by the class's own from_pretrained
    else:
        saved = saving.saved_state(directory)
        ours = {k: v for k, v in saved.items() if k.startswith(ours_prefix)}
        theirs = {k: v for k, v in saved.items() if not k.startswith(ours_prefix)}
        missing, unexpected = model.load_state_dict(theirs, strict=False)
        missing = saving.untied(model, missing, set(theirs))
        if unexpected or missing:
            raise ConfigError(
                f"the saved weights do not fit the {type(model).__name__} passed to from_pretrained: missing "
                f"{missing[:5]}, unexpected {unexpected[:5]}; build it with the configuration it was saved with"
            )
    model = convert(model, config, example_inputs=example_inputs, example_kwargs=example_kwargs)
    if recipe.get("pipeline_stages") is not None:
        split(model, recipe["pipeline_stages"], **recipe.get("pipeline_options", {}))
    expected = {k for k in model.state_dict() if k.startswith(ours_prefix)}
    if set(ours) != expected:
        raise ConfigError(
            f"{directory}: the saved depthrewrite parameters {sorted(set(ours) ^ expected)[:6]} do not match the "
            f"conversion of this model with {config.describe()}: was it saved from another architecture or size?"
        )
    model.load_state_dict(ours, strict=False)
    return model
