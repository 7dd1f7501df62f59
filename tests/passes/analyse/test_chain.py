"""Chain detection on real architectures (HF transformers, timm, nanoGPT style) and on graphs that must be refused."""

from __future__ import annotations

import pytest
import torch

from depthrewrite import NoResidualChainError, NotPreNormError, capture, detect_chain
from depthrewrite.testing import NoNormResidual, PlainMLP

from ...conftest import LAYERS, zoo_graph


def seq(attn: str, mlp: str, layers: str = "model.layers"):
    """Expected (kind, branch module) per sublayer for a sequential PreNorm decoder."""
    out = []
    for i in range(LAYERS):
        out += [("attention", f"{layers}.{i}.{attn}"), ("mlp", f"{layers}.{i}.{mlp}")]
    return out


def par(attn: str, mlp: str, layers: str):
    """Expected (kind, branch modules) per sublayer for a parallel block (one sublayer per block)."""
    return [("attention+mlp", (f"{layers}.{i}.{attn}", f"{layers}.{i}.{mlp}")) for i in range(LAYERS)]


# (zoo name, expected sublayers, source module, final norm module, reading)
ZOO = [
    pytest.param("hf:llama", seq("self_attn", "mlp"), "model.embed_tokens", "model.norm", "prenorm", id="llama"),
    pytest.param("hf:mistral", seq("self_attn", "mlp"), "model.embed_tokens", "model.norm", "prenorm", id="mistral"),
    pytest.param("hf:qwen2", seq("self_attn", "mlp"), "model.embed_tokens", "model.norm", "prenorm", id="qwen2"),
    # qk-norm inside attention must not be mistaken for a pre-norm
    pytest.param("hf:qwen3", seq("self_attn", "mlp"), "model.embed_tokens", "model.norm", "prenorm", id="qwen3"),
    # RMSNorm written out with the (1 + weight) gain; scaled embedding as the stream source
    pytest.param("hf:gemma", seq("self_attn", "mlp"), "model.embed_tokens", "model.norm", "prenorm", id="gemma"),
    # sandwich norms: a post-norm on every branch output
    pytest.param("hf:gemma2", seq("self_attn", "mlp"), "model.embed_tokens", "model.norm", "sandwich", id="gemma2"),
    # parallel block with one shared LayerNorm (h + attn(ln(h)) + mlp(ln(h)))
    pytest.param("hf:phi", par("self_attn", "mlp", "model.layers"), "model.embed_dropout", "model.final_layernorm", "parallel", id="phi"),
    # parallel block with two norms
    pytest.param("hf:gpt_neox", par("attention", "mlp", "gpt_neox.layers"), "gpt_neox.emb_dropout", "gpt_neox.final_layer_norm", "parallel", id="gpt_neox"),
    # position embeddings added, dropout, Conv1D (addmm) projections
    pytest.param("hf:gpt2", seq("attn", "mlp", "transformer.h"), "transformer.drop", "transformer.ln_f", "prenorm", id="gpt2"),
    # reordered norm h + Norm(f(h)): accepted with its own reading
    pytest.param("hf:olmo2", seq("self_attn", "mlp"), "model.embed_tokens", "model.norm", "reordered norm", id="olmo2"),
    # MoE: router softmax and expert gathers must still read as one MLP sublayer
    pytest.param("hf:mixtral", seq("self_attn", "mlp"), "model.embed_tokens", "model.norm", "prenorm", id="mixtral"),
    # parallel block, LayerNorm written out (mean subtraction, rsqrt)
    pytest.param("hf:cohere", par("self_attn", "mlp", "model.layers"), "model.embed_tokens", "model.norm", "parallel", id="cohere"),
    pytest.param("hf:gptj", par("attn", "mlp", "transformer.h"), "transformer.drop", "transformer.ln_f", "parallel", id="gptj"),
    # non-causal vision transformer: cls token concat + position embedding
    pytest.param("timm:vit_tiny_patch16_224", seq("attn", "mlp", "blocks"), "pos_drop", "norm", "prenorm", id="timm-vit"),
    pytest.param("nanogpt", seq("attn", "mlp", "transformer.h"), "transformer.drop", "transformer.ln_f", "prenorm", id="nanogpt"),
]


@pytest.mark.parametrize("name, expected, source_module, final_module, reading", ZOO)
def test_detect_chain_zoo(name, expected, source_module, final_module, reading):
    model, gm = zoo_graph(name)
    chain = detect_chain(gm)
    assert len(chain) == len(expected)
    for s, (kind, module) in zip(chain.sublayers, expected):
        assert s.kind == kind
        if isinstance(module, tuple):
            assert tuple(b.module for b in s.branches) == module
        else:
            assert s.branch_module == module
        assert s.reading == reading
        assert s.index == chain.sublayers.index(s)
    assert chain.source_module == source_module
    assert chain.final_norm.module == final_module
    hidden = next(p for p in model.parameters()).shape[-1] if name == "nanogpt" else None
    assert chain.hidden_size == (hidden or chain.hidden_size) > 0
    assert chain.ir == "export"
    # every pre-norm reads the stream value its sublayer starts from
    names = {n.name: n for n in gm.graph.nodes}
    for s in chain.sublayers:
        assert s.residual_add in names and s.input in names
        for b in s.branches:
            if reading != "reordered norm":
                assert b.pre_norm is not None and b.pre_norm.input == s.input
            else:
                assert b.pre_norm is None and b.post_norm is not None
            if reading == "sandwich":
                assert b.post_norm is not None and b.post_norm.output == b.output
            assert b.n_params > 0 and b.n_ops > 0
    assert chain.stream_nodes[0] == chain.source
    assert chain.final_norm.input == chain.sublayers[-1].residual_add


