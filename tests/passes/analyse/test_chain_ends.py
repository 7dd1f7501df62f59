"""Chains whose stream is reshaped between sublayers (OPT) or pooled before the final norm (timm
``global_pool="avg"``), and refusals that name what sits between the residual chain and the final norm."""

from __future__ import annotations

import re

import pytest
import torch

from depthrewrite import NotPreNormError, capture, detect_chain
from depthrewrite.passes.analyse.ops import op_of
from depthrewrite.demo.zoo import timm_model

from ...conftest import LAYERS, zoo_graph
from .nanochat_like import NanoChatLike


def _graph(**kw):
    torch.manual_seed(0)
    return capture(NanoChatLike(**kw), (torch.randint(0, 64, (2, 8)),))


def test_nanochat_like_without_extras_is_a_chain():
    assert detect_chain(_graph()).kinds == ["attention", "mlp"] * 2


@pytest.mark.parametrize(
    "kw, op, what",
    [
        # x = x - backout_lambda * x_mid before the final norm
        (dict(backout=True), "sub", "a subtraction of an earlier stream value (`mul`, computed from the residual sum `add_1` (in h.0))"),
        (dict(backout=True, scaling="start"), "sub", "a subtraction of an earlier stream value"),
        # x = resid_lambdas[-1] * x before the final norm
        (dict(scaling="end"), "mul", "a scaling of the stream by `resid_lambdas`"),
    ],
    ids=["backout", "backout-and-x0-scaling", "final-scaling"],
)
def test_op_before_the_final_norm_is_named(kw, op, what):
    gm = _graph(**kw)
    with pytest.raises(NotPreNormError) as ei:
        detect_chain(gm)
    msg, node = str(ei.value), ei.value.node
    nodes = {n.name: n for n in gm.graph.nodes}
    assert node in nodes and op_of(nodes[node]) == op
    assert msg.startswith("the final norm (`rms_norm_5`) does not read the residual stream: between the last residual add `add_")
    assert f"it sits `{node}`, {what}" in msg
    assert "expects the last residual sum to reach the final norm unchanged" in msg
    assert "output_hidden_states" not in msg  # the old text blamed intermediate outputs


def test_stream_rescaled_between_blocks_is_named():
    """nanochat's x = resid_lambdas[i] * x + x0_lambdas[i] * x0 at each block's start: the chain found from the final
    norm would cover the last block only; refused, naming the scaling."""
    gm = _graph(scaling="start")
    with pytest.raises(NotPreNormError) as ei:
        detect_chain(gm)
    msg, node = str(ei.value), ei.value.node
    nodes = {n.name: n for n in gm.graph.nodes}
    assert op_of(nodes[node]) == "mul"
    assert "the residual chain is interrupted between sublayers: the residual sum `add_2` (in h.0)" in msg
    assert f"only through `{node}`, a scaling of the stream by `resid_lambdas`" in msg


def test_pooled_vit_chain_ends_at_fc_norm():
    torch.manual_seed(0)
    gm = capture(timm_model("vit_tiny_patch16_224", layers=LAYERS, global_pool="avg", fc_norm=True))
    chain = detect_chain(gm)
    assert chain.kinds == ["attention", "mlp"] * LAYERS
    assert chain.final_norm.module == "fc_norm"
    nodes = {n.name: n for n in gm.graph.nodes}
    tail = [nodes[n] for n in chain.path(len(chain))]
    assert [op_of(n) for n in tail] == ["slice", "slice", "mean"]
    assert tail[0].args[0].name == chain.sublayers[-1].residual_add and chain.final_norm.input == tail[-1].name
    assert any(n.startswith("pooled output: the final norm reads a mean over tokens (`mean`, after slicing") for n in chain.notes)


def test_opt_reshaped_stream_is_followed():
    """OPT flattens the stream to [B·T, D] around each MLP and views it back: the reshapes are followed."""
    _, gm = zoo_graph("hf:opt")
    chain = detect_chain(gm)
    assert chain.kinds == ["attention", "mlp"] * LAYERS
    # OPT's fc1/fc2 live in the decoder layer itself
    assert [s.branch_module for s in chain.sublayers] == [
        f"model.decoder.layers.{i}{m}" for i in range(LAYERS) for m in (".self_attn", "")
    ]
    assert chain.final_norm.module == "model.decoder.final_layer_norm"
    nodes = {n.name: n for n in gm.graph.nodes}
    for j in range(1, len(chain) + 1):
        path = chain.path(j)
        assert len(path) == 1 and op_of(nodes[path[0]]) == "view"
        assert nodes[path[0]].args[0].name == chain.sublayers[j - 1].residual_add
        read = chain.sublayers[j].input if j < len(chain) else chain.final_norm.input
        assert read == path[0]
    assert any(n.startswith("the stream is reshaped between sublayers") for n in chain.notes)


