"""check_equivalence (is a conversion the same function on given inputs), unconvert (the way back), the warning for
a conversion that is not function-preserving by choice, and the report's notes a newcomer needs."""

from __future__ import annotations

import warnings

import pytest
import torch

import depthrewrite as dr
from depthrewrite.demo.zoo import hf_model
from depthrewrite.errors import ConfigError, NotFunctionPreservingWarning


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    original = hf_model("llama", layers=2).eval()
    return original, dr.convert(original, "attnres", blocks=2, inplace=False)


def test_check_equivalence_at_init_and_after_a_change(pair):
    original, conv = pair
    ids = torch.randint(0, 100, (2, 7))
    res = dr.check_equivalence(conv, original, input_ids=ids)
    assert res and res.tensors >= 1 and "the same function" in str(res)
    with torch.no_grad():
        saved = [p.clone() for p in conv.depthrewrite.parameters()]
        for p in conv.depthrewrite.parameters():
            p.add_(torch.randn_like(p))
    try:
        res = dr.check_equivalence(conv, original, input_ids=ids)
        assert not res and "NOT" in str(res)
    finally:
        with torch.no_grad():
            for p, s in zip(conv.depthrewrite.parameters(), saved):
                p.copy_(s)
    with pytest.raises(ConfigError, match="one object"):
        dr.check_equivalence(conv, conv, input_ids=ids)


def test_unconvert_gives_the_original_class_and_forward_back():
    torch.manual_seed(0)
    model = hf_model("llama", layers=2).eval()
    cls = type(model)
    ids = torch.randint(0, 100, (2, 7))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    conv = dr.convert(model, "msar", blocks=2)
    back = dr.unconvert(conv)
    assert back is model and type(back) is cls and not dr.is_converted(back)
    assert not any(k.startswith("depthrewrite.") for k in back.state_dict())
    assert all(type(layer).__name__ == "LlamaDecoderLayer" and type(layer).__module__.startswith("transformers")
               for layer in back.model.layers)
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, want)
    dr.convert(back, "attnres")  # converts again
    with pytest.raises(ConfigError, match="not a model converted"):
        dr.unconvert(torch.nn.Linear(2, 2))


def test_a_conversion_that_is_not_function_preserving_by_choice_warns():
    with pytest.warns(NotFunctionPreservingWarning, match="preserve_init=True"):
        dr.convert(hf_model("llama", layers=2), "moda")
    with warnings.catch_warnings():
        warnings.simplefilter("error", NotFunctionPreservingWarning)
        dr.convert(hf_model("llama", layers=2), "moda", preserve_init=True)
        dr.convert(hf_model("llama", layers=2), "attnres")


def test_a_block_form_too_shallow_for_its_blocks_says_why_it_is_full(pair):
    conv = dr.convert(hf_model("llama", layers=2), "block-attnres")  # 4 blocks on 4 sublayers: S = 1
    assert any("S = 1" in n and "Full form" in n for n in conv.report().notes)
    original, blocked = pair
    assert not any("Full form" in n for n in blocked.report().notes)


def test_stream_source_computed_in_the_root_is_not_called_a_graph_input():
    class Root(torch.nn.Module):  # the embedding sum happens in the root's own forward
        def __init__(self):
            super().__init__()
            self.tok = torch.nn.Embedding(50, 16)
            self.pos = torch.nn.Embedding(16, 16)
            self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(16) for _ in range(3))
            self.mlps = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))

        def forward(self, ids):
            h = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
            for n, f in zip(self.norms, self.mlps):
                h = h + f(n(h))
            return self.norms[-1](h)

    text = str(dr.inspect(Root(), example_inputs=(torch.randint(0, 50, (2, 8)),)))
    line = next(ln for ln in text.splitlines() if ln.startswith("stream source"))
    assert "graph input" not in line.split("(")[-1] or "not a graph input" in line, line


@pytest.mark.parametrize("scheme", ["block-attnres", "block-msar"])
def test_block_outputs_are_not_views(scheme):
    """FSDP2 warns for a block returning a view (an in-place op on it would skip the all-gather): the depth ops'
    references return tensors of their own."""
    conv = dr.convert(hf_model("llama", layers=4).train(), scheme)
    views = []
    for layer in conv.model.layers:
        layer.register_forward_hook(lambda m, i, o: views.extend(
            t._is_view() for t in (o if isinstance(o, (tuple, list)) else (o,)) if isinstance(t, torch.Tensor)))
    conv(input_ids=torch.randint(0, 100, (2, 16)))
    assert views and not any(views)


def test_check_equivalence_leaves_caches_out_and_copies_the_inputs():
    """With the KV cache on (LlamaConfig's default) a converted MSAR's cache also holds its conv history: outputs are
    compared without caches."""
    torch.manual_seed(0)
    original = hf_model("llama", layers=2).eval()
    conv = dr.convert(original, "msar", blocks=2, inplace=False)
    ids = torch.randint(0, 100, (2, 7))
    assert dr.check_equivalence(conv, original, input_ids=ids, use_cache=True)


def test_batchnorm_running_statistics_are_not_a_cache():
    """A whole-buffer update in training (BatchNorm) is state, but not per position: no continuation guard."""
    from depthrewrite.capture import state_writes

    class BN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = torch.nn.BatchNorm1d(4)

        def forward(self, x):
            return self.bn(x)

    gm = dr.capture(BN().train(), (torch.randn(3, 4),), dynamic=False, check=False)
    assert state_writes(gm) == []
