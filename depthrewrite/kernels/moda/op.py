"""``depthrewrite::moda_attn`` and ``depthrewrite::moda_attn_slots``: MoDA's joint attention as registered ops, over
stacked token-major depth slots (the kernel's layout) and over the slot tensors themselves (what the rewrite inserts).

``moda_attn`` runs the fused Triton kernel (``fused.py``, imported lazily) when
:func:`~depthrewrite.kernels.dispatch.route` picks it: the backend decision, then the gate :func:`.limits.covers`
(``None``, or the reason for the reference). The op is documented once, in :mod:`.reference`. Its backward is its
own registered op, ``depthrewrite::moda_attn_backward`` (one opaque node per site in a compiled backward graph), which dispatches the
same way: the Triton backward (recomputes the LSE, then dQ + depth gradients and dK/dV) or the reference
recomputation. Dropout masks come from a seed input, so the reference recomputation sees the same masks.
``moda_attn_slots`` stacks its slots inside the call (the stack is not kept) and saves the slot tensors for backward,
so a model keeps each slot once, not one stacked copy per reading site."""

from __future__ import annotations

import math

import torch

from ..dispatch import KernelInfo, register_kernel_info, route
from .limits import MAX_HEAD_DIM, covers
from .reference import (
    _logsumexp, cpu_flash_applies, cpu_flash_sequence, joint_probabilities, merge_weights, moda_attn_ref,
    moda_slots_ref,
)

__all__ = ["moda_attn", "moda_attn_backward", "moda_attn_slots", "moda_attn_slots_stack", "moda_stack_slots", "covers",
           "kernel_covers"]

def kernel_covers(q, k, v, attn_mask, depth_k, depth_v, depth_weight, dropout_p) -> bool:
    """Whether the fused kernel handles this call (``covers(...) is None``; :func:`.limits.covers` says why not)."""
    return covers(q, k, v, attn_mask, depth_k, depth_v, depth_weight, dropout_p) is None


def _use_kernel(q, k, v, attn_mask, depth_k, depth_v, depth_weight, dropout_p, op: str) -> bool:
    return route(
        op, (q, k, v, attn_mask, depth_k, depth_v, depth_weight),
        lambda: covers(q, k, v, attn_mask, depth_k, depth_v, depth_weight, dropout_p),
    )  # fmt: skip


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
    return _forward(q, k, v, attn_mask, depth_k, depth_v, depth_weight, scale, is_causal, dropout_p, seed, softcap,
                    "depthrewrite::moda_attn")


def _forward(q, k, v, attn_mask, depth_k, depth_v, depth_weight, scale, is_causal, dropout_p, seed, softcap, op: str):
    """The body of :func:`moda_attn` (and of :func:`moda_attn_slots` once it has stacked its slots): the Triton
    kernel where :func:`route` picks it, else the reference; the route is recorded under ``op``."""
    if _use_kernel(q, k, v, attn_mask, depth_k, depth_v, depth_weight, dropout_p, op):
        from .fused import moda_attn_fwd

        out, _ = moda_attn_fwd(q, k, v, attn_mask, depth_k, depth_v, depth_weight, scale, is_causal, softcap)
        return out
    return moda_attn_ref(q, k, v, attn_mask, depth_k, depth_v, depth_weight, scale, is_causal, dropout_p, seed, softcap)


