"""``depthrewrite::depth_attn``: the AttnRes depth mix as one registered op.

One node per mixing site in exported and compiled graphs. Forward runs the PyTorch reference (the Triton kernel
plugs in here later); backward recomputes the mix from the saved sources instead of keeping fp32 intermediates.
"""

from __future__ import annotations

import torch

from .reference import depth_attn_ref

__all__ = ["depth_attn"]


@torch.library.custom_op("depthrewrite::depth_attn", mutates_args=())
def depth_attn(sources: list[torch.Tensor], query: torch.Tensor, gain: torch.Tensor, eps: float, scale: float) -> torch.Tensor:
    return depth_attn_ref(sources, query, gain, eps, scale)


@depth_attn.register_fake
def _(sources, query, gain, eps, scale):
    return torch.empty_like(sources[0])


def _setup_context(ctx, inputs, output):
    sources, query, gain, eps, scale = inputs
    ctx.save_for_backward(query, gain, *sources)
    ctx.eps, ctx.scale = eps, scale


def _backward(ctx, grad):
    query, gain, *sources = ctx.saved_tensors
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (query, gain, *sources)]
        out = depth_attn_ref(leaves[2:], leaves[0], leaves[1], ctx.eps, ctx.scale)
        grads = torch.autograd.grad(out, leaves, grad, allow_unused=True)
    gq, gg, *gs = grads
    return list(gs), gq, gg, None, None


depth_attn.register_autograd(_backward, setup_context=_setup_context)
