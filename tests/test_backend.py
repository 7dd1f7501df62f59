"""The ``depthrewrite`` torch.compile backend and ``explain()``.

One inductor compile (forward + backward, ~1 min on 2 cores) trains a converted model; every other test uses the
backend's ``aot_eager`` / ``eager`` inner compilers, which run the same passes without code generation.
"""

from __future__ import annotations

import functools
import logging
from importlib.metadata import entry_points

import pytest
import torch

import depthrewrite as dr
from depthrewrite.backend import BackendOptions, depthrewrite_backend, records_for
from depthrewrite.errors import ConfigError
from depthrewrite.demo.zoo import hf_model

IDS = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
#: every registered scheme at its defaults, and a block form with 2 blocks where the scheme has one
SCHEMES = {
    key: case
    for s in dr.schemes().values()
    for key, case in ([(s.name, (s.name, {}))] + ([(f"block-{s.name}", (s.name, dict(blocks=2)))] if s.block_form else []))
}


def _pair(scheme: str, options: dict, layers: int = 4, n: int = 2):
    """Two conversions of identically initialised models (conversions share the original's parameters, so a model
    trained through one must not be the other's original). New parameters are randomised so no site is trivial."""
    out = []
    for _ in range(n):
        torch.manual_seed(0)
        conv = dr.convert(hf_model("llama", layers=layers, hidden=32), scheme, **options)
        torch.manual_seed(1)
        with torch.no_grad():
            for name, p in conv.named_parameters():
                if name.startswith("depthrewrite.") and p.is_floating_point():
                    p.add_(0.3 * torch.randn_like(p))
        out.append(conv)
    return out


@functools.lru_cache(maxsize=None)
def _converted(scheme: str, options: tuple = (), layers: int = 4):
    """One conversion per (scheme, options), shared by the tests that do not train (see _pair)."""
    return _pair(scheme, dict(options), layers, n=1)[0]


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


pytestmark = pytest.mark.usefixtures("fresh_backend")  # tests/conftest.py: Dynamo reset, records cleared


def test_registered_by_name_and_entry_point():
    assert "depthrewrite" in torch._dynamo.list_backends(exclude_tags=())
    eps = {e.name: e.value for e in entry_points(group="torch_dynamo_backends")}
    assert eps.get("depthrewrite") == "depthrewrite.backend:depthrewrite_backend"
    assert torch._dynamo.lookup_backend("depthrewrite") is depthrewrite_backend


@pytest.mark.parametrize("name", list(SCHEMES))
def test_aot_graphs_match_eager_for_every_scheme(name):
    scheme, options = SCHEMES[name]
    conv = _converted(scheme, tuple(options.items()))
    conv.zero_grad()
    want = conv(IDS).logits
    want.square().mean().backward()
    g_want = _grads(conv)
    conv.zero_grad()
    compiled = torch.compile(conv, backend="depthrewrite", options={"inner": "aot_eager"})
    got = compiled(IDS).logits
    got.square().mean().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    g_got = _grads(conv)
    assert g_got.keys() == g_want.keys()
    for k in g_want:
        torch.testing.assert_close(g_got[k], g_want[k], rtol=1e-4, atol=1e-6, msg=k)
    exp = dr.explain(compiled)
    assert exp.compiled and len(exp.graphs) == 1 and exp.graphs[0].kind == "converted"
    g = exp.graphs[0]
    assert {a.stage for a in g.aot} == {"forward", "backward"}
    # on CPU no Triton kernel runs: every depth op reaches AOT autograd's graphs as the reference's aten ops
    assert set(g.decomposed) >= set(g.depth_ops) and not any(a.depth_ops for a in g.aot)
    assert "lowered to the reference's aten ops" in str(exp)


def test_two_phase_batches_block_attnres_sites():
    compiled = torch.compile(
        _converted("attnres", (("blocks", 2),)), backend="depthrewrite",
        options={"inner": "aot_eager", "two_phase": "always", "decompose": False},  # the ops as nodes, to count them
    )
    compiled(IDS)
    g = dr.explain(compiled).graphs[0]
    assert g.depth_ops["depth_attn"] == 8  # 8 sites before the pass
    # 4 sublayers per block (2 layers x attention + MLP): sites 1-4 share [embedding], 5-8 (incl. the output site)
    # share [embedding, block 1 summary]
    assert [len(t.sites) for t in g.two_phase] == [4, 4]
    assert [len(t.prefix) for t in g.two_phase] == [1, 2]
    fw = next(a for a in g.aot if a.stage == "forward")
    assert fw.depth_ops["depth_attn_partial"] == 2 and fw.depth_ops["depth_attn_merge"] == 8
    assert "depth_attn" not in fw.depth_ops