def _fake_out(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    B, H, T, _ = q.shape
    dv = v.shape[-1]  # the value head dim; SDPA's output layout ([B, T, H, dv] in memory)
    return q.new_empty_strided((B, H, T, dv), (T * H * dv, dv, H * dv, 1))


@moda_attn.register_fake
def _(q, k, v, attn_mask, depth_k, depth_v, depth_weight, scale, is_causal, dropout_p, seed, softcap):
    return _fake_out(q, v)




def _reference_grads(grad, args, mask_grad: bool) -> list[torch.Tensor | None]:
    """Gradients of :func:`moda_attn_ref` for q, k, v, attn_mask, depth_k, depth_v, depth_weight, written out.

    The op body runs below autograd, so the reference cannot be differentiated there; this is the joint-softmax
    backward of moda.md §5 in plain PyTorch (fp32, or fp64 for fp64 inputs), recomputing the forward's logits and the
    reference's seeded dropout masks (same generator, same draw order). With joint probabilities ``P`` (λ included),
    dropout multipliers ``z`` and ``δ = do·o``: ``dS = P (z·dP − δ)`` on both parts, ``dλ = Σ e (z·dP − δ)``
    (``e = P / λ``, straight through the clamp), soft-cap chained by ``1 − tanh²``; an additive mask gets ``dS`` of the
    sequence part summed to its shape.
    """
    q, k, v, attn_mask, depth_k, depth_v, depth_weight, scale, is_causal, dropout_p, seed, softcap = args
    if not mask_grad and cpu_flash_applies(q, k, v, attn_mask, dropout_p, softcap):
        return _cpu_flash_grads(grad, args)
    acc = torch.promote_types(q.dtype, torch.float32)
    B, Hq, T, d = q.shape
    Hk, S = k.shape[1], k.shape[2]
    G = Hq // Hk
    qf, do = q.to(acc), grad.to(acc)
    kf, vf = k.to(acc).repeat_interleave(G, dim=1), v.to(acc).repeat_interleave(G, dim=1)
    Kd, Vd = depth_k.to(acc).repeat_interleave(G, dim=3), depth_v.to(acc).repeat_interleave(G, dim=3)
    raw_s = (qf @ kf.transpose(-1, -2)) * scale
    raw_d = torch.einsum("bhtd,btnhd->bhtn", qf, Kd) * scale
    cap_s = softcap * torch.tanh(raw_s / softcap) if softcap > 0 else raw_s
    cap_d = softcap * torch.tanh(raw_d / softcap) if softcap > 0 else raw_d
    s = cap_s
    if is_causal:
        keep = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, -math.inf)
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else s + attn_mask.to(acc)
    lse_s = _logsumexp(s)
    lse_d = torch.logsumexp(cap_d, dim=-1, keepdim=True)
    lam = None
    if depth_weight is not None:
        lam = depth_weight.to(acc).clamp_min(0.0).view(1, Hq, 1, 1)
    # joint LSE (λ included; +inf on a row with nothing visible: all its probabilities 0), depth weights without and
    # with λ
    L, e_d, p_d = joint_probabilities(lse_s, lse_d, lam, cap_d)
    p_s = torch.exp(s - L)
    z_s = z_d = None
    if dropout_p > 0.0:
        gen = None
        if seed is not None:
            gen = torch.Generator(device=q.device).manual_seed(int(seed.reshape(-1)[0]))
        z_s = (torch.rand(s.shape, generator=gen, device=q.device, dtype=acc) >= dropout_p).to(acc) / (1.0 - dropout_p)
        z_d = (torch.rand(cap_d.shape, generator=gen, device=q.device, dtype=acc) >= dropout_p).to(acc) / (1.0 - dropout_p)
    pz_s = p_s * z_s if z_s is not None else p_s
    pz_d = p_d * z_d if z_d is not None else p_d
    out = pz_s @ vf + torch.einsum("bhtn,btnhd->bhtd", pz_d, Vd)
    delta = (do * out).sum(-1, keepdim=True)
    dp_s = do @ vf.transpose(-1, -2)
    dp_d = torch.einsum("bhtd,btnhd->bhtn", do, Vd)
    if z_s is not None:
        dp_s, dp_d = dp_s * z_s, dp_d * z_d
    ds_s = p_s * (dp_s - delta)
    ds_d = p_d * (dp_d - delta)
    dlam = (e_d * (dp_d - delta)).sum(dim=(0, 2, 3)) if depth_weight is not None else None
    dmask = ds_s.sum_to_size(attn_mask.shape) if mask_grad else None
    if softcap > 0:
        ds_s = ds_s * (1.0 - (cap_s / softcap) ** 2)
        ds_d = ds_d * (1.0 - (cap_d / softcap) ** 2)
    dq = (ds_s @ kf + torch.einsum("bhtn,btnhd->bhtd", ds_d, Kd)) * scale
    dk = ((ds_s.transpose(-1, -2) @ qf) * scale).view(B, Hk, G, S, d).sum(2)
    dv = (pz_s.transpose(-1, -2) @ do).view(B, Hk, G, S, -1).sum(2)  # the value head dim (MLA: not d)
    dkd = (torch.einsum("bhtn,bhtd->btnhd", ds_d, qf) * scale).view(B, T, -1, Hk, G, d).sum(4)
    dvd = torch.einsum("bhtn,bhtd->btnhd", pz_d, do).view(B, T, -1, Hk, G, do.shape[-1]).sum(4)
    return [dq, dk, dv, dmask, dkd, dvd, dlam]