class Transposed(torch.nn.Module):
    """A stream whose elements are permuted between sublayers (h.transpose(1, 2) and back through a reshape): not a
    shape-only change, so not followed."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.ln = torch.nn.ModuleList([torch.nn.LayerNorm(8) for _ in range(3)])
        self.fc = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])

    def forward(self, idx):
        h = self.emb(idx)
        h = h + self.fc[0](self.ln[0](h))
        h = h.view(2, 8, 4).transpose(1, 2).reshape(2, 4, 8)
        h = h + self.fc[1](self.ln[1](h))
        return self.ln[2](h)


def test_element_permuting_reshape_is_not_followed():
    gm = capture(Transposed(), (torch.randint(0, 16, (2, 4)),))
    chain = detect_chain(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    # the transpose is no part of the chain: it starts after it, and no path goes through it
    assert len(chain) == 1 and op_of(nodes[chain.source]) == "view"
    assert all(op_of(nodes[n]) != "view" or "transpose" not in n for p in chain.paths for n in p)


def test_token_pooled_vit_notes_the_selection():
    torch.manual_seed(0)
    chain = detect_chain(capture(timm_model("vit_tiny_patch16_224", layers=LAYERS, global_pool="token", fc_norm=True)))
    assert chain.final_norm.module == "fc_norm"
    assert any(n.startswith("token output: the final norm reads selected tokens") for n in chain.notes)


def test_max_pooled_vit_is_refused_naming_the_pool():
    torch.manual_seed(0)
    gm = capture(timm_model("vit_tiny_patch16_224", layers=LAYERS, global_pool="max", fc_norm=True))
    with pytest.raises(NotPreNormError) as ei:
        detect_chain(gm)
    msg = str(ei.value)
    assert ei.value.node == "amax"
    assert msg.startswith("the final norm (fc_norm) does not read the residual stream: between the last residual add `add_4` (in blocks.1)")
    assert "it sits `amax`, a reduction over the token dimension (`amax.default`, max pooling)" in msg


@pytest.mark.parametrize("name", ["hf:opt", "pooled-vit"])
def test_paths_on_dynamo_graphs(name):
    """The compile backend sees torch-level reshapes (x.view, x.reshape) and indexing (x[:, 1:]): followed too."""
    from ...conftest import build_zoo_model

    if name == "pooled-vit":
        model, x = timm_model("vit_tiny_patch16_224", layers=LAYERS, global_pool="avg", fc_norm=True), torch.randn(1, 3, 224, 224)
    else:
        model, x = build_zoo_model(name), torch.randint(0, 64, (2, 8))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, dynamic=False)(x)
    chain = detect_chain(graphs[0])
    assert chain.ir == "dynamo" and chain.kinds == ["attention", "mlp"] * LAYERS
    if name == "hf:opt":
        assert all(len(chain.path(j)) == 1 for j in range(1, len(chain) + 1))
    else:
        assert chain.final_norm.module == "fc_norm" and len(chain.path(len(chain))) == 2
        assert any(n.startswith("pooled output") for n in chain.notes)


class SubtractsEmbedding(torch.nn.Module):
    """One sublayer, then h - 0.5·h0 before the final norm: no chain is found at all, and the refusal still names the
    subtraction."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.ln = torch.nn.LayerNorm(8)
        self.fc = torch.nn.Linear(8, 8)
        self.out = torch.nn.LayerNorm(8)

    def forward(self, idx):
        h0 = self.emb(idx)
        h = h0 + self.fc(self.ln(h0))
        return self.out(h - 0.5 * h0)


def test_subtraction_of_the_embedding_is_named_without_a_chain():
    gm = capture(SubtractsEmbedding(), (torch.randint(0, 16, (2, 4)),))
    with pytest.raises(NotPreNormError) as ei:
        detect_chain(gm)
    assert ei.value.node == "sub"
    assert str(ei.value).startswith(
        "the final norm (out) does not read the residual stream: between the last residual add `add` and it sits "
        "`sub`, a subtraction of an earlier stream value (`mul`, computed from the stream value `embedding` (in emb))."
    )


