"""Save and load converted models: ``converted.save_pretrained(dir)`` and :func:`from_pretrained`.

A saved directory holds the model as its own class saves it (a Hugging Face model's ``save_pretrained``: config,
generation config, ``model.safetensors`` with every state-dict key including the new ``depthrewrite.*`` ones; any other
model: ``pytorch_model.bin``, its state dict) plus ``depthrewrite.json``, the conversion's recipe::

    {"format": 1, "depthrewrite": "0.1.0", "scheme": {"scheme": "msar", "version": 1, ...options},
     "original_class": "transformers.models.llama.modeling_llama:LlamaForCausalLM", "pipeline_stages": null,
     "pipeline_options": {}}

:func:`from_pretrained` builds the original model (``from_pretrained`` of its class for HF; a model you pass for any
other), converts it with the recorded scheme and options, and loads the new parameters. The graphs are not saved: they
are captured again on first use. HF ``Trainer`` checkpoints go through ``save_pretrained``, so they carry the recipe
too, and resuming loads the ``depthrewrite.*`` parameters with the rest of the state dict.

The recipe's ``original_class`` is read from the directory, so it is treated as untrusted: without ``model=``, only a
``transformers.`` module's ``PreTrainedModel`` subclass is imported, or a class of a package the caller names in
``allowed_modules=``; any other name is refused before its module is imported (see :func:`_import_class`).
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .errors import ConfigError

__all__ = ["save_pretrained", "from_pretrained", "RECIPE", "FORMAT"]

RECIPE = "depthrewrite.json"
FORMAT = 1
_PLAIN_WEIGHTS = "pytorch_model.bin"


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _allowed(module: str, allowed_modules: tuple[str, ...]) -> bool:
    return any(module == m or module.startswith(m + ".") for m in allowed_modules)


def _import_class(path: str, allowed_modules: tuple[str, ...] = ()) -> type:
    """The class a recipe's ``original_class`` names, checked **before** anything is imported.

    ``original_class`` comes from the saved directory, so it is untrusted input: importing the module it names runs
    that module's top-level code, and its ``from_pretrained`` runs next. Only two kinds of names are imported: a
    module under ``transformers.`` whose attribute is a ``transformers.PreTrainedModel`` subclass, and a module in
    ``allowed_modules`` (the caller's explicit opt-in) whose attribute is an ``nn.Module`` subclass. Anything else is
    a :class:`ConfigError` and nothing is imported."""
    module, sep, qualname = path.partition(":") if isinstance(path, str) else ("", "", "")
    parts = qualname.split(".")
    well_formed = (
        sep == ":"
        and all(p.isidentifier() for p in module.split("."))
        and all(p.isidentifier() and not p.startswith("_") for p in parts)
    )
    hint = (
        "build the model and pass it, depthrewrite.from_pretrained(dir, model=...), or, if you trust the checkpoint "
        "and the framework that made it, name that framework's package: depthrewrite.from_pretrained(dir, "
        "allowed_modules=(\"mypackage\",))"
    )
    if not well_formed:
        raise ConfigError(f"the saved model's class {path!r} is not of the form package.module:Class; {hint}")
    from_transformers = module.startswith("transformers.")
    if not from_transformers and not _allowed(module, allowed_modules):
        raise ConfigError(
            f"the saved recipe names the class {path}, which transformers does not provide; depthrewrite imports "
            f"only transformers' model classes from a checkpoint, since importing a module runs its code. To load "
            f"it, {hint}"
        )
    try:
        obj: Any = importlib.import_module(module)
        for part in parts:
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ConfigError(
            f"the saved model's class {path} cannot be imported here ({type(e).__name__}: {e}); build the model and "
            "pass it: depthrewrite.from_pretrained(dir, model=...)"
        ) from e
    if from_transformers and not _allowed(module, allowed_modules):
        from transformers import PreTrainedModel

        base, what = PreTrainedModel, "a transformers PreTrainedModel"
    else:
        base, what = nn.Module, "an nn.Module"
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise ConfigError(f"the saved recipe's original_class {path} is not {what} subclass; {hint}")
    return obj


def _untied(model: nn.Module, missing: list[str], loaded: set[str]) -> list[str]:
    """The keys of ``missing`` that no loaded key shares a tensor with (HF saves one name of tied weights)."""
    names: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(name)
    by_name = {n: i for i, ns in names.items() for n in ns}
    return [k for k in missing if not any(n in loaded for n in names.get(by_name.get(k, -1), []) if n != k)]


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
    """Save a converted model and its recipe (see the module docstring). Extra arguments go to the original
    ``save_pretrained`` (HF models); other models accept none."""
    from . import __version__
    from .model import state_of

    st = state_of(model)
    out = Path(save_directory)
    out.mkdir(parents=True, exist_ok=True)
    original_save = getattr(st.original, "save_pretrained", None)
    if original_save is not None:
        result = original_save(model, save_directory, *args, **kwargs)
    else:
        if args or kwargs:
            raise ConfigError(
                f"{st.original.__name__} has no save_pretrained of its own; converted.save_pretrained(dir) takes no "
                f"other arguments (got {len(args)} positional, {sorted(kwargs)})"
            )
        torch.save(model.state_dict(), out / _PLAIN_WEIGHTS)
        result = None
    recipe = {
        "format": FORMAT,
        "depthrewrite": __version__,
        "scheme": st.config.to_dict(),
        "original_class": _class_path(st.original),
        "pipeline_stages": st.pipeline_stages,
        "pipeline_options": dict(st.pipeline_kw),
    }
    (out / RECIPE).write_text(json.dumps(recipe, indent=2, default=list) + "\n")
    return result


def read_recipe(directory: str | os.PathLike) -> dict[str, Any]:
    """The ``depthrewrite.json`` of a saved converted model (a :class:`ConfigError` when there is none, or when it was
    written by a newer format)."""
    path = Path(directory) / RECIPE
    if not path.is_file():
        raise ConfigError(
            f"{directory} has no {RECIPE}: it was not saved from a converted model (converted.save_pretrained(dir)). "
            "To convert a plain checkpoint, load it as usual and call depthrewrite.convert()."
        )
    recipe = json.loads(path.read_text())
    if int(recipe.get("format", 0)) > FORMAT:
        raise ConfigError(
            f"{path} has format {recipe.get('format')}, newer than this depthrewrite reads ({FORMAT}); upgrade "
            "depthrewrite"
        )
    return recipe


def _config_from(recipe: dict[str, Any]) -> Any:
    from .passes.rewrite import scheme_config
    from .passes.rewrite import scheme as scheme_record

    options = dict(recipe["scheme"])
    name = options.pop("scheme")
    version = options.pop("version", 1)
    cls = scheme_record(name).config
    if version > cls.version:
        raise ConfigError(f"the saved {name} config has version {version}, newer than this depthrewrite's ({cls.version})")
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    return scheme_config(name, **options)


def _saved_state(directory: Path, prefix: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors saved in ``directory`` (safetensors shards or a torch state-dict file); with ``prefix``, only the
    keys that start with it (read alone from safetensors files, without loading the rest)."""
    files = sorted(directory.glob("*.safetensors"))
    if files:
        from safetensors import safe_open

        state: dict[str, torch.Tensor] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as shard:
                state.update((k, shard.get_tensor(k)) for k in shard.keys() if prefix is None or k.startswith(prefix))
        return state
    f = directory / _PLAIN_WEIGHTS
    if not f.is_file():
        raise ConfigError(f"{directory} has no weights (*.safetensors or {_PLAIN_WEIGHTS})")
    state = torch.load(f, map_location="cpu", weights_only=True)
    return state if prefix is None else {k: v for k, v in state.items() if k.startswith(prefix)}


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
    from .api import convert
    from .passes.rewrite.editor import PARAM_PREFIX

    directory = Path(directory)
    recipe = read_recipe(directory)
    config = _config_from(recipe)
    ours_prefix = PARAM_PREFIX + "."
    if model is None:
        if isinstance(allowed_modules, str):
            allowed_modules = (allowed_modules,)
        cls = _import_class(recipe.get("original_class"), tuple(allowed_modules))
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
        ours = _saved_state(directory, ours_prefix)  # the rest was loaded by the class's own from_pretrained
    else:
        saved = _saved_state(directory)
        ours = {k: v for k, v in saved.items() if k.startswith(ours_prefix)}
        theirs = {k: v for k, v in saved.items() if not k.startswith(ours_prefix)}
        missing, unexpected = model.load_state_dict(theirs, strict=False)
        missing = _untied(model, missing, set(theirs))
        if unexpected or missing:
            raise ConfigError(
                f"the saved weights do not fit the {type(model).__name__} passed to from_pretrained: missing "
                f"{missing[:5]}, unexpected {unexpected[:5]}; build it with the configuration it was saved with"
            )
    model = convert(model, config, example_inputs=example_inputs, example_kwargs=example_kwargs)
    if recipe.get("pipeline_stages") is not None:
        from .pipeline import split

        split(model, recipe["pipeline_stages"], **recipe.get("pipeline_options", {}))
    expected = {k for k in model.state_dict() if k.startswith(ours_prefix)}
    if set(ours) != expected:
        raise ConfigError(
            f"{directory}: the saved depthrewrite parameters {sorted(set(ours) ^ expected)[:6]} do not match the "
            f"conversion of this model with {config.describe()}: was it saved from another architecture or size?"
        )
    model.load_state_dict(ours, strict=False)
    return model
