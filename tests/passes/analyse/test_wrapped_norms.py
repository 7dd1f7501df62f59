"""Norms written as OLMo-core writes them are norms: the gain cast to the activation's dtype
(``self.weight.type_as(x) * x``, a no-op cast at trace time) and the whole norm inside ``torch.autocast(enabled=False)``
or ``torch.no_grad()``, which torch.export records as a wrapper region (``wrap_with_autocast`` /
``wrap_with_set_grad_enabled``: one call node in the outer graph, the norm's math in a subgraph). Detection reads
through both, for PreNorm and for OLMo2's reordered norm, and every scheme converts exactly; a region it cannot read
as a norm is refused naming the region and why."""

from __future__ import annotations

import functools

import pytest
import torch

import depthrewrite as dr
from depthrewrite import NoResidualChainError, NotPreNormError, capture, detect_chain
from depthrewrite.passes.analyse.graph import Dataflow
from depthrewrite.passes.analyse.norms import find_norms
from depthrewrite.passes.analyse.ops import alias_of, wrapper_call

from ..rewrite.helpers import INIT_RTOL, rel_err
from .wrapped_norms import GAINS, REGIONS, WrappedNormLM

LAYERS = 2
IDS = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(0))
HOPS = {"autocast": "wrap_with_autocast", "no_grad": "wrap_with_set_grad_enabled", "nested": "wrap_with_set_grad_enabled"}


@functools.lru_cache(maxsize=None)
def _model(**kw) -> WrappedNormLM:
    torch.manual_seed(0)
    return WrappedNormLM(**kw).eval()


@functools.lru_cache(maxsize=None)
def _graph(**kw):
    return capture(_model(**kw), (IDS,))


def _weights(chain):
    return [
        (b.pre_norm or b.post_norm).weight for s in chain.sublayers for b in s.branches
    ]


EXPECTED_WEIGHTS = [f"blocks.{i}.{n}_norm.weight" for i in range(LAYERS) for n in ("attn", "mlp")]


@pytest.mark.parametrize("region", REGIONS)
def test_regions_are_recorded_as_wrapper_calls(region):
    """The premise: export leaves the region as one call of a wrapper op, the norm inside its subgraph."""
    gm = _graph(region=region)
    calls = [n for n in gm.graph.nodes if wrapper_call(n) is not None]
    if region is None:
        assert not calls
    else:
        assert {n.target.name() for n in calls} == {HOPS[region]}
        assert len(calls) == 2 * LAYERS + 1


#: (gain, region): every gain outside a region, every region with OLMo-core's gain, and the gain cast to the input
CASES = [(g, None) for g in GAINS] + [("type_as", r) for r in REGIONS[1:]] + [("type_as_input", "autocast")]


@pytest.mark.parametrize("gain, region", CASES)
def test_norms_are_found_with_their_gain(gain, region):
    gm = _graph(gain=gain, region=region)
    norms = find_norms(gm)
    assert [n.weight for n in norms] == EXPECTED_WEIGHTS + ["norm.weight"]
    assert [n.module for n in norms] == [w.rpartition(".")[0] for w in EXPECTED_WEIGHTS] + ["norm"]
    assert all(n.eps == pytest.approx(1e-6) for n in norms)
    df = Dataflow(gm)
    for n in norms:
        # the output is what the model reads: the branch's first linear, or the head
        assert {u.target for u in df.users(df.by_name[n.output])} == {torch.ops.aten.linear.default}
        assert n.readers and set(n.readers) <= set(n.nodes)
        if region is not None:  # the region's call reads the input; its getitem carries the output
            (call,) = n.readers
            assert wrapper_call(df.by_name[call]) is not None


@pytest.mark.parametrize("reordered", [False, True], ids=["prenorm", "reordered"])
@pytest.mark.parametrize("gain, region", CASES)
def test_chain_reads_through_casts_and_regions(gain, region, reordered):
    chain = detect_chain(_graph(gain=gain, region=region, reordered=reordered))
    assert chain.kinds == ["attention", "mlp"] * LAYERS
    assert {s.reading for s in chain.sublayers} == {"reordered norm" if reordered else "prenorm"}
    assert _weights(chain) == EXPECTED_WEIGHTS
    assert chain.final_norm.weight == "norm.weight"
    assert chain.source_module == "emb"


