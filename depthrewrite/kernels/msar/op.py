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
    phi: torch.Tensor,
    bias: torch.Tensor,
    alpha: torch.Tensor,
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
    ctx.k, ctx.m1 = len(sources), len(conv)
    ctx.save_for_backward(query, gain, phi, bias, alpha, *sources, *conv)
    ctx.args = (eps, scale, conv_values, sigmoid_mixer)


def _backward(ctx, grad):
    query, gain, phi, bias, alpha, *rest = ctx.saved_tensors
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (query, gain, phi, bias, alpha, *rest)]
        q, g, p, b, a = leaves[:5]
        srcs, conv = leaves[5 : 5 + ctx.k], leaves[5 + ctx.k :]
        out = msar_mix_ref(srcs, q, g, conv, p, b, a, *ctx.args)
        grads = torch.autograd.grad(out, leaves, grad, allow_unused=True)
    gq, gg, gp, gb, ga = grads[:5]
    gs, gc = list(grads[5 : 5 + ctx.k]), list(grads[5 + ctx.k :])
    return gs, gq, gg, gc, gp, gb, ga, None, None, None, None


msar_mix.register_autograd(_backward, setup_context=_setup_context)