class Tail(torch.nn.Module):
    """Two PreNorm sublayers, then ``tail`` between the last residual add and the final norm."""

    def __init__(self, tail: str):
        super().__init__()
        self.tail = tail
        self.emb = torch.nn.Embedding(16, 8)
        self.ln = torch.nn.ModuleList([torch.nn.LayerNorm(8) for _ in range(2)])
        self.fc = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])
        self.out = torch.nn.LayerNorm(8)

    def forward(self, idx):
        h = h0 = self.emb(idx)
        for ln, fc in zip(self.ln, self.fc):
            h = h + fc(ln(h))
        t = self.tail
        if t == "batch-mean":
            h = h.mean(0)
        elif t == "batch-slice":
            h = h[:1]
        elif t == "batch-select":
            h = h[0]
        elif t == "flat-batch-mean":  # [B·T, D]: a rank-2 stream has no token dims
            h = h.flatten(0, 1).mean(0)
        elif t == "last-token":
            h = h[:, -1]
        elif t == "token-mean":
            h = h.mean(1)
        elif t in ("masked-mean", "padding-mask"):
            m = (idx != 0).float()[..., None]
            h = (h * m).sum(1) / m.sum(1) if t == "masked-mean" else h * m
        elif t == "gate":
            h = h * torch.sigmoid(h0[..., :1])
        return self.out(h)


def _tail(tail: str):
    torch.manual_seed(0)
    return capture(Tail(tail), (torch.randint(1, 16, (2, 6)),))


@pytest.mark.parametrize(
    "tail, op, what",
    [
        ("batch-mean", "mean", "a mean over dim 0 (batch) of the [s, s, 8] stream, which mixes the examples of a batch."),
        ("batch-slice", "slice", "a slice of dim 0 (batch) of the [s, s, 8] stream."),
        ("batch-select", "select", "an index of dim 0 (batch) of the [s, s, 8] stream."),
        ("flat-batch-mean", "mean", "a mean over dim 0 (batch; a rank-2 stream has no token dims) of the [s*s, 8] stream"),
    ],
)
def test_batch_dim_is_no_token_dim(tail, op, what):
    """Only the dims between the batch dim and the hidden dim are token dims: a mean or slice over dim 0 is not
    followed (it was reported as "a mean over tokens"), and the refusal says which dim it is."""
    gm = _tail(tail)
    with pytest.raises(NotPreNormError) as ei:
        detect_chain(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    assert op_of(nodes[ei.value.node]) == op
    msg = re.sub(r"\bs\d+\b", "s", str(ei.value))  # symbolic size names depend on the capture
    assert msg.startswith("the final norm (out) does not read the residual stream: between the last residual add `add_1`")
    assert f"it sits `{ei.value.node}`, {what}" in msg
    assert "remove that op or move it after the final norm before converting." in msg


@pytest.mark.parametrize(
    "tail, note", [("last-token", "token output: the final norm reads selected tokens"), ("token-mean", "pooled output: the final norm reads a mean over tokens (`mean`)")]
)
def test_token_dims_are_still_followed(tail, note):
    chain = detect_chain(_tail(tail))
    assert chain.kinds == ["mlp", "mlp"] and chain.final_norm.module == "out"
    assert any(n.startswith(note) for n in chain.notes)


def test_masked_mean_pooling_names_the_mask():
    gm = _tail("masked-mean")
    with pytest.raises(NotPreNormError) as ei:
        detect_chain(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    assert op_of(nodes[ei.value.node]) == "mul"
    msg = str(ei.value)
    assert f"it sits `{ei.value.node}`, a multiplication of the stream by a mask computed from the inputs (`unsqueeze`), e.g. masked pooling. " in msg
    assert msg.endswith(
        "mean-pooled over tokens; a plain mean over tokens (no mask) is followed: pool after the final norm instead "
        "(normalise every token, then take the masked mean), or pool without the mask, before converting."
    )
    assert "a gate" not in msg


def test_padding_mask_without_pooling_keeps_the_plain_advice():
    msg = str(pytest.raises(NotPreNormError, detect_chain, _tail("padding-mask")).value)
    assert "a multiplication of the stream by a mask computed from the inputs (`unsqueeze`), e.g. a padding mask. " in msg
    assert msg.endswith("remove that op or move it after the final norm before converting.")


def test_gate_computed_from_the_stream_is_no_mask():
    msg = str(pytest.raises(NotPreNormError, detect_chain, _tail("gate")).value)
    assert "a multiplication of the stream by another activation (`sigmoid`, computed from the stream value `embedding` (in emb), a gate)" in msg
    assert "mask" not in msg


@pytest.mark.parametrize("tail", ["batch-select", "last-token"])
def test_dynamo_indexing_of_the_batch_dim(tail):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.manual_seed(0)
    torch.compile(Tail(tail), backend=backend, dynamic=False)(torch.randint(1, 16, (2, 6)))
    if tail == "last-token":
        assert any(n.startswith("token output") for n in detect_chain(graphs[0]).notes)
    else:
        msg = str(pytest.raises(NotPreNormError, detect_chain, graphs[0]).value)
        assert "an index of dim 0 (batch) of the [2, 6, 8] stream." in msg
