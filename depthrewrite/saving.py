"""Save and load converted models: ``converted.save_pretrained(dir)`` and what :func:`depthrewrite.from_pretrained`
reads back.

A saved directory holds the model as its own class saves it (a Hugging Face model's ``save_pretrained``: config,
generation config, ``model.safetensors`` with every state-dict key including the new ``depthrewrite.*`` ones; any other
model: ``pytorch_model.bin``, its state dict) plus ``depthrewrite.json``, the conversion's recipe::

    {"format": 1, "depthrewrite": "0.1.0", "scheme": {"scheme": "msar", "version": 1, ...options},
     "original_class": "transformers.models.llama.modeling_llama:LlamaForCausalLM", "pipeline_stages": null,
     "pipeline_options": {}}

:func:`depthrewrite.from_pretrained` builds the original model (``from_pretrained`` of its class for HF; a model you pass for any
other), converts it with the recorded scheme and options, and loads the new parameters. The graphs are not saved: they
are captured again on first use. HF ``Trainer`` checkpoints go through ``save_pretrained``, so they carry the recipe
too, and resuming loads the ``depthrewrite.*`` parameters with the rest of the state dict.

The recipe's ``original_class`` is read from the directory, so it is treated as untrusted: without ``model=``, only a
``transformers.`` module's ``PreTrainedModel`` subclass is imported, or a class of a package the caller names in
``allowed_modules=``; any other name is refused before its module is imported (see :func:`import_class`).
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ._version import __version__
from .errors import ConfigError
from .runtime.handle import state_of

__all__ = ["save_pretrained", "read_recipe", "RECIPE", "FORMAT"]

RECIPE = "depthrewrite.json"
FORMAT = 1
_PLAIN_WEIGHTS = "pytorch_model.bin"


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _allowed(module: str, allowed_modules: tuple[str, ...]) -> bool:
    return any(module == m or module.startswith(m + ".") for m in allowed_modules)


def import_class(path: str, allowed_modules: tuple[str, ...] = ()) -> type:
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


def untied(model: nn.Module, missing: list[str], loaded: set[str]) -> list[str]:
    """The keys of ``missing`` that no loaded key shares a tensor with (HF saves one name of tied weights)."""
    names: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(name)
    by_name = {n: i for i, ns in names.items() for n in ns}
    return [k for k in missing if not any(n in loaded for n in names.get(by_name.get(k, -1), []) if n != k)]


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
    """Save a converted model and its recipe (see the module docstring). Extra arguments go to the original
    ``save_pretrained`` (HF models); other models accept none."""

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


def config_from(recipe: dict[str, Any]) -> Any:
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


def saved_state(directory: Path, prefix: str | None = None) -> dict[str, torch.Tensor]:
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
