"""``depthrewrite::msar_mix``: the MSAR site as one registered op (PyTorch reference now; the fused kernel plugs in
here). Backward recomputes from the saved inputs."""

from __future__ import annotations

import torch

from .reference import msar_mix_ref

__all__ = ["msar_mix"]


@torch.library.custom_op("depthrewrite::msar_mix", mutates_args=())
def msar_mix(
    sources: list[torch.Tensor],
    query: torch.Tensor,
    gain: torch.Tensor,
    conv: list[torch.Tensor],
    phi: torch.Tensor | None,
    bias: torch.Tensor | None,
    alpha: torch.Tensor | None,
    eps: float,
    scale: float,
    conv_values: bool,
    sigmoid_mixer: bool,
) -> torch.Tensor:
    return msar_mix_ref(sources, query, gain, conv, phi, bias, alpha, eps, scale, conv_values, sigmoid_mixer)


@msar_mix.register_fake
def _(sources, query, gain, conv, phi, bias, alpha, eps, scale, conv_values, sigmoid_mixer):
    return torch.empty_like(sources[0])


def _setup_context(ctx, inputs, output):
    sources, query, gain, conv, phi, bias, alpha, eps, scale, conv_values, sigmoid_mixer = inputs
    ctx.k = len(sources)
    ctx.mixer = phi is not None  # the "mean" mixer has no parameters
    mixer = (phi, bias, alpha) if ctx.mixer else ()
    ctx.save_for_backward(query, gain, *mixer, *sources, *conv)
    ctx.args = (eps, scale, conv_values, sigmoid_mixer)


def _backward(ctx, grad):
    n_mix = 3 if ctx.mixer else 0
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in ctx.saved_tensors]
        q, g = leaves[:2]
        p, b, a = leaves[2 : 2 + n_mix] if ctx.mixer else (None, None, None)
        srcs, conv = leaves[2 + n_mix : 2 + n_mix + ctx.k], leaves[2 + n_mix + ctx.k :]
        out = msar_mix_ref(srcs, q, g, conv, p, b, a, *ctx.args)
        grads = torch.autograd.grad(out, leaves, grad, allow_unused=True)
    gq, gg = grads[:2]
    gp, gb, ga = grads[2 : 2 + n_mix] if ctx.mixer else (None, None, None)
    gs, gc = list(grads[2 + n_mix : 2 + n_mix + ctx.k]), list(grads[2 + n_mix + ctx.k :])
    return gs, gq, gg, gc, gp, gb, ga, None, None, None, None


msar_mix.register_autograd(_backward, setup_context=_setup_context)
