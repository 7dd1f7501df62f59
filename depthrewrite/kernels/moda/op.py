"""``depthrewrite::moda_attn`` and ``depthrewrite::moda_slots``: MoDA's joint attention and the token-major slot
layout as registered ops (PyTorch references; the flash-style kernel plugs in here). Backward recomputes from the
saved inputs; dropout masks come from a seed input, so the recomputation sees the same masks."""

from __future__ import annotations

import torch

from .reference import moda_attn_ref, moda_slots_ref

__all__ = ["moda_attn", "moda_slots"]


@torch.library.custom_op("depthrewrite::moda_attn", mutates_args=())
def moda_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    depth_k: torch.Tensor,
    depth_v: torch.Tensor,
    depth_weight: torch.Tensor | None,
    scale: float,
    is_causal: bool,
    dropout_p: float,
    seed: torch.Tensor | None,
    softcap: float,
) -> torch.Tensor:
    return moda_attn_ref(q, k, v, attn_mask, depth_k, depth_v, depth_weight, scale, is_causal, dropout_p, seed, softcap)


@moda_attn.register_fake
def _(q, k, v, attn_mask, depth_k, depth_v, depth_weight, scale, is_causal, dropout_p, seed, softcap):
    B, H, T, d = q.shape
    return q.new_empty((B, T, H, d)).transpose(1, 2)  # SDPA's output layout


_DIFF = (0, 1, 2, 3, 4, 5, 6)  # q, k, v, attn_mask (an additive bias may be learned), depth_k, depth_v, depth_weight


def _setup(ctx, inputs, output):
    ctx.tensor_pos = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)]
    ctx.save_for_backward(*(inputs[i] for i in ctx.tensor_pos))
    ctx.inputs = [None if i in ctx.tensor_pos else x for i, x in enumerate(inputs)]


def _backward(ctx, grad):
    args = list(ctx.inputs)
    for i, t in zip(ctx.tensor_pos, ctx.saved_tensors):
        args[i] = t
    with torch.enable_grad():
        leaves = {
            i: args[i].detach().requires_grad_(True)
            for i in _DIFF
            if isinstance(args[i], torch.Tensor) and args[i].is_floating_point()
        }
        call = [leaves.get(i, a) for i, a in enumerate(args)]
        out = moda_attn_ref(*call)
        got = torch.autograd.grad(out, list(leaves.values()), grad, allow_unused=True)
    grads = dict(zip(leaves, got))
    return tuple(grads.get(i) for i in range(len(args)))


moda_attn.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("depthrewrite::moda_slots", mutates_args=())
def moda_slots(keys: list[torch.Tensor]) -> torch.Tensor:
    return moda_slots_ref(keys)


@moda_slots.register_fake
def _(keys):
    B, Hk, T, d = keys[0].shape
    return keys[0].new_empty((B, T, len(keys), Hk, d))


def _slots_setup(ctx, inputs, output):
    ctx.n = len(inputs[0])


def _slots_backward(ctx, grad):
    # [B, T, n, Hk, d] -> n x [B, Hk, T, d]
    return [g.transpose(1, 2) for g in grad.unbind(2)]


moda_slots.register_autograd(_slots_backward, setup_context=_slots_setup)
