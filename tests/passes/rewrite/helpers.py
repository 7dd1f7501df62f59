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


def assert_matches_reference(ref: torch.nn.Module, conv: torch.nn.Module, idx: torch.Tensor, conv_name,
                             **kwargs) -> None:
    """Outputs and every parameter gradient of a hand-written reference equal the converted model's.

    ``conv_name(ref_param_name)`` gives the converted model's name for a reference parameter (identity for the
    original parameters, ``depthrewrite.*`` for new ones). ``kwargs`` (e.g. ``attention_mask``) go to both calls."""
    out_ref, out = ref(idx, **kwargs), conv(idx, **kwargs)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    out_ref.square().mean().backward()
    out.square().mean().backward()
    params = dict(conv.named_parameters())
    for name, p in ref.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(params[conv_name(name)].grad, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def msar_reference_pair(S: int, kernels=(2, 3, 5), layers: int = 3, norm_eps: float = 1e-6):
    """A vanilla reference decoder (seeded) and its hand-written (Block) MSAR twin sharing its weights."""
    from .reference_models import Decoder, MSARDecoder

    torch.manual_seed(0)
    vanilla = Decoder(layers=layers, norm_eps=norm_eps)
    ref = MSARDecoder(layers=layers, block_size=S, kernels=kernels, norm_eps=norm_eps)
    ref.load_state_dict(vanilla.state_dict(), strict=False)
    return vanilla, ref


def randomise_like_reference(ref, conv, scale=0.5):
    """The same random values in the reference's mixes and the converted model's ``depthrewrite.mix_*`` sites."""
    g = torch.Generator().manual_seed(1)
    for j, mix in ref.mixes.items():
        site = getattr(conv.depthrewrite, f"mix_{j}")
        for (name, p_ref), (name2, p_conv) in zip(mix.named_parameters(), site.named_parameters()):
            assert name == name2
            v = torch.randn(p_ref.shape, generator=g) * scale
            p_ref.data.copy_(v)
            p_conv.data.copy_(v)


def mix_name(n: str) -> str:
    """The converted model's name of a reference decoder's parameter (``mixes.3.query`` -> ``depthrewrite.mix_3.query``)."""
    return "depthrewrite.mix_" + n[len("mixes."):] if n.startswith("mixes.") else n