def _cpu_flash_grads(grad, args) -> list[torch.Tensor | None]:
    """:func:`_reference_grads` where the sequence part runs PyTorch's CPU flash kernel (fp32/fp64 CPU, no dropout,
    no soft-cap, no mask gradient; :func:`.reference.cpu_flash_applies`).

    The joint softmax's sequence-part gradients are exactly flash attention's backward called with the *joint*
    output ``o`` and the *joint* log-sum-exp ``L`` (its probabilities ``exp(s − L)`` are the joint ones, and its
    ``rowsum(do ⊙ o)`` is the joint ``δ``); the depth part (n slots per token) is written out as in
    :func:`_reference_grads`."""
    q, k, v, attn_mask, depth_k, depth_v, depth_weight, scale, is_causal, dropout_p, seed, softcap = args
    B, Hq, T, d = q.shape
    Hk, S = k.shape[1], k.shape[2]
    G = Hq // Hk
    o_s, lse_s, ke, ve, mask = cpu_flash_sequence(q, k, v, attn_mask, scale, is_causal)
    lse_s = lse_s.unsqueeze(-1)
    acc = q.dtype  # fp32 or fp64 here (cpu_flash_applies); the depth slots and λ may come in another dtype
    Kd = depth_k.to(acc).repeat_interleave(G, dim=3)  # [B, T, n, Hq, d]
    Vd = depth_v.to(acc).repeat_interleave(G, dim=3)
    dlog = torch.einsum("bhtd,btnhd->bhtn", q, Kd) * scale
    lse_d = torch.logsumexp(dlog, dim=-1, keepdim=True)
    lam = depth_weight.to(acc).clamp_min(0.0).view(1, Hq, 1, 1) if depth_weight is not None else None
    a, b, empty, _ = merge_weights(lse_s, lse_d, lam)
    L, e_d, p_d = joint_probabilities(lse_s, lse_d, lam, dlog)  # L = +inf on empty rows: flash's P = exp(s − L) = 0
    out = a / torch.where(empty, 1.0, a + b) * o_s + torch.einsum("bhtn,btnhd->bhtd", p_d, Vd)
    do = grad.contiguous()
    dq_s, dk_e, dv_e = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do, q, ke, ve, out, L.squeeze(-1), 0.0, is_causal, attn_mask=mask, scale=scale
    )
    delta = (do * out).sum(-1, keepdim=True)
    dp_d = torch.einsum("bhtd,btnhd->bhtn", do, Vd)
    ds_d = p_d * (dp_d - delta)
    dlam = (e_d * (dp_d - delta)).sum(dim=(0, 2, 3)) if depth_weight is not None else None
    dq = dq_s + torch.einsum("bhtn,btnhd->bhtd", ds_d, Kd) * scale
    dk = dk_e.view(B, Hk, G, S, d).sum(2) if G > 1 else dk_e
    dv = dv_e.view(B, Hk, G, S, -1).sum(2) if G > 1 else dv_e
    dkd = (torch.einsum("bhtn,bhtd->btnhd", ds_d, q) * scale).view(B, T, -1, Hk, G, d).sum(4)
    dvd = torch.einsum("bhtn,bhtd->btnhd", p_d, do).view(B, T, -1, Hk, G, do.shape[-1]).sum(4)
    return [dq, dk, dv, None, dkd, dvd, dlam]


