"""Tiny models built from the training frameworks' own classes and configs (litgpt, torchtitan, torchtune,
OLMo-core): 2 layers, hidden 64, vocab 128, random weights, nothing downloaded.

API::

    model, args, kwargs = build("litgpt", "pythia-14m")     # skips the test when litgpt is not installed
    out = model(*args, **kwargs)                              # logits [B, T, vocab]
    CASES                                                     # every (framework, name) pair build() knows

Every builder seeds torch (``seed=``, default 0) so two builds of one case have equal weights. The frameworks are
imported lazily: importing this module needs none of them.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

__all__ = ["CASES", "FRAMEWORKS", "build", "example_inputs", "require", "cases", "VOCAB", "SEQ", "BATCH"]

VOCAB = 128
DIM = 64
LAYERS = 2
BATCH = 2
SEQ = 9
#: how many tokens the RoPE caches / position tables cover (kept small: a few of them are buffers)
MAX_SEQ = 64

#: framework -> the import name that must be importable
FRAMEWORKS = {"litgpt": "litgpt", "torchtitan": "torchtitan", "torchtune": "torchtune", "olmo_core": "olmo_core"}


# ---- stubs ----------------------------------------------------------------------------------------------------------
# torchtune 0.6.1 imports `datasets` (Hugging Face datasets) at package load (torchtune/__init__ -> torchtune.datasets
# -> `from datasets import load_dataset`), and OLMo-core 3.0.0 imports `cached_path` and `cached_path.schemes` (which
# pull cloud-storage clients) from olmo_core.io / olmo_core.config. Building and running a model uses neither, and
# neither is installed here, so while the framework is imported an empty stand-in module answers those imports. The
# stand-ins are removed from sys.modules right after the import, so nothing else in the test session (transformers'
# "is datasets installed?" checks, say) ever sees them; the framework keeps its references to the stand-in objects.

# torchtune also imports torchao (`torchao.dtypes.nf4tensor`, for QLoRA) at load; torchao 0.13 (the last with that
# module) is older than peft accepts (peft refuses torchao < 0.16 when it is installed, and the LoRA tests need
# peft). CI installs torchao 0.18 (the torchao tests): a stand-in answers each torchao module it lacks, and no model
# built here uses NF4. torchtune.training's quantizers import names torchao 0.18 no longer has
# (`TensorCoreTiledLayout`, `int4_weight_only`): that one torchtune module is stood in for when it does not import
# (the tests use torchtune.training's checkpointing helper only).
_STUBS = {
    "torchtune": {"datasets": ("datasets.distributed",), "torchao": (
        "torchao.dtypes", "torchao.dtypes.nf4tensor",  # the models (QLoRA's NF4)
        "torchao.quantization", "torchao.quantization.qat", "torchao.quantization.qat.linear",  # torchtune.training
    )},
    "olmo_core": {"cached_path": ("cached_path.schemes",)},
}
# modules of the framework itself stood in for when they do not import beside the installed packages
_BROKEN = {"torchtune": ("torchtune.training.quantization",)}


def _stand_in(qualname: str) -> type:
    """A class for any name imported from a stub: usable as a base class, callable, never doing anything."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:  # used as a decorator (torchao's `implements(ops)`)
            return args[0]
        raise RuntimeError(f"{qualname} is a test stub (the real package is not installed)")

    return type(qualname.rsplit(".", 1)[-1], (), {"__init__": __init__, "__call__": __call__,
                                                   "__module__": qualname.rsplit(".", 1)[0],
                                                   "recoverable_errors": ()})


def _stub_module(name: str) -> types.ModuleType:
    mod = types.ModuleType(name, f"test stub for {name} (not installed; see tests/frameworks/models.py)")
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    mod.__path__ = []  # a package, so `import name.sub` looks in sys.modules

    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        value = _stand_in(f"{name}.{attr}")
        setattr(mod, attr, value)
        return value

    mod.__getattr__ = __getattr__
    mod.__depthrewrite_test_stub__ = True
    return mod


