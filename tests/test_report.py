"""ChainReport: the table, networkx and DOT views, saving, and the marked graph listing."""

from __future__ import annotations

import builtins
import shutil

import networkx as nx
import pytest

import depthrewrite as dr
from depthrewrite.errors import ConfigError

from .conftest import LAYERS, zoo_graph


@pytest.fixture(scope="module")
def report():
    model, gm = zoo_graph("hf:gemma2")
    return dr.ChainReport(model_class=type(model).__name__, chain=dr.detect_chain(gm), graph=gm)


def test_str_has_header_and_one_row_per_sublayer(report):
    text = str(report)
    lines = text.splitlines()
    assert lines[0].startswith(f"Gemma2ForCausalLM: {2 * LAYERS} sublayers (2 attention, 2 mlp), hidden size 64")
    assert "stream source:" in lines[1] and "model.embed_tokens" in lines[1]
    assert "model.norm" in lines[2]
    assert "post-norm" in text and "sandwich" in text
    for i in range(LAYERS):
        assert f"model.layers.{i}.self_attn" in text and f"model.layers.{i}.mlp" in text
    assert repr(report).startswith("ChainReport(Gemma2ForCausalLM, sublayers=4")


def test_to_dict(report):
    d = report.to_dict()
    assert d["model_class"] == "Gemma2ForCausalLM"
    assert [r["kind"] for r in d["sublayers"]] == ["attention", "mlp"] * LAYERS
    assert d["final_norm"]["module"] == "model.norm"


def test_to_networkx_is_the_chain(report):
    g = report.to_networkx()
    L = report.num_sublayers
    path = nx.shortest_path(g, "h0", "final_norm")
    # the skip edges give a path through every stream node
    assert path == [f"h{i}" for i in range(L + 1)] + ["final_norm"]
    roles = nx.get_node_attributes(g, "role")
    assert sum(r == "branch" for r in roles.values()) == L
    assert sum(r == "post_norm" for r in roles.values()) == L
    assert nx.is_directed_acyclic_graph(g)


def test_to_dot_and_save_dot(report, tmp_path):
    dot = report.to_dot()
    assert dot.startswith('digraph "Gemma2ForCausalLM"') and '"h0" -> "h1"' in dot
    p = report.save(tmp_path / "chain.dot")
    assert p.read_text() == dot


def test_save_svg_or_clear_message(report, tmp_path):
    if shutil.which("dot") is None:
        with pytest.raises(ConfigError, match="Graphviz"):
            report.save(tmp_path / "chain.svg")
    else:
        pytest.importorskip("pydot")
        p = report.save(tmp_path / "chain.svg")
        assert p.read_text().lstrip().startswith(("<?xml", "<svg"))


def test_save_without_pydot_names_the_viz_extra(report, tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_pydot(name, *a, **k):
        if name == "pydot":
            raise ImportError("no pydot")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_pydot)
    with pytest.raises(ConfigError, match=r"depthrewrite\[viz\]"):
        report.save(tmp_path / "chain.png")


def test_save_unknown_suffix(report, tmp_path):
    with pytest.raises(ConfigError, match="pdf"):
        report.save(tmp_path / "chain.pdf")


def test_graph_text_marks_chain_nodes(report):
    text = report.graph_text()
    assert "<< stream source" in text and "<< final norm" in text
    for i in range(report.num_sublayers):
        assert f"<< residual add {i}" in text and f"<< pre-norm {i}" in text
    only = report.graph_text(only_chain=True).splitlines()
    assert all("<<" in line for line in only)
    assert len(only) < len(text.splitlines())


def test_inspect_returns_report():
    from depthrewrite.testing import nanogpt

    r = dr.inspect(nanogpt(n_layer=1))
    assert r.num_sublayers == 2 and r.model_class == "GPT"