def test_two_phase_cost_model():
    """Two-phase writes an fp32 partial mix per site: it pays only from n > 8S / (e (S-1)) completed sources."""
    from depthrewrite.passes.lower import TwoPhaseGroup

    def group(n, S, e, d=64):
        return TwoPhaseGroup(tuple(f"s{i}" for i in range(n)), tuple(f"q{i}" for i in range(S)), 1e-6, e, d)

    assert not group(4, 8, 2).worth_it and group(5, 8, 2).worth_it  # bf16, S = 8: from 5 summaries
    assert group(5, 8, 2).bytes_saved == 64 * (5 * 2 * 7 - 64)
    assert not group(2, 4, 4).worth_it and group(3, 4, 4).worth_it  # fp32, S = 4: from 3
    assert group(3, 4, 4).extra_saved_for_backward == 4 * (4 * 64 + 4)
    # the tiny fp32 test model has 1 and 2 completed sources per block: both groups are declined by default
    compiled = torch.compile(_converted("attnres", (("blocks", 2),)), backend="depthrewrite", options={"inner": "aot_eager"})
    compiled(IDS)
    g = dr.explain(compiled).graphs[0]
    assert not g.two_phase and [len(t.prefix) for t in g.two_phase_declined] == [1, 2]
    assert "two-phase declined" in str(dr.explain(compiled))


def test_two_phase_can_be_switched_off_and_full_attnres_is_left_alone():
    comp = _converted("attnres", (("blocks", 2),))
    compiled = torch.compile(comp, backend="depthrewrite", options={"inner": "aot_eager", "two_phase": False})
    compiled(IDS)
    g = dr.explain(compiled).graphs[0]
    assert not g.two_phase and not g.two_phase_declined and g.two_phase_skipped == "two_phase=False"
    torch._dynamo.reset()
    full = _converted("attnres")
    compiled = torch.compile(full, backend="depthrewrite", options={"inner": "aot_eager"})
    compiled(IDS)
    g = dr.explain(compiled).graphs[0]
    assert not g.two_phase and not g.two_phase_declined  # every Full site has its own prefix


def test_unconverted_model_logs_its_chain_and_compiles(caplog):
    torch.manual_seed(0)
    model = hf_model("llama", layers=2, hidden=32)
    want = model(IDS).logits
    with caplog.at_level(logging.INFO, logger="depthrewrite.backend"):
        got = torch.compile(model, backend="depthrewrite", options={"inner": "eager"})(IDS).logits
    torch.testing.assert_close(got, want)
    assert "PreNorm chain" in caplog.text and "model.layers.1.mlp" in caplog.text
    g = records_for(model)[0]
    assert g.kind == "unconverted" and len(g.chain_report.chain.sublayers) == 4


def test_a_scheme_for_an_unconverted_model_points_to_convert():
    model = hf_model("llama", layers=2, hidden=32)
    with pytest.raises(Exception, match=r"not converted.*depthrewrite\.convert\(model, 'msar'\)"):
        torch.compile(model, backend="depthrewrite", options={"scheme": "msar"})(IDS)


def test_a_scheme_option_lets_fragments_without_a_chain_through():
    """A graph break after the model gives a second graph (the loss) with no chain: it compiles as it is."""
    conv = _converted("mhc")

    def step(ids):
        logits = conv(ids).logits
        torch._dynamo.graph_break()
        return logits.float().square().mean()

    compiled = torch.compile(step, backend="depthrewrite", options={"scheme": "mhc", "inner": "eager"})
    torch.testing.assert_close(compiled(IDS), step(IDS))
    assert [g.kind for g in records_for(conv)] == ["converted"]


def test_a_wrong_scheme_for_a_converted_model_is_refused():
    comp = _converted("mhc")
    with pytest.raises(Exception, match="converted to mhc, not attnres"):
        torch.compile(comp, backend="depthrewrite", options={"scheme": "attnres", "inner": "eager"})(IDS)


def test_bad_options_are_config_errors():
    with pytest.raises(ConfigError, match="unknown option"):
        BackendOptions.from_dict({"fuse_everything": True})
    with pytest.raises(ConfigError, match="inner="):
        BackendOptions.from_dict({"inner": "tvm"})
    with pytest.raises(ConfigError, match="decompose='yes' is not True or False"):
        BackendOptions.from_dict({"decompose": "yes"})
    with pytest.raises(ConfigError, match="scheme='resnet' is not one of .*'moda'"):
        BackendOptions.from_dict({"scheme": "resnet"})