def _importable(name: str) -> bool:
    """Whether ``name`` is imported or importable (its parents imported to look: they are real packages then)."""
    if name in sys.modules:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package is missing
        return False


@contextlib.contextmanager
def _stubbed(framework: str):
    """Stand-ins for the packages ``framework`` imports at load but does not need for models, while inside."""
    added = []
    for top, subs in _STUBS.get(framework, {}).items():
        for name in (top, *subs):
            if not _importable(name):  # a module the installed package lacks (torchao 0.18 has no dtypes.nf4tensor)
                sys.modules[name] = _stub_module(name)
                added.append(name)
        for sub in subs:
            parent, _, leaf = sub.rpartition(".")
            if sub in added:
                setattr(sys.modules[parent], leaf, sys.modules[sub])
    for name in _BROKEN.get(framework, ()):
        if name not in sys.modules and importlib.util.find_spec(FRAMEWORKS[framework]) is not None:
            try:
                importlib.import_module(name)
            except ImportError:
                sys.modules[name] = _stub_module(name)
                added.append(name)
    try:
        yield
    finally:
        for name in added:
            if getattr(sys.modules.get(name), "__depthrewrite_test_stub__", False):
                del sys.modules[name]
            parent, _, leaf = name.rpartition(".")
            if getattr(getattr(sys.modules.get(parent), leaf, None), "__depthrewrite_test_stub__", False):
                delattr(sys.modules[parent], leaf)  # a stand-in set on a real package


def require(framework: str, *modules: str) -> None:
    """Import ``framework`` (with its stubs) and ``modules``, or skip the calling test when it is not installed."""
    top = FRAMEWORKS[framework]
    if importlib.util.find_spec(top) is None:
        pytest.skip(f"{framework} is not installed (pip install --no-deps, see pyproject's `frameworks` extra)")
    with _stubbed(framework):
        for m in (top, *modules):
            try:
                importlib.import_module(m)
            except ImportError as e:  # an installed framework missing one of its small dependencies
                pytest.skip(f"{framework} is installed but {m} does not import: {type(e).__name__}: {e}")


def example_inputs(model: nn.Module, *, batch: int = BATCH, seq: int = SEQ, seed: int = 1) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for one forward of a model :func:`build` made: token ids ``[batch, seq]`` in its vocab."""
    vocab = getattr(model, "_test_vocab", VOCAB)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    if getattr(model, "_test_flex", False):  # torchtitan with FlexAttention: positions and their (causal) BlockMask
        positions = torch.arange(seq).expand(batch, seq)
        return (ids,), {"positions": positions, "attention_masks": model.get_attention_masks(positions)}
    return (ids,), {}


# ---- litgpt ---------------------------------------------------------------------------------------------------------

#: name -> Config.from_name overrides beyond the common tiny sizes (GQA where the real model has it)
_LITGPT = {
    "pythia-14m": {},
    "phi-2": {},
    "Llama-3.2-1B": {"n_query_groups": 2},
    "gemma-2-2b": {"n_query_groups": 2, "sliding_window_size": 4},  # window < SEQ: the local layers mask something
}


def _litgpt(name: str, **kw: Any) -> nn.Module:
    require("litgpt")
    from litgpt import GPT, Config

    opts = dict(n_layer=LAYERS, n_embd=DIM, n_head=4, head_size=DIM // 4, intermediate_size=2 * DIM,
                vocab_size=VOCAB, padded_vocab_size=VOCAB, block_size=MAX_SEQ)
    opts.update(_LITGPT[name])
    opts.update(kw)
    model = GPT(Config.from_name(name, **opts))
    model._test_vocab = opts["padded_vocab_size"]
    return model


# ---- torchtitan -----------------------------------------------------------------------------------------------------


def _titan_attention(cfg: Any, attention: str) -> Any:
    """Swap every layer's inner attention for ``attention`` ("sdpa": torchtitan's ScaledDotProductAttention, causal,
    whose backward runs on CPU; "flex": the registry's FlexAttention, as built)."""
    if attention == "flex":
        return cfg
    if attention != "sdpa":
        raise ValueError(f"attention must be 'sdpa' or 'flex', got {attention!r}")
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in list(cfg.layers) + list(getattr(cfg, "mtp_layers", None) or []):
        att = getattr(layer, "attention", None)
        if att is not None:
            att.inner_attention = ScaledDotProductAttention.Config()
    return cfg


