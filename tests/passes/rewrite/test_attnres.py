"""convert(model, "attnres"): the paper-literal scale, an independent reference, block/source bookkeeping, errors.
Init equivalence on the zoo and the converted-model contract are in test_contract.py (shared by every scheme)."""

from __future__ import annotations

import pytest
import torch

import depthrewrite as dr
from depthrewrite import AttnResConfig, ConfigError, DepthRewriteError, NotPreNormError
from depthrewrite.passes.rewrite.attnres import sources_at
from depthrewrite.testing import NoNormResidual, nanogpt

from ...conftest import build_zoo_model
from .helpers import assert_matches_reference, inputs_for as _inputs, logits as _logits, rel_err as _rel
from .reference_models import Decoder

def test_mean_scale_is_paper_literal_and_close_only_up_to_eps():
    model = build_zoo_model("hf:llama").eval()
    conv = dr.convert(model, "attnres", mix_scale="mean", inplace=False).eval()
    x = _inputs("hf:llama", model)
    with torch.no_grad():
        err = _rel(_logits(conv(*x)), _logits(model(*x)))
    assert 0 < err < 0.2  # the ε shift of spec §5: visible, bounded


def _randomise(conv, ref, seed=1):
    g = torch.Generator().manual_seed(seed)
    box = conv.depthrewrite
    for j, mix in ref.mixes.items():
        site = getattr(box, f"mix_{j}")
        for name in ("query", "gain"):
            v = torch.randn(getattr(mix, name).shape, generator=g) * (1.0 if name == "query" else 0.3) + (0 if name == "query" else 1)
            getattr(mix, name).data.copy_(v)
            getattr(site, name).data.copy_(v)


@pytest.mark.parametrize("S", [1, 2, 4, 6], ids=lambda s: f"S{s}")  # S=1 Full, S=4 last block shorter, S=L one block
@pytest.mark.parametrize("count", [True, False], ids=["count", "mean"])
def test_independent_reference(S, count):
    torch.manual_seed(0)
    vanilla = Decoder(layers=3)
    ref = Decoder(layers=3, use_attnres=True, block_size=S, count=count)
    ref.load_state_dict(vanilla.state_dict(), strict=False)
    idx = torch.randint(0, 64, (2, 7))
    conv = dr.convert(vanilla, "attnres", block_size=S, mix_scale="count" if count else "mean", example_inputs=(idx,), inplace=False)
    _randomise(conv, ref)
    assert_matches_reference(ref, conv, idx, lambda n: "depthrewrite.mix_" + n[len("mixes."):] if n.startswith("mixes.") else n)


def test_block_size_one_equals_full():
    model = build_zoo_model("hf:qwen2")
    full = dr.convert(model, "attnres", inplace=False)
    s1 = dr.convert(model, AttnResConfig(block_size=1), inplace=False)
    s1.load_state_dict(full.state_dict())
    for p in full.depthrewrite.parameters():
        p.data.normal_()
    s1.load_state_dict(full.state_dict())
    x = _inputs("hf:qwen2", model)
    torch.testing.assert_close(_logits(s1(*x)), _logits(full(*x)))


@pytest.mark.parametrize("S", [1, 2, 3])
def test_source_counts_follow_the_spec_and_never_repeat(S):
    model = nanogpt(n_layer=3)  # L = 6
    rep = dr.convert(model, "attnres", block_size=S, inplace=False).report()
    L = len(rep.chain)
    for site in rep.sites:
        j = L if site.site == "output" else site.site
        assert len(site.sources) == sources_at(j, S)
        assert len(set(site.sources)) == len(site.sources)
    assert rep.stored_sources == (L + 1 if S == 1 else -(-L // S) + 1)


def test_blocks_vs_block_size_precedence_and_report():
    model = nanogpt(n_layer=3)
    rep = dr.convert(model, "attnres", blocks=4, block_size=3, inplace=False).report()  # block_size wins
    assert rep.block_size == 3
    rep4 = dr.convert(model, "attnres", blocks=4, inplace=False).report()  # L=6, N=4 -> S=2, N_eff=3
    assert rep4.block_size == 2 and rep4.stored_sources == 4
    text = str(rep4)
    assert "Block AttnRes (S=2" in text and "new parameters:" in text and "bytes" in text
    assert rep4.memory_per_token == 4 * 64 * 4
    assert rep4.new_params == sum(s.params for s in rep4.sites) == 2 * 64 * len(rep4.sites)


# ---------------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(scheme="nope"), "unknown scheme"),
        (dict(blocks=0), "blocks must be an integer >= 1"),
        (dict(blocks=99), "larger than the model's 4 sublayers"),
        (dict(block_size=-1), "block_size must be"),
        (dict(mix_scale="max"), "mix_scale"),
        (dict(bogus=1), "no option"),
    ],
)
def test_config_errors(kwargs, match):
    model = nanogpt(n_layer=2)
    with pytest.raises(ConfigError, match=match):
        dr.convert(model, **kwargs, inplace=False)


def test_model_that_fails_detection():
    with pytest.raises(NotPreNormError) as ei:
        dr.convert(NoNormResidual(), "attnres")
    assert isinstance(ei.value, DepthRewriteError) and ei.value.node