def test_the_scheme_option_takes_any_registered_name_not_an_alias():
    assert [BackendOptions.from_dict({"scheme": s}).scheme for s in dr.schemes()] == list(dr.schemes())
    assert BackendOptions.from_dict({"scheme": "AttnRes"}).scheme == "attnres"
    with pytest.raises(ConfigError, match="is not one of"):  # an alias presets options (blocks=4) the check cannot see
        BackendOptions.from_dict({"scheme": "block-attnres"})


def test_explain_a_converted_model_before_compiling():
    comp = _converted("attnres", (("blocks", 2),))
    text = str(dr.explain(comp))
    assert "not compiled" in text and "depth_attn ×8" in text and "two-phase would leave as single passes" in text
    assert "depth_attn" in dr.explain(comp).kernels()


def test_explain_runs_the_model_and_counts_graph_breaks():
    compiled = torch.compile(_converted("mhc"), backend="depthrewrite", options={"inner": "eager"})
    exp = dr.explain(compiled, IDS)  # runs the model (compiled lazily) without resetting Dynamo
    assert exp.graph_breaks is None and len(exp.graphs) == 1
    exp = dr.explain(compiled, IDS, graph_breaks=True)
    assert exp.graph_breaks == 0
    d = exp.to_dict()
    assert d["graphs"][0]["depth_ops"]["mhc_coeffs"] == 8 and d["kernels"]


def test_explain_of_a_plain_module_says_what_to_do():
    assert "depthrewrite.convert" in str(dr.explain(torch.nn.Linear(2, 2)))
    with pytest.raises(ConfigError, match="takes a module"):
        dr.explain(torch.compile(lambda x: x + 1))


def test_inductor_trains_a_converted_model_like_eager():
    """The one real compile: AOT autograd + inductor (C++ on CPU), three SGD steps of Block AttnRes."""
    from torch._dynamo.utils import counters

    bypassed = counters["inductor"]["fxgraph_cache_bypass"]
    eager, comp = _pair("attnres", dict(blocks=2))
    compiled = torch.compile(comp, backend="depthrewrite", options={"two_phase": "always"})
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, comp)]
    for step in range(3):
        losses = []
        for m, opt in zip((eager, compiled), opts):
            opt.zero_grad()
            logits = m(IDS).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), IDS[:, 1:].flatten())
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-5, msg=f"step {step}")
    exp = dr.explain(compiled)
    assert exp.graphs[0].inner == "inductor"
    # the depth ops were lowered: AOT autograd traced both directions (its cache is off for such a graph), and
    # inductor could key its FX graph cache (the decomposition table pickles by name)
    assert {a.stage for a in exp.graphs[0].aot} >= {"forward", "backward"}
    assert counters["inductor"]["fxgraph_cache_bypass"] == bypassed
    assert exp.graphs[0].two_phase


def test_the_decomposition_table_keys_inductors_cache_by_its_ops():
    """Inductor pickles ``compile_fx``'s decomposition table into its FX graph cache key; torch's own table holds an
    entry pickle cannot name, so the depth table is named by its ops (a bypass recompiled every converted graph)."""
    from torch._inductor.codecache import FxGraphCachePickler

    from depthrewrite.backend import _InductorTable, _inductor_table
    from depthrewrite.kernels.decompose import decompositions

    gm = torch.fx.symbolic_trace(torch.nn.Identity())
    a, b = _InductorTable(decompositions()), _InductorTable(decompositions())
    assert FxGraphCachePickler(gm).get_key(a) == FxGraphCachePickler(gm).get_key(b)
    fewer = _InductorTable({op: fn for op, fn in decompositions().items() if "msar" in op.name()})
    assert FxGraphCachePickler(gm).get_key(fewer) != FxGraphCachePickler(gm).get_key(a)
    assert set(_inductor_table(fewer.names)) == set(fewer)


def test_fullgraph_on_the_whole_converted_model_says_to_compile_per_block():
    """The call-structure choice runs outside Dynamo (a graph break), so fullgraph=True on the whole converted model
    cannot hold: Dynamo's error carries depthrewrite's reason, naming per-block compilation, beside its own hint
    (which alone said only 'Remove the torch.compiler.disable call')."""
    import inspect

    if "reason" not in inspect.signature(torch._dynamo.disable).parameters:
        pytest.skip("this torch's torch._dynamo.disable takes no reason")
    conv, ids = _converted("attnres", layers=2), torch.randint(3, 100, (1, 8))
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"depthrewrite: .*fullgraph=True.*Compile per block"):
        torch.compile(conv, fullgraph=True, backend="depthrewrite")(ids)