def _titan_llama3(attn_backend: str) -> Any:
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers, _EMBEDDING_INIT, _NORM_INIT, _output_linear_init

    n_heads = 4
    return Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=_build_llama3_layers(
            fuse_qkv=True, n_layers=LAYERS, dim=DIM, n_heads=n_heads, n_kv_heads=2, hidden_dim=2 * DIM,
            rope=ComplexRoPE.Config(dim=DIM // n_heads, max_seq_len=MAX_SEQ, theta=500000, scaling="llama"),
            attn_backend=attn_backend,
        ),
    )


def _titan_qwen3(attn_backend: str) -> Any:
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import (Qwen3Model, _build_qwen3_layers, _EMBEDDING_SKIP_INIT, _LINEAR_INIT,
                                         _qwen3_norm)

    head_dim = 16
    return Qwen3Model.Config(
        vocab_size=VOCAB, dim=DIM, norm=_qwen3_norm(DIM), enable_weight_tying=True,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_SKIP_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_LINEAR_INIT),
        layers=_build_qwen3_layers(
            fuse_qkv=True, n_layers=LAYERS, dim=DIM, n_heads=4, n_kv_heads=2, head_dim=head_dim,
            hidden_dim=2 * DIM, attn_backend=attn_backend,
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=MAX_SEQ, theta=1000000.0),
        ),
    )


def _titan_deepseek_v3(attn_backend: str) -> Any:
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.deepseek_v3 import (DeepSeekV3Model, _build_dsv3_layers, _EMBEDDING_INIT, _NORM_INIT,
                                               _output_linear_init)

    rope_dim = 8
    layers = _build_dsv3_layers(  # layer 0 dense, layer 1 MoE (4 routed experts, top-2, 1 shared): MLA in both
        n_layers=LAYERS, n_dense_layers=1, dim=DIM, n_heads=4, q_lora_rank=0, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=rope_dim, v_head_dim=16, mscale=0.70,
        dense_hidden_dim=2 * DIM, moe_hidden_dim=32, num_experts=4, num_shared_experts=1, router_top_k=2,
        router_score_func="softmax", attn_backend=attn_backend, moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=MAX_SEQ, theta=10000.0, scaling="yarn", rope_factor=40.0,
                                beta_fast=32.0, beta_slow=1.0, original_seq_len=MAX_SEQ // 4),
    )
    return DeepSeekV3Model.Config(
        vocab_size=VOCAB, dim=DIM,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=layers,
    )


_TITAN = {"llama3": _titan_llama3, "qwen3": _titan_qwen3, "deepseek_v3": _titan_deepseek_v3}


def _titan_sharding(cfg: Any, name: str, sharding: str) -> None:
    """torchtitan's own tensor-parallel plan on ``cfg`` (what its trainer's config converters set before building):
    ``"tp"`` keeps activations replicated between modules, ``"sp"`` shards them along the sequence."""
    mod = importlib.import_module(f"torchtitan.models.{name}.sharding")
    extra = {"enable_ep": False} if name != "llama3" else {}
    getattr(mod, f"set_{name}_sharding_config")(cfg, enable_sp=sharding == "sp", **extra)


def _torchtitan(name: str, attention: str = "sdpa", sharding: str | None = None, tie: bool | None = None) -> nn.Module:
    require("torchtitan", f"torchtitan.models.{name}")
    cfg = _titan_attention(_TITAN[name]("flex"), attention)
    if tie is not None:
        cfg.enable_weight_tying = tie
    if sharding is not None:  # applied by model.parallelize(parallel_dims)
        _titan_sharding(cfg, name, sharding)
    model = cfg.build()
    model.init_states()
    model._test_flex = attention == "flex"
    return model


