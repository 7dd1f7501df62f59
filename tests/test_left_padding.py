"""Left padding with trained-looking new parameters, every scheme: a left-padded row (its attention mask zero at the
start) gives, on its real positions, finite logits equal to the same prompt run unpadded, and finite gradients.

The pad positions' states are garbage by design (HF's padding mask leaves a pad query row without any key); what
matters is that nothing of them reaches a real position. Every parameter under ``depthrewrite.`` is randomised
(``N(0, 0.5²)``), as after training: MoDA's ``preserve_init`` λ is then partly clamped at 0 (negative draws), which is
what left a pad query row with no key and no depth weight at all (0/0) and poisoned later layers through the masked
keys' values. Three layers, so a pad row's output reaches a later attention's keys and values."""

from __future__ import annotations

import pytest
import torch

import depthrewrite as dr
from depthrewrite.demo.zoo import hf_model
from depthrewrite.kernels.dispatch import kernel_backend

PAD, T, LAYERS = 3, 9, 3

SCHEMES = [
    pytest.param("attnres", {}, id="attnres-full"),
    pytest.param("attnres", {"blocks": 2}, id="attnres-block"),
    pytest.param("msar", {}, id="msar-full"),
    pytest.param("msar", {"blocks": 2}, id="msar-block"),
    pytest.param("mhc", {}, id="mhc"),
    pytest.param("moda", {}, id="moda"),
    pytest.param("moda", {"preserve_init": True}, id="moda-preserve-init"),
]


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Left padding as HF generate numbers it: cumsum(mask) - 1, clamped at 0."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def _batches(V: int, seed: int = 2):
    """(padded call, unpadded call): row 0 is a prompt left-padded by PAD random tokens next to a full row; the
    unpadded call holds the prompt alone (a batch of 2: the graph's batch dimension is dynamic from 2 up)."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, V, (T - PAD,), generator=g)
    other = torch.randint(0, V, (T,), generator=g)
    pads = torch.randint(1, V, (PAD,), generator=g)  # not the pad id, whose embedding may be zero
    ids = torch.stack([torch.cat([pads, prompt]), other])
    mask = torch.ones(2, T, dtype=torch.long)
    mask[0, :PAD] = 0
    alone = prompt.expand(2, -1).clone()
    ones = torch.ones_like(alone)
    return (dict(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)),
            dict(input_ids=alone, attention_mask=ones, position_ids=_positions(ones)))


def _randomise(conv, seed: int = 1, scale: float = 0.5) -> int:
    g = torch.Generator().manual_seed(seed)
    n = 0
    with torch.no_grad():
        for name, p in conv.named_parameters():
            if name.startswith("depthrewrite."):
                p.copy_(torch.randn(p.shape, generator=g) * scale)
                n += 1
    return n


def _check(conv, V: int) -> None:
    padded, single = _batches(V)
    out = conv(**padded).logits
    real = out[0, PAD:]
    assert torch.isfinite(real).all(), f"{(~torch.isfinite(real)).sum().item()} non-finite logits on real positions"
    assert torch.isfinite(out[1]).all()
    with torch.no_grad():
        alone = conv(**single).logits[0]
    torch.testing.assert_close(real, alone, rtol=1e-4, atol=1e-4 * alone.abs().max().item())
    # a loss on the real positions only (labels -100 on the pads, as a collator writes them)
    real.square().mean().add(out[1].square().mean()).backward()
    bad = [n for n, p in conv.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    assert not bad, f"non-finite gradients: {bad[:5]}"
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in conv.named_parameters()
               if n.startswith("depthrewrite."))


@pytest.mark.parametrize("scheme, options", SCHEMES)
def test_left_padding_with_trained_parameters(scheme, options):
    torch.manual_seed(0)
    model = hf_model("llama", layers=LAYERS)
    V = model.config.vocab_size
    conv = dr.convert(model, scheme, example_kwargs=_batches(V)[0], **options)
    assert _randomise(conv) > 0
    _check(conv, V)


@pytest.mark.parametrize("preserve_init", [False, True], ids=["moda", "moda-preserve-init"])
def test_left_padding_moda_triton_kernel(preserve_init):
    """The same through MoDA's fused kernel (Triton's interpreter on CPU), forward and backward."""
    torch.manual_seed(0)
    model = hf_model("llama", layers=LAYERS)
    V = model.config.vocab_size
    conv = dr.convert(model, "moda", example_kwargs=_batches(V)[0], preserve_init=preserve_init)
    _randomise(conv)
    with kernel_backend("triton"):
        _check(conv, V)
