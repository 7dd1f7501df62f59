"""Small real models with random weights, built from specs: ``hf:<model_type>``, ``timm:<name>``,
``package.module:factory``. Nothing is downloaded: Hugging Face models come from a small config, timm models are
built with ``pretrained=False``.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.nn as nn

from .errors import ConfigError

__all__ = ["build", "resolve", "hf_model", "timm_model", "check_hf_type", "HF_TYPES", "NOT_BUILT"]

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


def _fields(cfg_cls: type) -> set[str]:
    """The names a config class takes: its dataclass fields, ``__init__`` parameters and ``attribute_map`` aliases."""
    names = set(getattr(cfg_cls, "__dataclass_fields__", None) or {})
    try:
        names |= {n for n, p in inspect.signature(cfg_cls.__init__).parameters.items()
                  if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    except (TypeError, ValueError):  # pragma: no cover - a builtin __init__
        pass
    names |= set(getattr(cfg_cls, "attribute_map", None) or {})
    names.discard("self")
    return names


_NO_DEFAULT = object()


def _default(cfg_cls: type, name: str) -> Any:
    """The class default of field ``name`` (``_NO_DEFAULT`` when it has none we can read without building one)."""
    field = (getattr(cfg_cls, "__dataclass_fields__", None) or {}).get(name)
    if field is not None:
        if field.default is not dataclasses.MISSING:
            return field.default
        if field.default_factory is not dataclasses.MISSING:
            return field.default_factory()
        return _NO_DEFAULT
    try:
        param = inspect.signature(cfg_cls.__init__).parameters.get(name)
    except (TypeError, ValueError):  # pragma: no cover
        return _NO_DEFAULT
    return _NO_DEFAULT if param is None or param.default is param.empty else param.default


def _family_kwargs(cfg_cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Small sizes for the field families a config class declares, consistent with the small ``kwargs``: what the
    one-size-fits-all names of :func:`_small_kwargs` leave at a full-size default that no longer fits."""
    fields = _fields(cfg_cls)
    hidden, heads, layers = kwargs["hidden_size"], kwargs["num_attention_heads"], kwargs["num_hidden_layers"]
    hd = kwargs["head_dim"]
    experts = kwargs["num_experts"]
    out: dict[str, Any] = {}
    if "kv_lora_rank" in fields:
        # multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, GLM-4-MoE-Lite, LongCat, ...): the query/key head is
        # a no-position part plus a rotary part, the rotary embedding is sized by head_dim (== qk_rope_head_dim; some
        # configs derive or alias it), keys and values are expanded per head (no grouping)
        out.update(kv_lora_rank=hidden // 2, q_lora_rank=hidden // 2, qk_rope_head_dim=hd // 2,
                   qk_nope_head_dim=hd // 2, v_head_dim=hd, head_dim=hd // 2, num_key_value_heads=heads)
        if "qk_head_dim" in fields:
            out["qk_head_dim"] = hd
        if "index_head_dim" in fields:  # DeepSeek sparse attention's indexer
            out.update(index_head_dim=hd, index_n_heads=max(1, heads // 2), index_topk=8)
    # grouped expert routing (DeepSeek-V3 style): each group needs at least 2 of the few small experts
    n_group = _default(cfg_cls, "n_group") if "n_group" in fields else None
    if isinstance(n_group, int) and n_group > 1 and experts // n_group < 2:
        out.update(n_group=2, topk_group=1)
    # the first k layers dense: keep at least one MoE layer in the tiny stack
    dense = _default(cfg_cls, "first_k_dense_replace") if "first_k_dense_replace" in fields else None
    if isinstance(dense, int) and dense > layers - 1:
        out["first_k_dense_replace"] = max(0, layers - 1)
    if isinstance(n := _default(cfg_cls, "zero_expert_num"), int) and n > 2:
        out["zero_expert_num"] = 2  # LongCat's identity experts: each still has its rows in the expert weights
    if "n_shared_experts" in fields and _default(cfg_cls, "n_shared_experts") is None:
        out["n_shared_experts"] = 1  # dots1: None, then multiplied by the expert width
    # decoder / encoder head counts of an encoder-decoder config (Whisper: 6, PLBart: 12) that do not divide
    for name in ("decoder_attention_heads", "encoder_attention_heads"):
        n = _default(cfg_cls, name) if name in fields else None
        if isinstance(n, int) and hidden % n:
            out[name] = heads
    # GPT-Neo: [[kinds, repeats]], expanded into one attention kind per layer (must be num_layers of them)
    if "attention_types" in fields:
        kinds = ["global", "local"] if layers % 2 == 0 else ["global"]
        out["attention_types"] = [[kinds, layers // len(kinds)]]
    # Mamba-2: hidden_size * expand == num_heads * head_dim, heads in n_groups groups
    if {"expand", "num_heads", "n_groups", "state_size"} <= fields:
        expand = _default(cfg_cls, "expand")
        if isinstance(expand, int):
            out.update(num_heads=hidden * expand // hd, n_groups=1, state_size=16)
    # Gemma-3n style per-layer inputs and KV sharing: a full-size per-layer embedding table, and more layers
    # sharing their KV than the tiny model has
    if isinstance(_default(cfg_cls, "vocab_size_per_layer_input"), int):
        out["vocab_size_per_layer_input"] = kwargs["vocab_size"]
    if (n := _default(cfg_cls, "hidden_size_per_layer_input")) and isinstance(n, int):
        out["hidden_size_per_layer_input"] = hd
    if (n := _default(cfg_cls, "num_kv_shared_layers")) and isinstance(n, int) and n >= layers:
        out["num_kv_shared_layers"] = 0
    if (n := _default(cfg_cls, "laurel_rank")) and isinstance(n, int):
        out["laurel_rank"] = hd // 2
    # a tower's adapter into the text model (Dots3-Note): its input is the tower's width, its output the text's
    for name in ("adapter_in_dim", "adapter_input_size", "adapter_out_dim"):
        if name in fields:
            out[name] = hidden
    # BLT: the local encoder / decoder project to the global transformer's width; hashed n-gram embeddings
    if "hidden_size_global" in fields:
        out["hidden_size_global"] = hidden
    if "encoder_hash_byte_group_vocab" in fields:
        out["encoder_hash_byte_group_vocab"] = kwargs["vocab_size"]
    return out


def _small_tower_kwargs(hidden: int) -> dict[str, Any]:
    """A non-text tower (vision, audio) at one layer; some name their width and heads differently (Qwen2-VL)."""
    kw = _small_kwargs(1, hidden)
    kw.update(embed_dim=hidden, num_heads=kw["num_attention_heads"], depth=1)
    return kw


def _small_config(cfg_cls: type, base: dict[str, Any], fixed: dict[str, Any], layers: int, hidden: int) -> Any:
    """The config: ``base`` sizes, the sizes this class's own field families need (:func:`_family_kwargs`), then
    ``fixed`` (per-type and caller overrides) over both. Each sub-config (``text_config``, ``vision_config``, ... of a
    multimodal wrapper such as Gemma3ForConditionalGeneration) is built small too: the text model from the same
    ``base`` and ``fixed``, any other tower at one layer."""
    kwargs = {**base, **_family_kwargs(cfg_cls, base), **fixed}
    # an alias (attribute_map: DBRX's hidden_size -> d_model) under its own name, so that __post_init__ sees it
    aliases = getattr(cfg_cls, "attribute_map", None) or {}
    for alias, name in aliases.items():
        if alias in kwargs and name not in kwargs:
            kwargs[name] = kwargs.pop(alias)
    subs = getattr(cfg_cls, "sub_configs", None) or {}
    if subs:
        default = cfg_cls()
        for key in subs:
            sub_fixed = fixed.get(key, {})
            if not isinstance(sub_fixed, dict):
                continue  # a config given whole
            sub = getattr(default, key, None)
            if sub is None or not hasattr(sub, "to_dict") or not hasattr(sub, "hidden_size"):
                continue  # not a tower (MPT's attn_config): the default, or the fields given for it (DBRX's)
            if key == "text_config":
                kwargs[key] = _small_config(type(sub), base, {**fixed, **sub_fixed}, layers, hidden)
            else:  # fields given for a tower are set over its small sizes
                kwargs[key] = _small_config(type(sub), _small_tower_kwargs(hidden), sub_fixed, layers, hidden)
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


#: model types in transformers' causal-LM mapping that the zoo does not build, and why
NOT_BUILT = {
    "gemma4_assistant": "a Gemma 4 assistant (draft) model: its forward takes the target model's input embeddings "
                        "and shared KV states, it is no language model on its own",
    "gemma4_unified_assistant": "a Gemma 4 assistant (draft) model: its forward takes the target model's input "
                                "embeddings and shared KV states, it is no language model on its own",
    "gemma3n": "its vision tower is timm's mobilenetv5_300m_enc at full size whatever the config says (294M "
               "parameters, no width to set); hf:gemma3n_text is its language model, built tiny",
}


def _type_overrides(model_type: str, layers: int, hidden: int) -> dict[str, Any]:
    """Per-type config values that the config's own fields do not give (a validator's rule, a per-layer list with no
    default, a sub-config the model reads a field from that the sub-config does not declare)."""
    heads = max(1, hidden // 16)
    if model_type == "zaya":  # its validator: one expert per token
        return {"num_experts_per_tok": 1}
    if model_type == "dots3_note":  # the vision tower's expert pyramid is fixed at 42 layers unless given per layer
        return {"vision_config": {"mlp_layer_types": ["dense"]}}
    if model_type in ("zamba", "zamba2"):  # a block list for the full depth by default; Mamba and hybrid blocks
        return {"layers_block_type": [("linear_attention", "hybrid")[i % 2] for i in range(layers)]}
    if model_type == "lfm2_moe":  # layer_types has no default; conv and attention layers, the first dense
        return {"layer_types": [("conv", "full_attention")[i % 2] for i in range(layers)], "num_dense_layers": 1}
    if model_type == "dbrx":  # DbrxAttention reads attn_config.rope_theta, which DbrxAttentionConfig does not declare
        # (and clamps with clip_qkv whether set or not); the FFN config is its own, at full size by default
        return {"attn_config": {"kv_n_heads": max(1, heads // 2), "rope_theta": 10000.0, "clip_qkv": 8.0},
                "ffn_config": {"hidden_size": hidden, "ffn_hidden_size": 2 * hidden, "moe_num_experts": 4,
                               "moe_top_k": 2}}
    if model_type == "cohere_compass_text":  # the rotary embedding reads one rope entry per layer type
        return {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}}
    if model_type == "reformer":  # ReformerModelWithLMHead asserts is_decoder; axial position factors sum to hidden
        return {"is_decoder": True, "axial_pos_embds_dim": (hidden // 2, hidden // 2), "axial_pos_shape": (8, 8)}
    if model_type in ("musicgen", "musicgen_melody"):  # input_ids rows are (batch x codebooks): 2 rows, 2 codebooks
        return {"num_codebooks": 2}
    return {}


def check_hf_type(model_type: str) -> None:
    """A short :class:`ConfigError` naming ``model_type`` and the closest known types when the installed transformers
    has no such model type (transformers' own message lists all of them, several kB). No-op for a known type."""
    from transformers import CONFIG_MAPPING

    known = list(CONFIG_MAPPING.keys())
    if model_type in known:
        return
    close = difflib.get_close_matches(model_type.lower(), known, n=5, cutoff=0.7)
    hint = ("did you mean " + ", ".join(close) + "?") if close else \
        "tested types include llama, mistral, qwen2, qwen3, gemma, gpt2, phi, mixtral"
    raise ConfigError(f"unknown Hugging Face model type {model_type!r}: {hint} (any of the installed transformers' "
                      f"{len(known)} model types; docs/architectures.md lists the tested ones)")


def _lm_class(transformers: Any, model_type: str) -> type | None:
    """The causal-LM class transformers maps ``model_type`` to, if any."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return getattr(transformers, name, None) if name else None


def hf_model(model_type: str, layers: int = 4, hidden: int = 64, **overrides: Any) -> nn.Module:
    """A causal-LM (or base model) of ``model_type`` with a small config and random weights."""
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - dev extra
        raise ConfigError("hf: specs need transformers; install depthrewrite[dev] or `pip install transformers`") from e
    transformers.logging.set_verbosity_error()  # small configs trip warnings about token ids and sizes
    check_hf_type(model_type)
    if model_type in NOT_BUILT:
        raise ConfigError(f"hf:{model_type} is not built: {NOT_BUILT[model_type]}")
    cfg_cls = transformers.CONFIG_MAPPING[model_type]
    lm_cls = _lm_class(transformers, model_type)
    own = getattr(lm_cls, "config_class", None)
    subs = getattr(cfg_cls, "sub_configs", None) or {}
    if own is not None and own is not cfg_cls and "text_config" not in subs and own in subs.values():
        cfg_cls = own  # MusicGen: the causal LM is the composite's decoder and takes the decoder's own config
    fixed = {**_type_overrides(model_type, layers, hidden), **overrides}
    attn = fixed.pop("attn_implementation", None)
    seed = fixed.pop("seed", 0)
    cfg = _small_config(cfg_cls, _small_kwargs(layers, hidden), fixed, layers, hidden)
    if attn is not None:
        cfg._attn_implementation = attn
    torch.manual_seed(seed)
    model = None
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        try:
            model = auto.from_config(cfg)
            break
        except ValueError as e:
            if "Unrecognized configuration class" not in str(e):
                raise  # the model's own complaint about the config, not a missing mapping
            if auto is transformers.AutoModelForCausalLM and lm_cls is not None:
                model = lm_cls._from_config(cfg)  # a sub-config the auto mapping does not list (MusicGen's decoder)
                break
    if model is None:
        raise ConfigError(f"transformers has no model class for config {cfg_cls.__name__}")
    languages = getattr(cfg, "languages", None)
    if hasattr(model, "set_default_language") and languages:
        model.set_default_language(languages[0])  # X-MOD: an adapter per language, none chosen by default
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