def test_region_output_that_is_its_input_is_an_alias():
    """OLMo-core's region returns its input's no-op ``x.float()`` too, and the residual add reads that: it is the
    stream value itself, so the add's skip operand is the stream."""
    gm = _graph(region="autocast")
    df = Dataflow(gm)
    emb = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.embedding.default)
    aliases = [n for n in gm.graph.nodes if alias_of(n) is emb]
    assert aliases and all(n.args[0] in emb.users for n in aliases)
    first_add = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor)
    assert df.canon(first_add.args[0]) is emb


EXACT = [
    pytest.param("attnres", {}, id="attnres"),
    pytest.param("attnres", {"blocks": 2}, id="attnres-block2"),
    pytest.param("msar", {}, id="msar"),
    pytest.param("mhc", {"alpha_init": 0.0}, id="mhc-alpha0"),
]


#: (model options, scheme, scheme options): every exact scheme on OLMo-core's norm (autocast region, cast gain) in
#: PreNorm and reordered blocks, and a cast gain alone / a no_grad region
CONVERT = [
    pytest.param(kw, scheme, options, id=f"{name}-{sid}")
    for name, kw, schemes in [
        ("autocast", dict(gain="type_as", region="autocast"), EXACT),
        ("autocast-reordered", dict(gain="type_as", region="autocast", reordered=True), EXACT),
        ("type_as-reordered", dict(gain="type_as", region=None, reordered=True), EXACT[:1] + EXACT[3:]),
        ("no_grad", dict(gain="type_as_input", region="no_grad"), EXACT[:1]),
    ]
    for (scheme, options), sid in ((p.values, p.id) for p in schemes)
]


@pytest.mark.parametrize("kw, scheme, options", CONVERT)
def test_convert_is_exact_at_init(kw, scheme, options):
    model = _model(**kw)
    conv = dr.convert(model, scheme, inplace=False, example_inputs=(IDS,), **options).eval()
    with torch.no_grad():
        assert rel_err(conv(IDS), model(IDS)) <= INIT_RTOL
    assert len(conv.report().chain) == 2 * LAYERS
    if kw["region"] is not None:  # the regions stay: the norm still runs with autocast off / without grad
        hop = HOPS[kw["region"]]
        assert sum(1 for n in conv.graph.nodes if getattr(n.target, "name", lambda: None)() == hop) == 2 * LAYERS + 1


def test_convert_trains_through_an_autocast_region():
    conv = dr.convert(_model(region="autocast"), "attnres", inplace=False, example_inputs=(IDS,), blocks=2).train()
    conv(IDS).square().mean().backward()
    grads = {n: p.grad for n, p in conv.named_parameters()}
    assert all(grads[w] is not None and grads[w].abs().sum() > 0 for w in EXPECTED_WEIGHTS + ["norm.weight"])
    assert any(g is not None and g.abs().sum() > 0 for n, g in grads.items() if n.startswith("depthrewrite."))


def test_region_that_reads_the_stream_for_more_than_its_norm_is_refused_naming_it():
    """A region that also computes something else from the stream value (here a statistic the model returns) would
    see a rewrite's new value there too: its norm is no pre-norm, and the refusal names the region and that."""
    with pytest.raises(NotPreNormError) as e:
        detect_chain(_graph(region="autocast", spy=True))
    msg = str(e.value)
    assert "`wrap_with_autocast` region" in msg
    assert "also computes something else from the norm's input" in msg


def test_block_inside_an_autocast_region_is_refused_naming_it():
    """A whole block under autocast: its residual adds are inside the region, where a rewrite cannot reach."""
    with pytest.raises(NoResidualChainError) as e:
        detect_chain(_graph(region=None, block_region=True))
    msg = str(e.value)
    assert "residual adds and" in msg and "wrapper region" in msg and "`wrap_with_autocast` region" in msg
