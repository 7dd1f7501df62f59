"""ChainReport: the table, networkx and DOT views, saving, and the marked graph listing."""

from __future__ import annotations

import builtins

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


def test_save_svg_with_graphviz_or_matplotlib(report, tmp_path):
    p = report.save(tmp_path / "chain.svg")
    assert p.read_text().lstrip().startswith(("<?xml", "<svg"))


@pytest.fixture
def no_graphviz(monkeypatch):
    """As on a fresh machine: no `dot` program (whatever this machine has)."""
    import depthrewrite.views.report as report_mod

    monkeypatch.setattr(report_mod, "graphviz_dot", lambda: None)


def _hide(monkeypatch, *modules):
    real_import = builtins.__import__

    def fake(name, *a, **k):
        if name.split(".")[0] in modules:
            raise ImportError(f"no {name}")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)


PNG = b"\x89PNG\r\n\x1a\n"


def test_save_png_without_graphviz_draws_with_matplotlib(report, tmp_path, no_graphviz):
    pytest.importorskip("matplotlib")
    p = report.save(tmp_path / "chain.png")
    assert p.read_bytes()[:8] == PNG and p.stat().st_size > 10_000
    assert report.save(tmp_path / "chain.svg").read_text().lstrip().startswith(("<?xml", "<svg"))


def test_save_png_without_pydot_draws_with_matplotlib(report, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    _hide(monkeypatch, "pydot")
    assert report.save(tmp_path / "chain.png").read_bytes()[:8] == PNG


def test_save_without_pydot_or_matplotlib_names_the_viz_extra(report, tmp_path, monkeypatch):
    _hide(monkeypatch, "pydot", "matplotlib")
    with pytest.raises(ConfigError, match=r"depthrewrite\[viz\]"):
        report.save(tmp_path / "chain.png")
    assert report.save(tmp_path / "chain.dot").exists()


def test_layout_puts_the_chain_top_to_bottom(report):
    from depthrewrite.views.render import layered_positions

    g = report.to_networkx()
    pos, keys = layered_positions(g)
    rows = [pos[f"h{i}"][0] for i in range(report.num_sublayers + 1)]
    assert rows == sorted(rows) and len(set(rows)) == len(rows)
    assert pos["final_norm"][0] > rows[-1]
    for i in range(report.num_sublayers):  # a norm sits beside the branch it feeds, between h_i and h_i+1
        norm, branch = pos[f"s{i}.0.norm"], pos[f"s{i}.0"]
        assert norm[0] == branch[0] and rows[i] < branch[0] < rows[i + 1] and norm[1] < branch[1]
    assert keys["h0"] == "source" and keys["s0.0"] == "branch:attention" and keys["s1.0"] == "branch:mlp"


@pytest.mark.parametrize("scheme, options", [("attnres", {"blocks": 2}), ("msar", {}), ("mhc", {})])
def test_converted_pictures_without_graphviz(scheme, options, tmp_path, no_graphviz):
    pytest.importorskip("matplotlib")
    from depthrewrite.views.draw import save_rewritten
    from depthrewrite.demo.zoo import hf_model

    converted = dr.convert(hf_model("llama", layers=2), scheme, **options)
    conv = converted.report()
    for p in (conv.save(tmp_path / "conversion.png"), save_rewritten(converted, tmp_path / "rewritten.png")):
        assert p.read_bytes()[:8] == PNG and p.stat().st_size > 10_000
    assert save_rewritten(converted, tmp_path / "rewritten.svg").read_text().lstrip().startswith(("<?xml", "<svg"))
    assert conv.save(tmp_path / "conversion.dot").read_text().startswith('digraph "converted"')


def test_convert_report_graph_shows_sites_and_what_they_read():
    from depthrewrite.demo.zoo import hf_model

    model = hf_model("llama", layers=2)
    full = dr.convert(model, "attnres", inplace=False).report().to_networkx()
    sites = [n for n, d in full.nodes(data=True) if d["role"] == "site"]
    assert sites == ["site:1", "site:2", "site:3", "site:output"]
    assert set(full.predecessors("site:3")) == {"source", "sub0", "sub1", "sub2"}
    assert full.has_edge("site:3", "sub3") and full.has_edge("site:output", "final_norm")
    block = dr.convert(model, "block-attnres", blocks=2, inplace=False).report().to_networkx()
    assert set(block.predecessors("site:3")) == {"source", "b1", "sub2"}  # emb, b1, partial b2
    assert set(block.predecessors("b1")) == {"sub0", "sub1"}
    mhc = dr.convert(model, "mhc", inplace=False).report().to_networkx()
    assert "x0, x1, x2, x3" in mhc.nodes["site:2"]["label"] and mhc.has_edge("sub1", "site:2")
    assert nx.is_directed_acyclic_graph(full) and nx.is_directed_acyclic_graph(block)


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
