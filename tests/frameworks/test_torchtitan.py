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
