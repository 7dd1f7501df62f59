"""Small real models with random weights, built from specs: ``hf:<model_type>``, ``timm:<name>``,
``package.module:factory``. Nothing is downloaded: Hugging Face models come from a small config, timm models are
built with ``pretrained=False``.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.nn as nn

from ..errors import ConfigError

__all__ = ["build", "resolve", "hf_model", "timm_model", "HF_TYPES"]

#: model types the CLI and the test zoo exercise; any other transformers model type is tried the same way.
HF_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi", "gpt_neox", "gpt2", "olmo2", "mixtral",
)


def _small_kwargs(layers: int, hidden: int) -> dict[str, Any]:
    heads = max(1, hidden // 16)
    return dict(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=hidden // heads,
        max_position_embeddings=512,
        use_cache=False,
        # every named sublayer family at its smallest
        num_local_experts=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=hidden,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        rotary_dim=8,  # GPT-J, CodeGen: within the small head_dim
        swa_num_attention_heads=heads,  # Inkling: sliding-window layers have their own head counts
        swa_num_key_value_heads=max(1, heads // 2),
        swa_head_dim=hidden // heads,
        unpadded_vocab_size=256,  # Inkling: the head's row count
        text_hidden_size=hidden,  # a vision tower's projection into the text model (multimodal wrappers)
    )


def _small_tower_kwargs(hidden: int) -> dict[str, Any]:
    """A non-text tower (vision, audio) at one layer; some name their width and heads differently (Qwen2-VL)."""
    kw = _small_kwargs(1, hidden)
    kw.update(embed_dim=hidden, num_heads=kw["num_attention_heads"], depth=1)
    return kw


def _small_config(cfg_cls: type, kwargs: dict[str, Any], layers: int, hidden: int) -> Any:
    """The config, with each sub-config (``text_config``, ``vision_config``, ... of a multimodal wrapper such as
    Gemma3ForConditionalGeneration) built small too: the text model gets ``kwargs``, any other tower one layer."""
    subs = getattr(cfg_cls, "sub_configs", None) or {}
    if subs:
        default = cfg_cls()
        kwargs = dict(kwargs)
        for key in subs:
            sub = getattr(default, key, None)
            if sub is None or not hasattr(sub, "to_dict") or not hasattr(sub, "hidden_size"):
                continue  # not a tower (MPT's attn_config): keep the default
            sub_kwargs = kwargs if key == "text_config" else _small_tower_kwargs(hidden)
            kwargs[key] = _small_config(type(sub), sub_kwargs, layers, hidden)
    try:
        return cfg_cls(**kwargs)
    except (AttributeError, TypeError, NotImplementedError):
        # a derived field: a read-only head_dim property, or a property whose setter refuses any value (XLNet's
        # max_position_embeddings raises NotImplementedError: it has no sequence length limit)
        head_dim = kwargs.get("head_dim")
        kwargs = {k: v for k, v in kwargs.items() if k != "head_dim" and not _is_property(cfg_cls, k)}
        if head_dim is not None and "d_head" in (getattr(cfg_cls, "__dataclass_fields__", None) or {}):
            kwargs.setdefault("d_head", head_dim)  # XLNet names it d_head and checks d_head == d_model // n_head
        return cfg_cls(**kwargs)


def _is_property(cls: type, name: str) -> bool:
    """``name`` is a property of the config class (derived from other fields), not a plain field to pass."""
    return any(isinstance(vars(c).get(name), property) for c in cls.__mro__)


def hf_model(model_type: str, layers: int = 4, hidden: int = 64, **overrides: Any) -> nn.Module:
    """A causal-LM (or base model) of ``model_type`` with a small config and random weights."""
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - dev extra
        raise ConfigError("hf: specs need transformers; install depthrewrite[dev] or `pip install transformers`") from e
    transformers.logging.set_verbosity_error()  # small configs trip warnings about token ids and sizes
    try:
        cfg_cls = transformers.AutoConfig.for_model(model_type).__class__
    except ValueError as e:
        raise ConfigError(f"unknown Hugging Face model type {model_type!r}: {e}") from e
    kwargs = _small_kwargs(layers, hidden)
    kwargs.update(overrides)
    attn = kwargs.pop("attn_implementation", None)
    seed = kwargs.pop("seed", 0)
    cfg = _small_config(cfg_cls, kwargs, layers, hidden)
    if attn is not None:
        cfg._attn_implementation = attn
    torch.manual_seed(seed)
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        try:
            model = auto.from_config(cfg)
            break
        except ValueError:
            continue
    else:
        raise ConfigError(f"transformers has no model class for config {cfg_cls.__name__}")
    return model.eval()


def timm_model(name: str, layers: int | None = None, hidden: int | None = None, **overrides: Any) -> nn.Module:
    try:
        import timm
    except ImportError as e:  # pragma: no cover
        raise ConfigError("timm: specs need timm; install depthrewrite[dev] or `pip install timm`") from e
    kwargs: dict[str, Any] = dict(pretrained=False)
    if layers is not None:
        kwargs["depth"] = layers
    if hidden is not None:
        kwargs["embed_dim"] = hidden
    kwargs.update(overrides)
    torch.manual_seed(0)
    try:
        return timm.create_model(name, **kwargs).eval()
    except (RuntimeError, TypeError) as e:  # unknown name, or a model without depth / embed_dim
        raise ConfigError(f"timm cannot build {name!r}: {e}") from e


def build(spec: str, layers: int | None = None, hidden: int | None = None) -> nn.Module:
    """Build the model a CLI spec names: ``hf:llama``, ``timm:vit_tiny_patch16_224``, ``pkg.module:factory``.

    A ``module:factory`` spec is imported the way ``python -m`` would: a ``module.py`` (or package) in the current
    folder is found even when the current folder is not on ``sys.path`` (as under the ``depthrewrite`` script)."""
    if not isinstance(spec, str):
        raise ConfigError(f"a model spec is a string such as 'hf:llama', got {type(spec).__name__}")
    kind, sep, name = spec.partition(":")
    if not sep or not name:
        raise ConfigError(f"model spec {spec!r} must look like hf:<model_type>, timm:<name> or package.module:factory")
    if kind == "hf":
        return hf_model(name, layers=layers or 4, hidden=hidden or 64)
    if kind == "timm":
        return timm_model(name, layers=layers, hidden=hidden)
    with _cwd_on_path():
        try:
            mod = importlib.import_module(kind)
        except ImportError as e:
            raise ConfigError(f"cannot import {kind!r} from spec {spec!r} (looked in the current folder too): {e}") from e
        factory = getattr(mod, name, None)
        if factory is None:
            raise ConfigError(f"module {kind!r} has no attribute {name!r} (spec {spec!r})")
        if isinstance(factory, nn.Module):
            model = factory
        else:
            model = factory(**_size_kwargs(factory, spec, layers, hidden))
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{spec!r} did not give an nn.Module (got {type(model).__name__})")
    return model


def resolve(model: nn.Module | str) -> nn.Module:
    """The model itself, or the model a spec string names (:func:`build` at its default sizes): what lets
    ``depthrewrite.inspect("hf:llama")`` and ``convert("timm:vit_tiny_patch16_224", ...)`` take the CLI's specs."""
    if isinstance(model, str):
        return build(model)
    if not isinstance(model, nn.Module):
        from ..errors import ConfigError

        raise ConfigError(
            f"depthrewrite takes a torch.nn.Module (or a model spec string such as 'hf:llama' or "
            f"'package.module:factory'), got a {type(model).__name__}: {repr(model)[:80]}"
        )
    return model


