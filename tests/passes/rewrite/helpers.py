"""Helpers shared by the rewrite tests."""

from __future__ import annotations

import torch

#: Init-equivalence tolerance, max|Δ| / max|ref| in fp32. At init every AttnRes/MSAR mix is K·(1/K)·Σ sources, the
#: standard stream up to fp32 summation order (measured ~4e-7 on the zoo); mHC with α = 0 differs only by its ε
#: terms (~2e-6). 1e-5 leaves headroom for deeper models and still catches an ε or scale bug: the paper's "mean"
#: mix shifts every norm's ε by K² and gives 1e-3..1e-1 (attnres.md §5).
INIT_RTOL = 1e-5
#: mHC's default init (φ ~ N(0, 1e-4), α = 0.01) is close, not exact (mhc.md §6 measures ~5e-6 on a small Llama).
MHC_DEFAULT_RTOL = 1e-4


def inputs_for(name, model, batch=2, seq=9):
    if name.startswith("timm:"):
        return (torch.randn(batch, 3, 224, 224),)
    vocab = model.config.vocab_size if hasattr(model, "config") and hasattr(model.config, "vocab_size") else 256
    return (torch.randint(0, vocab, (batch, seq)),)


def logits(out):
    return out.logits if hasattr(out, "logits") else out


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def assert_matches_reference(ref: torch.nn.Module, conv: torch.nn.Module, idx: torch.Tensor, conv_name) -> None:
    """Outputs and every parameter gradient of a hand-written reference equal the converted model's.

    ``conv_name(ref_param_name)`` gives the converted model's name for a reference parameter (identity for the
    original parameters, ``depthrewrite.*`` for new ones)."""
    out_ref, out = ref(idx), conv(idx)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    out_ref.square().mean().backward()
    out.square().mean().backward()
    params = dict(conv.named_parameters())
    for name, p in ref.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(params[conv_name(name)].grad, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
