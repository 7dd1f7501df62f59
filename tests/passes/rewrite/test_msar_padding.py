"""MSAR zeroes the sources at pad positions before its convs (msar.md §4.4, §5: X = X · mask before the convs), so a
left-padded row gives the logits of the same prompt unpadded, on its real positions."""

from __future__ import annotations

import pytest
import torch

import depthrewrite as dr
from depthrewrite.demo.zoo import hf_model
from depthrewrite.errors import ConfigError

from .helpers import assert_matches_reference, mix_name, msar_reference_pair, randomise_like_reference

PAD = 3


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Left padding as HF generate numbers it: cumsum(mask) - 1, clamped at 0."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def _example(V: int, T: int = 10, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2, T), generator=g)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[0, :PAD] = 0
    return dict(input_ids=ids, attention_mask=mask, position_ids=_positions(mask))


def _randomise(conv, seed: int = 1, scale: float = 0.5) -> None:
    """Every new parameter random (queries, gains, the convs' taps, the mixer): the convs read their left context."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in conv.named_parameters():
            if name.startswith("depthrewrite."):
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def _wheres(conv) -> list:
    return [n for n in conv.graph.nodes if n.target is torch.ops.aten.where.ScalarOther]


def _padded_vs_unpadded(conv, V: int, T: int = 11, seed: int = 2) -> float:
    """Max |Δ logits| on the real positions: a prompt left-padded by PAD tokens (next to an unpadded row of length T)
    against the same prompt in its own call, of the unpadded length T - PAD."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, V, (T - PAD,), generator=g)
    other = torch.randint(0, V, (T,), generator=g)
    # pad positions hold random tokens, not the pad id (whose embedding may be zero, and every state at it too)
    pads = torch.randint(1, V, (PAD,), generator=g)
    ids = torch.stack([torch.cat([pads, prompt]), other])
    mask = torch.ones(2, T, dtype=torch.long)
    mask[0, :PAD] = 0
    alone = prompt.expand(2, -1).clone()  # a batch of 2: the graph's batch dimension is dynamic from 2 up
    ones = torch.ones_like(alone)
    with torch.no_grad():
        padded = conv(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits
        single = conv(input_ids=alone, attention_mask=ones, position_ids=_positions(ones)).logits
    return (padded[0, PAD:] - single[0]).abs().max().item()


@pytest.mark.parametrize("blocks", [None, 2], ids=["full", "block2"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gpt2"])
def test_left_padding_equals_unpadded(model_type, blocks):
    torch.manual_seed(0)
    model = hf_model(model_type, layers=2).eval()
    V = model.config.vocab_size
    conv = dr.convert(model, "msar", blocks=blocks, example_kwargs=_example(V), inplace=False).eval()
    assert len(_wheres(conv)) == 2 * 2 + 1  # the embedding and each sublayer output, masked once as they are stored
    _randomise(conv)
    assert _padded_vs_unpadded(conv, V) <= 1e-5
    # the same without the mask: the convs read the pad positions' states, and the padded row changes
    off = dr.convert(model, "msar", blocks=blocks, padding_mask=None, example_kwargs=_example(V), inplace=False).eval()
    assert not _wheres(off) and not any("pad" in n for n in off.report().notes)
    _randomise(off)
    assert _padded_vs_unpadded(off, V) > 1e-3


@pytest.mark.parametrize("blocks", [None, 2], ids=["full", "block2"])
def test_function_preserved_at_init_on_real_positions(blocks):
    torch.manual_seed(0)
    model = hf_model("llama", layers=2).eval()
    ex = _example(model.config.vocab_size)
    conv = dr.convert(model, "msar", blocks=blocks, example_kwargs=ex, inplace=False).eval()
    with torch.no_grad():
        a, b = conv(**ex).logits, model(**ex).logits
    torch.testing.assert_close(a[0, PAD:], b[0, PAD:], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(a[1], b[1], rtol=1e-4, atol=1e-5)


def test_mask_found_by_auto_and_by_name():
    torch.manual_seed(0)
    model = hf_model("llama", layers=2).eval()
    ex = _example(model.config.vocab_size)
    auto = dr.convert(model, "msar", example_kwargs=ex, inplace=False)
    named = dr.convert(model, "msar", padding_mask="attention_mask", example_kwargs=ex, inplace=False)
    for conv in (auto, named):
        notes = conv.report().notes
        assert any("zeroed at pad positions" in n and "`attention_mask`" in n for n in notes), notes
        keep = {n.args[0] for n in _wheres(conv)}
        assert len(keep) == 1
        (ne,) = keep
        assert ne.args[0].args[0].target == "attention_mask"  # where(unsqueeze(ne(attention_mask, 0)), v, 0)
    assert len(_wheres(auto)) == len(_wheres(named)) == 5


def test_without_a_mask_input_nothing_changes():
    torch.manual_seed(0)
    model = hf_model("llama", layers=2).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    a = dr.convert(model, "msar", example_kwargs={"input_ids": ids}, inplace=False)
    b = dr.convert(model, "msar", padding_mask=None, example_kwargs={"input_ids": ids}, inplace=False)
    assert not _wheres(a) and not [n for n in a.report().notes if not n.startswith("module calls:")]
    assert [n.target for n in a.graph.nodes] == [n.target for n in b.graph.nodes]


def test_bad_name_lists_the_inputs():
    torch.manual_seed(0)
    model = hf_model("llama", layers=2).eval()
    ex = _example(model.config.vocab_size)
    with pytest.raises(ConfigError, match=r"no input of that name.*input_ids, attention_mask, position_ids"):
        dr.convert(model, "msar", padding_mask="pad_mask", example_kwargs=ex, inplace=False)
    with pytest.raises(ConfigError, match=r"`position_ids` holds values other than 0 and 1"):
        dr.convert(model, "msar", padding_mask="position_ids", example_kwargs=ex, inplace=False)


@pytest.mark.parametrize("bad", ["", 3, True])
def test_padding_mask_is_validated(bad):
    with pytest.raises(ConfigError, match="padding_mask"):
        dr.MSARConfig(padding_mask=bad)


@pytest.mark.parametrize("S", [1, 2], ids=lambda s: f"S{s}")
def test_independent_reference_with_padding(S):
    """The hand-written reference (msar.md §5: X · mask before the convs), random parameters, a left-padded batch:
    outputs on every position (pad positions too: the mix is 0 there on both sides) and every gradient agree."""
    kernels = (2, 3, 5)
    vanilla, ref = msar_reference_pair(S, kernels)
    idx = torch.randint(0, 64, (2, 9))  # capture keeps this model's mask at its example length: test at it
    mask = torch.ones(2, 9)
    mask[0, :PAD] = 0
    conv = dr.convert(vanilla, "msar", block_size=S, kernel_sizes=kernels,
                      example_kwargs={"idx": idx, "attention_mask": mask}, inplace=False)
    assert len(_wheres(conv)) == 2 * 3 + 1
    randomise_like_reference(ref, conv)
    x = torch.randint(0, 64, (2, 9))
    assert_matches_reference(ref, conv, x, mix_name, attention_mask=mask)
    # and the comparison is sensitive to the mask: converted without it, the padded row's real positions differ
    off = dr.convert(vanilla, "msar", block_size=S, kernel_sizes=kernels, padding_mask=None,
                     example_kwargs={"idx": idx, "attention_mask": mask}, inplace=False)
    randomise_like_reference(ref, off)
    with torch.no_grad():
        assert (off(x, attention_mask=mask)[0, PAD:] - ref(x, attention_mask=mask)[0, PAD:]).abs().max() > 1e-3
        torch.testing.assert_close(off(x, attention_mask=mask)[1], ref(x, attention_mask=mask)[1], rtol=1e-5, atol=1e-5)


def test_auto_skips_an_attention_mask_that_is_not_0_1_and_says_so():
    vanilla, _ = msar_reference_pair(1)
    idx = torch.randint(0, 64, (2, 9))
    mask = torch.full((2, 9), 2.0)  # nonzero keeps a key in this model, but it is no 0/1 padding mask
    conv = dr.convert(vanilla, "msar", example_kwargs={"idx": idx, "attention_mask": mask}, inplace=False)
    assert not _wheres(conv)
    assert any("padding is not masked" in n and "other than 0 and 1" in n for n in conv.report().notes)
    with pytest.raises(ConfigError, match="other than 0 and 1.*inputs: idx, attention_mask"):
        dr.convert(vanilla, "msar", padding_mask="attention_mask", example_kwargs={"idx": idx, "attention_mask": mask}, inplace=False)


def test_pipeline_stages_with_a_mask():
    """Split in two stages, the masked sources cross the boundary (the pad mask as a 1-byte side tensor), and the
    stages give the whole model's logits."""
    import depthrewrite.pipeline as pp

    torch.manual_seed(0)
    model = hf_model("llama", layers=2).eval()
    ex = _example(model.config.vocab_size)
    conv = dr.convert(model, "msar", blocks=2, pipeline_stages=2, example_kwargs=ex, inplace=False).eval()
    _randomise(conv)
    (b,) = conv.report().pipeline.boundaries
    assert {t.label for t in b.tensors if t.kind == "depth"} == {"emb", "partial b1"}
    assert any(t.kind == "side" and t.bytes_per_token == 1 for t in b.tensors)  # the [B, T, 1] keep mask
    mods = pp.stages(conv, 2, (), ex)
    with torch.no_grad():
        h = mods[0](*ex.values())
        torch.testing.assert_close(mods[1](*h), conv(**ex).logits, rtol=0, atol=0)
