"""Every scheme converts torchtitan 0.3.0: llama3, qwen3 and deepseek_v3 (MLA + MoE) from its config dataclasses, with its SDPA attention, exact at init, and trains one step (tests/frameworks/contract.py)."""

from __future__ import annotations

import importlib.util

import pytest

from .contract import SCHEMES, check_init, check_training_step
from .models import cases

FRAMEWORK = "torchtitan"
pytestmark = pytest.mark.skipif(importlib.util.find_spec(FRAMEWORK) is None, reason=f"{FRAMEWORK} is not installed")


@pytest.mark.parametrize("scheme, options, tol", SCHEMES)
@pytest.mark.parametrize("name", cases(FRAMEWORK))
def test_exact_at_init(name, scheme, options, tol):
    check_init(FRAMEWORK, name, scheme, options, tol)


@pytest.mark.parametrize("scheme, options, tol", SCHEMES)
@pytest.mark.parametrize("name", cases(FRAMEWORK))
def test_training_step(name, scheme, options, tol):
    check_training_step(FRAMEWORK, name, scheme, options)


def _flex_call(model, positions):
    """torchtitan's own inputs for one call: positions and the BlockMask its model builds from them."""
    return {"positions": positions, "attention_masks": model.get_attention_masks(positions)}


@pytest.mark.parametrize("scheme", ["attnres", "block-attnres", "msar", "mhc"])
def test_flex_attention_is_captured(scheme):
    """torchtitan's default attention (FlexAttention, its BlockMask built outside the model and passed in) converts:
    the mask's tensors, and those its mask function closes over (the document ids), are inputs of the graph, so a
    fresh mask and one with two documents per row give the original's logits (no grad: the original's FlexAttention
    refuses CPU inputs that require grad) without a new capture; blocks are modules."""
    import torch

    import depthrewrite as dr
    from depthrewrite.runtime.handle import state_of

    from .models import build

    model, (ids,), kwargs = build(FRAMEWORK, "llama3", attention="flex")
    name, opts = ("attnres", {"blocks": 2}) if scheme == "block-attnres" else (scheme, dict(dr.scheme(scheme).exact))
    conv = dr.convert(model, name, example_inputs=(ids,), example_kwargs=kwargs, inplace=False, **opts)
    state = state_of(conv)
    assert state.blocks is not None, state.blocks_note
    captures = state.captures
    two_docs = kwargs["positions"].clone()
    two_docs[:, 4:] = torch.arange(two_docs.shape[1] - 4)  # a second document from token 4: another mask
    with torch.no_grad():
        for positions in (kwargs["positions"], two_docs):
            want = model(ids, **_flex_call(model, positions))
            got = conv(ids, **_flex_call(model, positions))
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        other = model(ids, **_flex_call(model, kwargs["positions"]))
    assert (want - other).abs().max() > 1e-3  # the two-document mask changes the logits: it is read, not fixed
    assert state.captures == captures


def test_flex_attention_trains_as_sdpa_does():
    """The converted FlexAttention model's loss and gradients (new parameters randomised) equal the same converted
    model built with SDPA attention, on a causal single-document mask: the mask reaches the attention, and the
    captured operator's backward runs (on CPU too, where torchtitan's own FlexAttention refuses grad)."""
    import torch

    import depthrewrite as dr

    from .models import build

    flex, (ids,), kwargs = build(FRAMEWORK, "llama3", attention="flex")
    sdpa, _, _ = build(FRAMEWORK, "llama3", attention="sdpa")
    sdpa.load_state_dict(flex.state_dict())
    a = dr.convert(flex, "msar", example_inputs=(ids,), example_kwargs=kwargs, inplace=False, blocks=2)
    b = dr.convert(sdpa, "msar", example_inputs=(ids,), inplace=False, blocks=2)
    with torch.no_grad():
        for p in a.depthrewrite.parameters():
            p.add_(0.1 * torch.randn_like(p))
    b.load_state_dict(a.state_dict())
    grads = []
    for m, kw in ((a, _flex_call(flex, kwargs["positions"])), (b, {})):
        loss = m(ids, **kw).float().pow(2).mean()
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (la, ga), (lb, gb) = grads
    torch.testing.assert_close(la, lb, atol=1e-5, rtol=1e-5)
    assert ga.keys() == gb.keys()
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], atol=1e-5, rtol=1e-4, msg=n)


def test_flex_attention_moda_is_refused_naming_the_operator():
    """MoDA adds its depth slots to one softmax over sequence and depth; a FlexAttention operator is not opened: a
    typed error naming the node and the SDPA alternative."""
    import depthrewrite as dr
    from depthrewrite.errors import AttentionPatternError

    from .models import build

    model, args, kwargs = build(FRAMEWORK, "llama3", attention="flex")
    with pytest.raises(AttentionPatternError, match=r"FlexAttention.*ScaledDotProductAttention"):
        dr.convert(model, "moda", example_inputs=args, example_kwargs=kwargs)


@pytest.mark.parametrize("scheme", ["block-attnres", "mhc"])
def test_to_empty_and_init_states(scheme):
    """torchtitan's trainer materialises a model with ``to_empty`` and then ``init_states()``, which initialises
    torchtitan's own modules only: the new parameters go back to their init in ``to_empty`` (they used to stay
    uninitialised memory), so the converted model is again the original function of the re-initialised weights."""
    import torch

    import depthrewrite as dr

    from .models import build

    model, args, kwargs = build(FRAMEWORK, "llama3")
    name, opts = ("attnres", {"blocks": 2}) if scheme == "block-attnres" else (scheme, dict(dr.scheme(scheme).exact))
    conv = dr.convert(model, name, example_inputs=args, inplace=False, **opts)
    with torch.no_grad():
        for p in conv.depthrewrite.parameters():  # trained-looking
            p.add_(torch.randn_like(p))
    for m in (conv, model):
        m.to_empty(device="cpu")
        torch.manual_seed(5)  # torchtitan's init draws from the global generator
        m.init_states()
    with torch.no_grad():
        torch.testing.assert_close(conv(*args), model(*args), rtol=1e-5, atol=1e-5)
