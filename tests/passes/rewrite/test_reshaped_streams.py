"""Rewrites of chains whose stream changes shape: OPT's flattened [B·T, D] sublayers (reshapes followed along the
chain), and mean-pooled ViTs (timm ``global_pool="avg"``, ``fc_norm=True``) whose final norm reads the pooled stream.
Function-preserving at init for every scheme; the init-equivalence of OPT on the full scheme list is in
test_contract's zoo sweep."""

from __future__ import annotations

import pytest
import torch

import depthrewrite as dr
from depthrewrite.demo.zoo import timm_model

from ...conftest import LAYERS, build_zoo_model
from .helpers import INIT_RTOL, MHC_DEFAULT_RTOL, logits, rel_err
from .test_contract import EXACT, SCHEMES


def _pooled_vit():
    return timm_model("vit_tiny_patch16_224", layers=LAYERS, global_pool="avg", fc_norm=True)


@pytest.mark.parametrize("scheme, options, tol", SCHEMES)
def test_pooled_vit_function_preserving_at_init(scheme, options, tol):
    model = _pooled_vit()
    conv = dr.convert(model, scheme, **options, inplace=False).eval()
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        assert rel_err(conv(x), model(x)) <= tol
    report = conv.report()
    assert report.chain.final_norm.module == "fc_norm"
    assert any(n.startswith("pooled output") for n in report.chain.notes)
    if scheme == "moda":
        return  # MoDA rewrites attention only; the stream and its pool are the model's own
    # the output mix reads the per-token stream: the pool now reads the mix, not the old residual sum
    pool = next(n for n in conv.graph.nodes if n.target is torch.ops.aten.mean.dim)
    src = pool.args[0]
    while src.target is torch.ops.aten.slice.Tensor:
        src = src.args[0]
    assert src.target is not torch.ops.aten.add.Tensor and src.meta["val"].dim() == 3


def test_pooled_vit_chain_report_notes_the_pool():
    text = str(dr.inspect(_pooled_vit()))
    assert "final norm:    fc_norm" in text
    assert "note: pooled output: the final norm reads a mean over tokens (`mean`, after slicing `slice_1`, `slice_2`)" in text


@pytest.mark.parametrize("scheme", ["attnres", "msar", "mhc", "moda"])
def test_pooled_vit_trains(scheme):
    conv = dr.convert(_pooled_vit(), scheme)
    out = conv(torch.randn(2, 3, 224, 224))
    out.square().mean().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in conv.named_parameters() if n.startswith("depthrewrite."))


@pytest.mark.parametrize("scheme, options", [("attnres", {"blocks": 2}), ("msar", {}), ("mhc", {}), ("moda", EXACT["moda"])])
@pytest.mark.parametrize("batch, seq", [(1, 1), (3, 5), (2, 17)])
def test_opt_any_batch_and_sequence(scheme, options, batch, seq):
    """The reshapes back to OPT's [B·T, D] and [B, T, D] read their sizes at run time."""
    model = build_zoo_model("hf:opt")
    conv = dr.convert(model, scheme, **options, inplace=False).eval()
    ids = torch.randint(0, 256, (batch, seq))
    with torch.no_grad():
        err = rel_err(logits(conv(ids)), logits(model(ids)))
    assert err <= (MHC_DEFAULT_RTOL if scheme == "mhc" else INIT_RTOL)
    assert any("reshaped between sublayers" in n for n in conv.report().chain.notes)


def test_opt_trains_through_the_reshapes():
    conv = dr.convert(build_zoo_model("hf:opt"), "attnres")
    ids = torch.randint(0, 256, (2, 8))
    logits(conv(ids)).square().mean().backward()
    grads = [p.grad for n, p in conv.named_parameters() if n.startswith("depthrewrite.")]
    assert grads and all(g is not None for g in grads)


@pytest.mark.parametrize("scheme", ["attnres", "msar", "mhc", "moda"])
def test_opt_node_shapes_match_their_metadata(scheme):
    """Every node of the converted OPT graph that carries a fake value has its rank at run time: the mixes are
    [B, T, D] and the reshapes back to [B·T, D] are where the metadata says."""
    from depthrewrite.passes.analyse.ops import tensor_val

    conv = dr.convert(build_zoo_model("hf:opt"), scheme, **EXACT[scheme]).eval()
    bad = []

    class Check(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            v = tensor_val(n)
            if isinstance(out, torch.Tensor) and v is not None and out.dim() != v.dim():
                bad.append((n.name, tuple(out.shape), tuple(v.shape)))
            return out

    with torch.no_grad():
        Check(conv).run(torch.randint(0, 256, (2, 9)))
    assert not bad