@torch.library.custom_op("depthrewrite::moda_attn_backward", mutates_args=())
def moda_attn_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    depth_k: torch.Tensor,
    depth_v: torch.Tensor,
    depth_weight: torch.Tensor | None,
    out: torch.Tensor,
    scale: float,
    is_causal: bool,
    dropout_p: float,
    seed: torch.Tensor | None,
    softcap: float,
    mask_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv, dmask, dKd, dVd, dλ)`` of :func:`moda_attn`, each shaped like its input.

    ``dmask`` is an empty tensor unless ``mask_grad`` (an additive float mask that requires grad); ``dλ`` is empty
    when ``depth_weight`` is None. ``out`` is the forward output (the Triton backward needs ``rowsum(o ⊙ do)``).
    """
    if _use_kernel(q, k, v, attn_mask, depth_k, depth_v, depth_weight, dropout_p, "depthrewrite::moda_attn_backward"):
        from .fused import moda_attn_bwd

        got = list(
            moda_attn_bwd(grad, q, k, v, attn_mask, depth_k, depth_v, depth_weight, out, scale, is_causal, softcap,
                          mask_grad)
        )
    else:
        args = [q, k, v, attn_mask, depth_k, depth_v, depth_weight, scale, is_causal, dropout_p, seed, softcap]
        got = _reference_grads(grad, args, mask_grad)
    like = (q, k, v, attn_mask if mask_grad else None, depth_k, depth_v, depth_weight)
    inputs = (grad, q, k, v, attn_mask, depth_k, depth_v, depth_weight, out, seed)
    taken = {t.untyped_storage().data_ptr() for t in inputs if t is not None and t.numel() > 0}
    res = []
    for g, x in zip(got, like):
        if x is None:
            res.append(q.new_empty(0))
        elif g is None:
            res.append(torch.zeros_like(x))
        elif _as_fake_promises(g, x, taken):
            taken.add(g.untyped_storage().data_ptr())
            res.append(g)
        else:
            res.append(torch.empty_like(x).copy_(g))  # the fake's layout, whatever the producer's strides
    return tuple(res)


def _as_fake_promises(g: torch.Tensor, x: torch.Tensor, taken: set[int]) -> bool:
    """Whether ``g`` can be returned as the gradient of ``x`` as is: the dtype, shape and strides of
    ``torch.empty_like(x)`` (the fake's output; strides computed on the meta device, nothing allocated), on x's
    device, and a storage that no input and no earlier output uses (a custom op's outputs may not alias)."""
    return (
        g.dtype == x.dtype
        and g.device == x.device
        and g.shape == x.shape
        and g.numel() > 0
        and g.stride() == torch.empty_like(x, device="meta").stride()
        and g.untyped_storage().data_ptr() not in taken
    )


@moda_attn_backward.register_fake
def _(grad, q, k, v, attn_mask, depth_k, depth_v, depth_weight, out, scale, is_causal, dropout_p, seed, softcap,
      mask_grad):
    like = (q, k, v, attn_mask if mask_grad else None, depth_k, depth_v, depth_weight)
    return tuple(q.new_empty(0) if x is None else torch.empty_like(x) for x in like)


def _setup(ctx, inputs, output):
    q, k, v, attn_mask, depth_k, depth_v, depth_weight, scale, is_causal, dropout_p, seed, softcap = inputs
    ctx.save_for_backward(q, k, v, attn_mask, depth_k, depth_v, depth_weight, seed, output)
    ctx.scale, ctx.is_causal, ctx.dropout_p, ctx.softcap = scale, is_causal, dropout_p, softcap


def _backward(ctx, grad):
    q, k, v, attn_mask, depth_k, depth_v, depth_weight, seed, out = ctx.saved_tensors
    mask_grad = bool(attn_mask is not None and attn_mask.is_floating_point() and ctx.needs_input_grad[3])
    dq, dk, dv, dmask, dkd, dvd, dlam = moda_attn_backward(
        grad, q, k, v, attn_mask, depth_k, depth_v, depth_weight, out,
        ctx.scale, ctx.is_causal, ctx.dropout_p, seed, ctx.softcap, mask_grad,
    )
    return (
        dq, dk, dv, dmask if mask_grad else None, dkd, dvd, dlam if depth_weight is not None else None,
        None, None, None, None, None,
    )


#: when moda_attn and moda_attn_slots run the reference instead of the kernel
_FALLS_BACK = (
    "dropout_p > 0 (seeded torch.rand masks); dtypes other than fp32/bf16/fp16 or mixed input dtypes; bf16 on CPU "
    f"(the Triton interpreter has no bf16); a query/key or value head dim > {MAX_HEAD_DIM} (they may differ: MLA); Hq "
    "not a multiple of Hk; empty T or S; a mask that is neither bool nor floating or not broadcastable to [B, Hq, T, S]"
)

moda_attn.register_autograd(_backward, setup_context=_setup)

register_kernel_info(
    KernelInfo(
        op="depthrewrite::moda_attn",
        forward="moda_attn_fwd_kernel: flash-style (FA2) online softmax; grid (T/BMT, B·Hk), the G query heads of a "
        "KV head folded into the rows; depth slots first, then the sequence blocks (tl.dot QKᵀ and PV)",
        backward="depthrewrite::moda_attn_backward: moda_attn_fwd_kernel (stats only, recomputes the LSE), "
        "moda_attn_bwd_kernel_dq (dQ + dKd/dVd + per-row dλ partials + dS for a learned additive mask), "
        "moda_attn_bwd_kernel_dkdv (dK/dV, G heads folded); no atomics",
        fuses="sequence attention (causal / bool / additive mask, soft-cap) and the same-token depth slots with λ "
        "in one online softmax; no logits, probabilities or separate LSE merge in HBM",
        falls_back=_FALLS_BACK,
    )
)


@torch.library.custom_op("depthrewrite::moda_attn_slots", mutates_args=())
def moda_attn_slots(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    slots_k: list[torch.Tensor],
    slots_v: list[torch.Tensor],
    depth_weight: torch.Tensor | None,
    scale: float,
    is_causal: bool,
    dropout_p: float,
    seed: torch.Tensor | None,
    softcap: float,
) -> torch.Tensor:
    """:func:`moda_attn` over the depth slots as their writers made them: n tensors ``[B, Hk, T, d]`` (keys) and
    ``[B, Hk, T, dv]`` (values), any strides, stacked token-major (:func:`.reference.moda_slots_ref`) inside the call
    and freed after it. What autograd keeps for backward is the slot tensors themselves, which every later reader
    shares, so a model keeps each slot once (O(L)) instead of one stacked copy per reading site (O(L²)); backward
    stacks them again (a layout copy) and runs :func:`moda_attn_backward`."""
    return _forward(q, k, v, attn_mask, moda_slots_ref(slots_k), moda_slots_ref(slots_v), depth_weight, scale,
                    is_causal, dropout_p, seed, softcap, "depthrewrite::moda_attn_slots")


@moda_attn_slots.register_fake
def _(q, k, v, attn_mask, slots_k, slots_v, depth_weight, scale, is_causal, dropout_p, seed, softcap):
    return _fake_out(q, v)


def _slots_setup(ctx, inputs, output):
    q, k, v, attn_mask, slots_k, slots_v, depth_weight, scale, is_causal, dropout_p, seed, softcap = inputs
    ctx.n = len(slots_k)
    ctx.save_for_backward(q, k, v, attn_mask, depth_weight, seed, output, *slots_k, *slots_v)
    ctx.scale, ctx.is_causal, ctx.dropout_p, ctx.softcap = scale, is_causal, dropout_p, softcap


def _slots_backward(ctx, grad):
    q, k, v, attn_mask, depth_weight, seed, out, *slots = ctx.saved_tensors
    slots_k, slots_v = slots[: ctx.n], slots[ctx.n :]
    mask_grad = bool(attn_mask is not None and attn_mask.is_floating_point() and ctx.needs_input_grad[3])
    dq, dk, dv, dmask, dkd, dvd, dlam = moda_attn_backward(
        grad, q, k, v, attn_mask, moda_slots_ref(slots_k), moda_slots_ref(slots_v), depth_weight, out,
        ctx.scale, ctx.is_causal, ctx.dropout_p, seed, ctx.softcap, mask_grad,
    )
    # [B, T, n, Hk, d] -> n x [B, Hk, T, d]: views of the stacked gradient
    return (
        dq, dk, dv, dmask if mask_grad else None, [g.transpose(1, 2) for g in dkd.unbind(2)],
        [g.transpose(1, 2) for g in dvd.unbind(2)], dlam if depth_weight is not None else None,
        None, None, None, None, None,
    )


moda_attn_slots.register_autograd(_slots_backward, setup_context=_slots_setup)

register_kernel_info(
    KernelInfo(
        op="depthrewrite::moda_attn_slots",
        forward="moda_attn's kernel (or reference) on the slots stacked token-major in one layout copy, freed after "
        "the call",
        backward="the slots stacked again (a layout copy), then depthrewrite::moda_attn_backward; the depth "
        "gradients go back to the slots as views",
        fuses="as moda_attn; autograd keeps each slot tensor once however many sites read it",
        falls_back=_FALLS_BACK,
    )
)


# ---- depthrewrite::moda_attn_slots_stack: the same attention, its earlier slots rows of one stacked tensor ----------
#
# As depthrewrite::depth_attn_stack (depth_attn/op.py): a block program reads the depth slots of the blocks before it
# as rows of one buffer the converted model fills once per forward (:func:`depthrewrite.blocks.source_stack`), keys
# ``stack_k`` ``[n, B, Hk, T, d]`` and values ``stack_v`` ``[n, B, Hk, T, dv]`` (any strides), and the slots it makes
# itself as ``extra_k`` / ``extra_v``. Blocks that differ only in ``n`` then share one program, compiled once with
# ``n`` a dynamic size. ``moda_attn_slots_stack(q, k, v, m, Sk, Sv, ek, ev, ...)`` equals
# ``moda_attn_slots(q, k, v, m, [*Sk, *ek], [*Sv, *ev], ...)``: the same token-major stack, the same kernel.


def moda_stack_slots(stack: torch.Tensor, extra: list[torch.Tensor]) -> torch.Tensor:
    """Token-major depth slots of the rows of ``stack`` ``[n, B, Hk, T, d]`` then the tensors ``extra``
    (``[B, Hk, T, d]`` each): ``[B, T, n + len(extra), Hk, d]``, contiguous, :func:`.reference.moda_slots_ref` of
    ``[*stack, *extra]`` (tensor operations only: no Python loop over a size that may be dynamic)."""
    rows = stack.permute(1, 3, 0, 2, 4)
    if extra:
        rows = torch.cat([rows, moda_slots_ref(extra)], dim=2)
    return rows.contiguous()


@torch.library.custom_op("depthrewrite::moda_attn_slots_stack", mutates_args=())
def moda_attn_slots_stack(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    stack_k: torch.Tensor,
    stack_v: torch.Tensor,
    extra_k: list[torch.Tensor],
    extra_v: list[torch.Tensor],
    depth_weight: torch.Tensor | None,
    scale: float,
    is_causal: bool,
    dropout_p: float,
    seed: torch.Tensor | None,
    softcap: float,
) -> torch.Tensor:
    """:func:`moda_attn_slots` over the slots ``[*stack_k, *extra_k]`` / ``[*stack_v, *extra_v]``; the stacks are kept
    for backward as they are (rows of the converted model's buffer, one copy of each slot)."""
    return _forward(q, k, v, attn_mask, moda_stack_slots(stack_k, extra_k), moda_stack_slots(stack_v, extra_v),
                    depth_weight, scale, is_causal, dropout_p, seed, softcap, "depthrewrite::moda_attn_slots_stack")


@moda_attn_slots_stack.register_fake
def _(q, k, v, attn_mask, stack_k, stack_v, extra_k, extra_v, depth_weight, scale, is_causal, dropout_p, seed,
      softcap):
    return _fake_out(q, v)


def _slots_stack_setup(ctx, inputs, output):
    q, k, v, attn_mask, stack_k, stack_v, extra_k, extra_v, depth_weight, scale, is_causal, dropout_p, seed, \
        softcap = inputs
    ctx.n = len(extra_k)
    ctx.save_for_backward(q, k, v, attn_mask, depth_weight, seed, output, stack_k, stack_v, *extra_k, *extra_v)
    ctx.scale, ctx.is_causal, ctx.dropout_p, ctx.softcap = scale, is_causal, dropout_p, softcap


def _slots_stack_backward(ctx, grad):
    q, k, v, attn_mask, depth_weight, seed, out, stack_k, stack_v, *extra = ctx.saved_tensors
    extra_k, extra_v = extra[: ctx.n], extra[ctx.n :]
    mask_grad = bool(attn_mask is not None and attn_mask.is_floating_point() and ctx.needs_input_grad[3])
    dq, dk, dv, dmask, dkd, dvd, dlam = moda_attn_backward(
        grad, q, k, v, attn_mask, moda_stack_slots(stack_k, extra_k), moda_stack_slots(stack_v, extra_v),
        depth_weight, out, ctx.scale, ctx.is_causal, ctx.dropout_p, seed, ctx.softcap, mask_grad,
    )
    n = stack_k.shape[0]
    # [B, T, n + e, Hk, d] -> the stack's [n, B, Hk, T, d] and e x [B, Hk, T, d]: views of the stacked gradient
    return (
        dq, dk, dv, dmask if mask_grad else None,
        dkd[:, :, :n].permute(2, 0, 3, 1, 4), dvd[:, :, :n].permute(2, 0, 3, 1, 4),
        [g.transpose(1, 2) for g in dkd[:, :, n:].unbind(2)], [g.transpose(1, 2) for g in dvd[:, :, n:].unbind(2)],
        dlam if depth_weight is not None else None, None, None, None, None, None,
    )


moda_attn_slots_stack.register_autograd(_slots_stack_backward, setup_context=_slots_stack_setup)

register_kernel_info(
    KernelInfo(
        op="depthrewrite::moda_attn_slots_stack",
        forward="moda_attn's kernel (or reference) on the stacked rows and the extra slots, laid out token-major in "
        "one copy, freed after the call",
        backward="the slots laid out again (a copy), then depthrewrite::moda_attn_backward; the depth gradients go "
        "back to the stacks and the extra slots as views",
        fuses="as moda_attn; the blocks before it keep each slot once, in the converted model's buffer",
        falls_back=_FALLS_BACK,
    )
)