@contextmanager
def _cwd_on_path() -> Iterator[None]:
    """The current folder first on ``sys.path`` while importing and calling a factory, as ``python -m`` has it."""
    cwd = os.getcwd()
    if "" in sys.path or cwd in sys.path:
        yield
        return
    sys.path.insert(0, cwd)
    try:
        yield
    finally:
        try:
            sys.path.remove(cwd)
        except ValueError:  # the factory removed it itself
            pass


_LAYER_NAMES = ("n_layer", "layers", "num_layers", "n_layers", "depth")
_HIDDEN_NAMES = ("n_embd", "hidden", "hidden_size", "d_model", "embed_dim", "dim")


def _size_kwargs(factory: Any, spec: str, layers: int | None, hidden: int | None) -> dict[str, int]:
    """Pass --layers / --hidden to a factory under whichever parameter name it uses."""
    params = inspect.signature(factory).parameters
    out: dict[str, int] = {}
    for value, names, flag in ((layers, _LAYER_NAMES, "--layers"), (hidden, _HIDDEN_NAMES, "--hidden")):
        if value is None:
            continue
        name = next((n for n in names if n in params), None)
        if name is None:
            raise ConfigError(f"{spec}: the factory takes none of {', '.join(names)}, so {flag} cannot be applied")
        out[name] = value
    return out
