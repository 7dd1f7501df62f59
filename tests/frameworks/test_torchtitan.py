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


def test_flex_attention_build_is_refused_naming_the_block_mask():
    """torchtitan's default attention for language models (FlexAttention) takes a BlockMask input, which torch.export
    does not take: a CaptureError naming the argument and the SDPA alternative, not export's generic advice."""
    import depthrewrite as dr
    from depthrewrite.errors import CaptureError

    from .models import build

    model, args, kwargs = build(FRAMEWORK, "llama3", attention="flex")
    with pytest.raises(CaptureError, match=r"an input \(attention_masks\) is a BlockMask.*ScaledDotProductAttention"):
        dr.convert(model, "attnres", example_inputs=args, example_kwargs=kwargs)


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