# ---- torchtune ------------------------------------------------------------------------------------------------------


def _torchtune(name: str, **kw: Any) -> nn.Module:
    require("torchtune", f"torchtune.models.{name}")
    if name == "llama3":
        from torchtune.models.llama3 import llama3 as builder
    elif name == "qwen2":
        from torchtune.models.qwen2 import qwen2 as builder
    else:
        raise KeyError(name)
    opts = dict(vocab_size=VOCAB, num_layers=LAYERS, num_heads=4, num_kv_heads=2, embed_dim=DIM,
                intermediate_dim=2 * DIM, max_seq_len=MAX_SEQ)
    opts.update(kw)
    return builder(**opts)


# ---- OLMo-core ------------------------------------------------------------------------------------------------------


def _olmo_core(name: str, **kw: Any) -> nn.Module:
    require("olmo_core", "olmo_core.nn.transformer")
    from olmo_core.nn.transformer import TransformerBlockType, TransformerConfig

    opts = dict(d_model=DIM, vocab_size=VOCAB, n_layers=LAYERS, n_heads=4, hidden_size_multiple_of=16)
    if name == "llama_like":
        opts.update(n_kv_heads=2)
    elif name == "olmo2":  # OLMo2's block: norms after attention / MLP (reordered_norm) and QK-norm
        opts.update(block_name=TransformerBlockType.reordered_norm, qk_norm=True, layer_norm_eps=1e-6)
    else:
        raise KeyError(name)
    opts.update(kw)
    model = TransformerConfig.llama_like(**opts).build(init_device="cpu")
    model.init_weights(max_seq_len=MAX_SEQ, device=torch.device("cpu"))
    return model


# ---- the table ------------------------------------------------------------------------------------------------------

_BUILDERS: dict[str, tuple[Callable[..., nn.Module], tuple[str, ...]]] = {
    "litgpt": (_litgpt, tuple(_LITGPT)),
    "torchtitan": (_torchtitan, tuple(_TITAN)),
    "torchtune": (_torchtune, ("llama3", "qwen2")),
    "olmo_core": (_olmo_core, ("llama_like", "olmo2")),
}

#: every (framework, name) pair :func:`build` knows
CASES: list[tuple[str, str]] = [(fw, name) for fw, (_, names) in _BUILDERS.items() for name in names]


def cases(framework: str) -> list[str]:
    """The model names of one framework in :data:`CASES`."""
    return [name for fw, name in CASES if fw == framework]


def build(framework: str, name: str, *, seed: int = 0, **kw: Any) -> tuple[nn.Module, tuple, dict]:
    """A tiny ``name`` model of ``framework`` (fp32, CPU, eval mode, seeded weights) and example ``(args, kwargs)``
    for one forward that returns logits ``[BATCH, SEQ, VOCAB]``. Skips the calling test when the framework is
    missing. ``kw`` go to the framework's config (litgpt: ``Config.from_name``; torchtune: the model builder;
    OLMo-core: ``TransformerConfig.llama_like``) or, for torchtitan, ``attention="sdpa"`` (default: causal SDPA,
    CPU-trainable) or ``"flex"`` (the registry's FlexAttention, whose backward has no CPU kernel; the example kwargs
    then carry ``positions`` and the model's own ``get_attention_masks(positions)`` BlockMask), ``sharding="tp"`` or
    ``"sp"`` (its own tensor-parallel plan, applied by ``model.parallelize``) and ``tie`` (weight tying)."""
    if framework not in _BUILDERS:
        raise KeyError(f"unknown framework {framework!r}; known: {sorted(_BUILDERS)}")
    fn, names = _BUILDERS[framework]
    if name not in names:
        raise KeyError(f"unknown {framework} model {name!r}; known: {list(names)}")
    torch.manual_seed(seed)
    model = fn(name, **kw).float().eval()
    args, kwargs = example_inputs(model)
    return model, args, kwargs
