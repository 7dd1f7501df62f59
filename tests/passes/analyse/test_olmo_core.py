"""OLMo-core's own model code: its RMSNorm runs under ``torch.autocast(enabled=False)`` (a ``wrap_with_autocast``
region in the exported graph) and applies its gain as ``self.weight.type_as(x) * x``. Detection reads the norm
through both: ``TransformerConfig.llama_like`` is a PreNorm chain, OLMo-core's OLMo2 config (``olmo2_1M``: the
``reordered_norm`` block, QK-norm) a reordered-norm chain; every scheme converts both exactly at init. Skipped
when olmo_core is not importable."""

from __future__ import annotations

import functools
import importlib.util
import sys
import types

import pytest
import torch

import depthrewrite as dr

from ..rewrite.helpers import INIT_RTOL, rel_err

VOCAB = 128
IDS = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))


def _stub(name: str) -> types.ModuleType:
    """An empty stand-in for a package OLMo-core imports at load but never uses to build or run a model."""
    mod = types.ModuleType(name)
    mod.__path__ = []

    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        value = type(attr, (), {"recoverable_errors": (), "__init__": lambda self, *a, **k: None})
        setattr(mod, attr, value)
        return value

    mod.__getattr__ = __getattr__
    return mod


@functools.lru_cache(maxsize=None)
def _olmo_core():
    """``olmo_core.nn.transformer`` (OLMo-core 3.0.0 imports ``cached_path``, which may be missing: stubbed while
    importing, removed afterwards), or skip."""
    if importlib.util.find_spec("olmo_core") is None:
        pytest.skip("olmo_core is not installed")
    added = []
    if "cached_path" not in sys.modules and importlib.util.find_spec("cached_path") is None:
        for name in ("cached_path", "cached_path.schemes"):
            sys.modules[name] = _stub(name)
            added.append(name)
        sys.modules["cached_path"].schemes = sys.modules["cached_path.schemes"]
    try:
        import olmo_core.nn.transformer as transformer
    except Exception as e:  # noqa: BLE001 - any import failure of the optional package: skip
        pytest.skip(f"olmo_core is not importable: {type(e).__name__}: {e}")
    finally:
        for name in added:
            sys.modules.pop(name, None)
    return transformer


def _build(name: str):
    T = _olmo_core().TransformerConfig
    torch.manual_seed(0)
    if name == "llama_like":
        cfg = T.llama_like(d_model=64, vocab_size=VOCAB, n_layers=2, n_heads=4)
    else:  # OLMo-core's OLMo2 config: block_name=reordered_norm, qk_norm=True
        cfg = T.olmo2_1M(vocab_size=VOCAB, n_layers=2)
    model = cfg.build(init_device="cpu")
    # OLMo-core computes its RoPE tables on first use and keeps them in a BufferCache (a Python dict): warm it with
    # real tensors, or the first capture leaves export's fake tensors there for every later call of the model
    model.init_weights(max_seq_len=64, device=torch.device("cpu"))
    return model.eval()


MODULES = [f"blocks.{i}.{m}" for i in range(2) for m in ("attention", "feed_forward")]


@pytest.mark.parametrize("name, reading", [("llama_like", "prenorm"), ("olmo2", "reordered norm")])
def test_inspect_finds_every_sublayer(name, reading):
    report = dr.inspect(_build(name), example_inputs=(IDS,))
    chain = report.chain
    assert chain.kinds == ["attention", "mlp"] * 2
    assert [s.branch_module for s in chain.sublayers] == MODULES
    assert {s.reading for s in chain.sublayers} == {reading}
    norms = [f"blocks.{i}.{n}.weight" for i in range(2) for n in ("attention_norm", "feed_forward_norm")]
    if reading == "prenorm":
        assert [s.branches[0].pre_norm.weight for s in chain.sublayers] == norms
    else:  # the norm on the branch output; the QK-norms inside attention are part of the branch
        assert [s.branches[0].post_norm.weight for s in chain.sublayers] == norms
        assert all(s.branches[0].pre_norm is None for s in chain.sublayers)
    assert chain.final_norm.weight == "lm_head.norm.weight"
    assert chain.final_norm.module == "lm_head.norm"
    assert chain.source_module == "embeddings"


EXACT = [
    pytest.param("attnres", {}, id="attnres"),
    pytest.param("attnres", {"blocks": 2}, id="attnres-block2"),
    pytest.param("msar", {}, id="msar"),
    pytest.param("mhc", {"alpha_init": 0.0}, id="mhc-alpha0"),
]


@pytest.mark.parametrize("scheme, options", EXACT)
@pytest.mark.parametrize("name", ["llama_like", "olmo2"])
def test_convert_is_exact_at_init(name, scheme, options):
    model = _build(name)
    conv = dr.convert(model, scheme, inplace=False, example_inputs=(IDS,), **options).eval()
    with torch.no_grad():
        assert rel_err(conv(IDS), model(IDS)) <= INIT_RTOL
    assert len(conv.report().chain) == 4