# More PreNorm architectures transformers ships, none of them named by the detection code.
MORE_HF = [
    "starcoder2", "granite", "phi3", "olmo", "qwen3_moe", "bloom", "gpt_bigcode", "persimmon", "mpt", "glm",
    "smollm3", "qwen2_moe", "olmoe", "helium", "nemotron", "ernie4_5", "arcee", "seed_oss", "gpt_oss", "glm4",
    "gemma3_text", "phimoe", "granitemoe", "jetmoe", "apertus", "llama4_text", "stablelm", "codegen", "cohere2",
]


@pytest.mark.parametrize("model_type", MORE_HF)
def test_detect_chain_more_hf(model_type):
    _, gm = zoo_graph(f"hf:{model_type}")
    chain = detect_chain(gm)
    if chain.sublayers[0].reading == "parallel":
        assert chain.kinds == ["attention+mlp"] * LAYERS
    else:
        assert chain.kinds == ["attention", "mlp"] * LAYERS
    assert len({s.residual_add for s in chain.sublayers}) == len(chain)


def test_bert_postnorm_is_refused():
    _, gm = zoo_graph("hf:bert")
    with pytest.raises(NotPreNormError) as ei:
        detect_chain(gm)
    e = ei.value
    nodes = {n.name for n in gm.graph.nodes}
    assert e.node in nodes and f"`{e.node}`" in str(e)
    assert "PostNorm" in str(e) and "bert.encoder.layer.0" in str(e)


def test_plain_mlp_has_no_chain():
    gm = capture(PlainMLP(), (torch.randn(2, 5, 32),))
    with pytest.raises(NoResidualChainError, match="no skip connection"):
        detect_chain(gm)


def test_blocks_without_norm_are_refused():
    gm = capture(NoNormResidual(), (torch.randint(0, 64, (2, 8)),))
    with pytest.raises(NotPreNormError) as ei:
        detect_chain(gm)
    msg = str(ei.value)
    assert f"`{ei.value.node}`" in msg and "blocks.0" in msg and "no norm in between" in msg
    assert ei.value.node in {n.name for n in gm.graph.nodes}


class Leaky(torch.nn.Module):
    """Two PreNorm sublayers whose middle stream value is also read outside the chain (``leak``): reduced to a
    probe tensor, or returned as it is."""

    def __init__(self, leak: str):
        super().__init__()
        self.leak = leak
        self.emb = torch.nn.Embedding(16, 8)
        self.ln = torch.nn.ModuleList([torch.nn.LayerNorm(8) for _ in range(3)])
        self.fc = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])

    def forward(self, idx):
        h = self.emb(idx)
        h = h + self.fc[0](self.ln[0](h))
        extra = h.sum(-1) if self.leak == "probe" else h
        h = h + self.fc[1](self.ln[1](h))
        return self.ln[2](h), extra


def test_stream_read_outside_the_chain_is_refused():
    gm = capture(Leaky("probe"), (torch.randint(0, 16, (2, 4)),))  # another node reads the stream raw
    with pytest.raises(NotPreNormError, match="also read by") as ei:
        detect_chain(gm)
    assert ei.value.node in {n.name for n in gm.graph.nodes}


def test_a_returned_stream_value_is_allowed_and_stays_the_residual_sum():
    """output_hidden_states=True: the output keeps reading h_k = h_0 + sum of sublayer outputs (equal at init)."""
    import depthrewrite as dr

    model = Leaky("return").eval()
    idx = torch.randint(0, 16, (2, 4))
    assert len(detect_chain(capture(model, (idx,))).sublayers) == 2
    conv = dr.convert(model, "attnres", inplace=False, example_inputs=(idx,))
    for got, want in zip(conv(idx), model(idx)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", ["nanogpt", "hf:llama", "hf:gemma2"])
def test_detect_chain_on_dynamo_graph(name):
    """The compile backend sees Dynamo graphs: torch-level ops, example_value, parameters as placeholders."""
    from ...conftest import build_zoo_model

    model = build_zoo_model(name)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    x = torch.randint(0, 64, (2, 8))
    torch.compile(model, backend=backend, dynamic=False)(x)
    assert len(graphs) == 1
    chain = detect_chain(graphs[0])
    assert chain.ir == "dynamo"
    assert chain.kinds == ["attention", "mlp"] * LAYERS
    export_chain = detect_chain(zoo_graph(name)[1])
    assert [s.branch_module for s in chain.sublayers] == [s.branch_module for s in export_chain.sublayers]
    assert chain.final_norm.module == export_chain.final_norm.module
