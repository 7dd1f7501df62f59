"""CONTRIBUTING.md's promise, kept: a scheme is one record. A toy scheme defined in this file alone -- a fixed-weight
depth average -- registers itself and then works through convert, the report, the compile backend and pipeline
planning, without any other file changing. A scheme registered without a hook a stage needs gets a StageHookError
from that stage, naming it, and never another scheme's behaviour.

The toy: at each site j the stream value h_j is replaced by (mean of the sources v_0 .. v_j) x (their count), i.e.
their sum, which is h_j itself -- exact at init, like AttnRes with a zero query -- built from plain aten ops (no
custom op, no kernel, no parameters) with the chain editor's shared walk, ``rewrite_depth_mix``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.fx as fx

import depthrewrite as dr
import depthrewrite.pipeline as pipeline
from depthrewrite.passes.analyse.chain import Chain
from depthrewrite.passes.meta import depth_op_name
from depthrewrite.passes.result import PassResult
from depthrewrite.passes.rewrite.blocks import (
    DepthMixConfig,
    mix_site_anchor,
    mix_site_labels,
    rewrite_depth_mix,
    stored_sources_state,
)
from depthrewrite.passes.rewrite.editor import ChainEditor
from depthrewrite.passes.rewrite.registry import Scheme, SchemeVariant, StageHookError, register, unregister
from depthrewrite.testing import nanogpt

from .helpers import INIT_RTOL, rel_err

aten = torch.ops.aten


# -- the toy scheme: config, handler, record (what a new scheme's rewrite file holds) ----------------------------------
@dataclasses.dataclass(frozen=True)
class DepthAvgConfig(DepthMixConfig):
    """Fixed-weight depth average: h_j = count x mean(v_0 .. v_j). Takes DepthMixConfig's options (mix_scale="mean"
    drops the count: no longer exact at init)."""

    name = "depthavg"

    def describe(self, block_size: int | None = None) -> str:
        return f"Depth average (fixed weights), mix_scale={self.mix_scale!r}"


def _emit(ed: ChainEditor, name: str, sources: list[fx.Node], eps: float, scale: float) -> fx.Node:
    stacked = ed.graph.call_function(aten.stack.default, (sources, 0))
    mean = ed.graph.call_function(aten.mean.dim, (stacked, [0]))
    return ed.graph.call_function(aten.mul.Tensor, (mean, scale))  # the returned node is the site's mix


def _rewrite_depthavg(gm: fx.GraphModule, chain: Chain, config: DepthAvgConfig) -> PassResult:
    return rewrite_depth_mix(gm, chain, config, _emit)


def _record(name: str = "depthavg", config=DepthAvgConfig, **hooks) -> Scheme:
    return Scheme(
        name=name,
        title="DepthAvg",
        config=config,
        handler=_rewrite_depthavg,
        ops=(),  # aten ops only: nothing of its own to register or to fuse
        doc="tests/passes/rewrite/test_toy_scheme.py",
        variants=(SchemeVariant("depthavg", "Depth average", demo=False),),
        **hooks,
    )


HOOKS = dict(stage_anchor=mix_site_anchor, boundary_labels=mix_site_labels, state_at=stored_sources_state)


@pytest.fixture
def depthavg():
    record = register(_record(**HOOKS))
    try:
        yield record
    finally:
        unregister("depthavg")
        torch._dynamo.reset()


IDX = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))


def _model():
    torch.manual_seed(0)
    return nanogpt(n_layer=2, n_embd=32).eval()


def test_registered_everywhere_the_registry_is_read(depthavg):
    assert dr.schemes()["depthavg"] is depthavg and dr.scheme("DepthAvg") is depthavg
    assert dr.DepthAvgConfig is DepthAvgConfig  # depthrewrite's config exports read the registry
    from depthrewrite.cli import build_parser
    from depthrewrite.demo.train import VARIANTS

    assert VARIANTS["depthavg"].scheme == "depthavg" and VARIANTS["depthavg"].label == "Depth average"
    parser = build_parser()
    args = parser.parse_args(["convert", "nanogpt", "--scheme", "DepthAvg"])
    assert args.scheme == "depthavg"


def test_convert_is_exact_at_init_and_reported(depthavg):
    model = _model()
    conv = dr.convert(model, "depthavg", inplace=False).eval()
    with torch.no_grad():
        assert rel_err(conv(IDX), model(IDX)) <= INIT_RTOL
    report = conv.report()
    L = len(report.chain)
    assert type(report.config) is DepthAvgConfig and len(report.sites) == L  # sites 1..L-1 + output
    text = str(report)
    assert "Depth average (fixed weights)" in text
    assert repr(conv.graph_module()) == f"ConvertedGPT(scheme='depthavg', sites={L}, new_params=0)"
    assert "converted by depthrewrite: Depth average" in repr(conv)
    assert not any(depth_op_name(n) for n in conv.graph.nodes)  # aten ops only
    # a config instance works as well as the name
    assert type(dr.convert(model, DepthAvgConfig(mix_scale="mean"), inplace=False).report().config) is DepthAvgConfig


def test_compile_backend_recognises_it_without_ops_or_parameters(depthavg):
    conv = dr.convert(_model(), "depthavg").eval()
    compiled = torch.compile(conv, backend="depthrewrite", options={"inner": "aot_eager", "scheme": "depthavg"})
    torch.testing.assert_close(compiled(IDX), conv(IDX))
    graphs = dr.explain(compiled).graphs
    assert [g.kind for g in graphs] == ["converted"]
    torch._dynamo.reset()
    with pytest.raises(Exception, match="converted to depthavg, not attnres"):  # the wrong scheme is named
        torch.compile(conv, backend="depthrewrite", options={"inner": "eager", "scheme": "attnres"})(IDX)


def test_pipeline_planning_and_boundaries_through_its_hooks(depthavg):
    conv = dr.convert(_model(), "depthavg")
    L = len(conv.report().chain)
    cuts = pipeline.plan(conv, 2)
    assert len(cuts) == 1 and 1 <= cuts[0] < L
    pipeline.split(conv, 2)
    info = pipeline.boundary_info(conv)
    (b,) = info.boundaries
    j, d = cuts[0], conv.report().chain.hidden_size
    assert b.before == j and info.cuts == cuts
    # what crosses is named by the boundary_labels hook, and sized by the state_at hook: every source so far, (j+1)·d
    assert {t.label for t in b.tensors if t.kind == "depth"} == {"emb"} | {f"out{k}" for k in range(j)}
    assert b.formula == f"(j+1)·d = {j + 1}·{d}" and b.depth_bytes_per_token == b.formula_bytes_per_token


def test_a_missing_hook_is_a_clear_error_from_the_stage_that_needs_it():
    @dataclasses.dataclass(frozen=True)
    class HooklessConfig(DepthAvgConfig):
        name = "hookless"

    register(_record("hookless", HooklessConfig, boundary_labels=mix_site_labels))  # no stage_anchor, no state_at
    try:
        conv = dr.convert(_model(), "hookless")  # convert and report need no hook
        assert "sites" in str(conv.report())
        with pytest.raises(StageHookError, match="pipeline planning: scheme 'hookless' registers no 'stage_anchor' hook"):
            pipeline.plan(conv, 2)
        assert pipeline.plan(conv, 1) == ()  # one stage: no cut, no hook needed
    finally:
        unregister("hookless")


def test_register_refuses_names_the_registry_cannot_hold(depthavg):
    with pytest.raises(dr.ConfigError, match="already taken"):
        register(dataclasses.replace(_record("hookless2", type("C", (DepthAvgConfig,), {"name": "hookless2"}))))
    with pytest.raises(dr.ConfigError, match="is named"):
        register(_record("other", DepthAvgConfig))
    with pytest.raises(dr.ConfigError, match="no scheme named 'block-attnres'"):
        unregister("block-attnres")


def test_every_registered_scheme_has_its_doc_page_in_the_docs_nav():
    """CONTRIBUTING.md step 4: docs/<scheme>.md exists and mkdocs.yml lists it."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    nav = (root / "mkdocs.yml").read_text()
    for s in dr.schemes().values():
        assert s.doc.startswith("docs/") and (root / s.doc).is_file(), s.name
        assert f": {s.doc.removeprefix('docs/')}" in nav, f"{s.doc} is not in mkdocs.yml's nav"


def test_a_scheme_without_cached_decoding_refuses_a_filled_cache():
    """A record's ``no_cached_decoding`` reason: a call with a filled KV cache is a ConfigError naming it; prefill and
    uncached generation work."""
    from depthrewrite.demo.zoo import hf_model

    @dataclasses.dataclass(frozen=True)
    class NoCacheConfig(DepthAvgConfig):
        name = "nocache"

    register(_record("nocache", NoCacheConfig, no_cached_decoding="its mix reads earlier tokens", **HOOKS))
    try:
        conv = dr.convert(hf_model("llama", layers=2).eval(), "nocache")
        ids = IDX % 100
        kw = dict(max_new_tokens=2, do_sample=False, pad_token_id=0)
        with pytest.raises(dr.ConfigError, match="its mix reads earlier tokens"):
            conv.generate(ids, use_cache=True, **kw)
        assert conv.generate(ids, use_cache=False, **kw).shape == (2, ids.shape[1] + 2)
    finally:
        unregister("nocache")
