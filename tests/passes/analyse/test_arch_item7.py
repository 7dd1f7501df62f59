"""Issue #12 item 7: causal-LM types of transformers 5.x that stopped short of converting.

* multimodal wrappers around a PreNorm text model (Gemma3ForConditionalGeneration): captured with the cache off in
  every sub-config, converted exactly;
* ModernBERT-decoder: the first layer has no pre-norm because the embedding ends in a norm ("source norm");
* GPT-NeoX-Japanese: the last layer's attention bias is ``bias.expand_as(h)``, which reads only h's shape;
* a residual add nested inside a branch (a short convolution's own skip) belongs to the branch;
* Inkling2 (block attention residuals) and Dory (nGPT interpolation on the unit sphere) are refused with the reason.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

import depthrewrite as dr
from depthrewrite import NotPreNormError, capture, detect_chain

from ...conftest import LAYERS, build_zoo_model, zoo_graph
from ..rewrite.helpers import INIT_RTOL, logits, rel_err

#: every scheme under the options that make it function-preserving at init
EXACT = [
    pytest.param("attnres", {}, id="attnres"),
    pytest.param("attnres", {"blocks": 2}, id="attnres-block2"),
    pytest.param("msar", {}, id="msar"),
    pytest.param("mhc", {"alpha_init": 0.0}, id="mhc-alpha0"),
    pytest.param("moda", {"preserve_init": True}, id="moda-preserve"),
]

#: (model type, what MoDA says when it cannot rewrite the attention form, else None)
CONVERTED = [
    pytest.param("gemma3", None, id="gemma3-conditional-generation"),
    pytest.param("modernbert-decoder", None, id="modernbert-decoder"),
    # eager attention as baddbmm(zeros, q, kᵀ) -> softmax: MoDA refuses it, as for BLOOM
    pytest.param("gpt_neox_japanese", "cannot be rewritten by MoDA", id="gpt-neox-japanese"),
    # short convolutions with their own skip inside k_proj/v_proj and after each branch
    pytest.param("inkling_text", None, id="inkling"),
]


def _needs(model_type: str) -> None:
    transformers = pytest.importorskip("transformers")
    try:
        transformers.AutoConfig.for_model(model_type)
    except ValueError:
        pytest.skip(f"transformers {transformers.__version__} has no model type {model_type!r}")


@functools.lru_cache(maxsize=None)
def _model(model_type: str) -> nn.Module:
    torch.manual_seed(0)
    return build_zoo_model(f"hf:{model_type}").eval()


@pytest.mark.parametrize("scheme, options", EXACT)
@pytest.mark.parametrize("model_type, moda_refusal", CONVERTED)
def test_function_preserving_at_init(model_type, moda_refusal, scheme, options):
    _needs(model_type)
    model = _model(model_type)
    if scheme == "moda" and moda_refusal:
        with pytest.raises(dr.AttentionPatternError, match=moda_refusal):
            dr.convert(model, scheme, **options, inplace=False)
        return
    conv = dr.convert(model, scheme, **options, inplace=False).eval()
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        assert rel_err(logits(conv(ids)), logits(model(ids))) <= INIT_RTOL
        assert rel_err(logits(conv(input_ids=ids)), logits(model(input_ids=ids))) <= INIT_RTOL  # same signature
    chain = conv.report().chain
    assert chain.kinds == ["attention", "mlp"] * LAYERS
    if scheme == "mhc":  # the first sublayer's input is mixed too, source norm or not
        assert len(conv.report().sites) == len(chain) + 1


def test_wrapper_capture_turns_the_sub_config_cache_off_and_restores_it():
    """Gemma3ForConditionalGeneration keeps use_cache in its text_config (the wrapper's config has none): capture
    turns it off for the export and back on afterwards."""
    _needs("gemma3")
    model = build_zoo_model("hf:gemma3")
    text = model.config.text_config
    text.use_cache = True
    assert getattr(model.config, "use_cache", None) is not True
    gm = capture(model)
    assert text.use_cache is True
    chain = detect_chain(gm)
    assert chain.kinds == ["attention", "mlp"] * LAYERS and chain.sublayers[0].reading == "sandwich"


def test_modernbert_decoder_first_sublayer_reads_the_normalised_embedding():
    _needs("modernbert-decoder")
    _, gm = zoo_graph("hf:modernbert-decoder")
    chain = detect_chain(gm)
    first = chain.sublayers[0]
    assert first.reading == "source norm" and first.branches[0].pre_norm is None
    assert first.input == chain.source and chain.source_module == "model.embeddings.drop"
    assert all(s.reading == "prenorm" for s in chain.sublayers[1:])
    assert any(n.startswith("source norm:") and "model.embeddings.norm" in n for n in chain.notes)


def test_postnorm_is_still_refused_with_a_normalised_source():
    """BERT's layer output norm also feeds the next layer raw, but it normalises a residual sum: no source norm."""
    _, gm = zoo_graph("hf:bert")
    with pytest.raises(NotPreNormError, match="PostNorm"):
        detect_chain(gm)


def test_inkling2_is_refused_as_already_depth_mixed():
    _needs("inkling2_text")
    _, gm = zoo_graph("hf:inkling2_text")
    with pytest.raises(NotPreNormError) as ei:
        detect_chain(gm)
    msg = str(ei.value)
    assert "already mixes depth" in msg and "model.final_input" in msg and "model.norm" in msg
    assert "sconv" not in msg  # not the short convolution's own skip inside k_proj
    assert ei.value.node in {n.name for n in gm.graph.nodes}


def test_dory_is_refused_as_an_interpolating_normalised_stream():
    _needs("dory")
    _, gm = zoo_graph("hf:dory")
    with pytest.raises(NotPreNormError) as ei:
        detect_chain(gm)
    msg = str(ei.value)
    assert "interpolation h + r·(f(h) − h)" in msg and "nGPT" in msg and "model.layers.0" in msg
    assert ei.value.node in {n.name for n in gm.graph.nodes}


# ---------------------------------------------------------------------------------------------------------------------
# hand-written graphs: the same patterns without transformers


class InlineNested(nn.Module):
    """PreNorm blocks whose branch has its own skip written in the layer's forward: h + (a + g(a)), a = fc(ln(h))."""

    def __init__(self, n: int = 2, d: int = 16, vocab: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ln = nn.ModuleList([nn.LayerNorm(d) for _ in range(n + 1)])
        self.fc = nn.ModuleList([nn.Linear(d, d) for _ in range(n)])
        self.g = nn.ModuleList([nn.Linear(d, d) for _ in range(n)])

    def forward(self, idx):
        h = self.emb(idx)
        for ln, fc, g in zip(self.ln, self.fc, self.g):
            a = fc(ln(h))
            h = h + (a + g(a))
        return self.ln[-1](h)


class ExpandBias(nn.Module):
    """PreNorm blocks whose branch adds a bias broadcast with ``bias.expand_as(h)`` (GPT-NeoX-Japanese)."""

    def __init__(self, n: int = 2, d: int = 16, vocab: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ln = nn.ModuleList([nn.LayerNorm(d) for _ in range(n + 1)])
        self.fc = nn.ModuleList([nn.Linear(d, d, bias=False) for _ in range(n)])
        self.bias = nn.ParameterList([nn.Parameter(torch.randn(d)) for _ in range(n)])

    def forward(self, idx):
        h = self.emb(idx)
        for ln, fc, b in zip(self.ln, self.fc, self.bias):
            h = h + (fc(ln(h)) + b.expand_as(h))
        return self.ln[-1](h)


class ShortConv(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.w = nn.Linear(d, d)

    def forward(self, a):
        return (a + self.w(a)) * 0.5


class NestedThenPostNorm(nn.Module):
    """A PreNorm block with a short convolution (own skip) in its branch, then a PostNorm block."""

    def __init__(self, d: int = 16, vocab: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ln0, self.ln1 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.fc0, self.fc1 = nn.Linear(d, d), nn.Linear(d, d)
        self.conv = ShortConv(d)

    def forward(self, idx):
        h = self.emb(idx)
        h = h + self.conv(self.fc0(self.ln0(h)))
        return self.ln1(h + self.fc1(h))


IDS = torch.randint(0, 32, (2, 6))


def test_nested_add_inside_a_branch_is_one_branch():
    gm = capture(InlineNested(), (IDS,))
    chain = detect_chain(gm)
    assert len(chain) == 2
    for s in chain.sublayers:
        assert s.reading == "prenorm" and len(s.branches) == 1 and len(s.adds) == 1


@pytest.mark.parametrize("scheme, options", EXACT[:-1])  # MoDA needs attention sublayers
@pytest.mark.parametrize("cls", [InlineNested, ExpandBias])
def test_hand_written_patterns_convert_exactly(cls, scheme, options):
    torch.manual_seed(0)
    model = cls().eval()
    conv = dr.convert(model, scheme, example_inputs=(IDS,), **options, inplace=False).eval()
    x = torch.randint(0, 32, (3, 5))
    with torch.no_grad():
        assert rel_err(conv(x), model(x)) <= INIT_RTOL


def test_nested_add_is_not_reported_as_the_offending_step():
    """The refusal names the PostNorm add, not the short convolution's own skip inside the first branch."""
    gm = capture(NestedThenPostNorm(), (IDS,))
    with pytest.raises(NotPreNormError) as ei:
        detect_chain(gm)
    node = {n.name: n for n in gm.graph.nodes}[ei.value.node]
    assert "conv" not in str(ei.value).split(" is not PreNorm")[0]
    assert node.args[0].op != "get_attr" and "PostNorm" in str(ei.value)
