"""MoDA attention (mixture-of-depths attention), pure PyTorch. The one docstring of the op lives here.

    S_seq[j] = s · q_t · k_j        (sequence keys of this layer, masked as the model masks them)
    S_dep[i] = s · q_t · Kd_{t,i}   (depth slots: K/V that earlier sublayers wrote for the same token t)
    P        = softmax(concat(S_seq, λ-weighted S_dep))     one joint softmax, one scale, no gate
    o_t      = Σ_j P_seq[j] v_j + Σ_i P_dep[i] Vd_{t,i}

Zhu et al., *Mixture-of-Depths Attention*, arXiv:2603.15619; spec: shared/specs/moda.md §2, §5, §8 (Q8: λ).
Computed as the exact log-sum-exp merge of the sequence part (o_s, lse_s) and the depth part (o_d, lse_d):
``o = (e^{lse_s}·o_s + λ·e^{lse_d}·o_d) / (e^{lse_s} + λ·e^{lse_d})``, all in fp32, cast back once. Depth slots are
token-major ``[B, T, n, Hk, d]``; query head h reads KV head ⌊h / G⌋ (G = Hq / Hk) for sequence and depth alike.
"""

from __future__ import annotations

import math

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .._trace import tracing

__all__ = [
    "moda_attn_ref", "moda_slots_ref", "cpu_flash_applies", "cpu_flash_sequence", "merge_weights",
    "joint_probabilities",
]


def moda_slots_ref(keys: list[torch.Tensor]) -> torch.Tensor:
    """Token-major depth slots: n tensors ``[B, Hk, T, d]`` -> ``[B, T, n, Hk, d]`` (contiguous, a tensor of its
    own), written in one copy (stacked at the slot axis of the token-major views; a slot written as fed to attention
    is often token-major in memory already: RoPE keeps the k projection's layout, V is a view of it)."""
    return torch.stack([k.transpose(1, 2) for k in keys], dim=2).contiguous()  # contiguous(): a no-op, a guarantee


def cpu_flash_applies(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float, softcap: float
) -> bool:
    """Whether the sequence part can run PyTorch's CPU flash-attention kernel (which also returns the log-sum-exp the
    merge needs): CPU fp32/fp64 tensors of one dtype (the math is then fp32/fp64 throughout, as the explicit path's),
    no dropout, no soft-cap, a mask that is absent, boolean or of q's dtype, non-empty sequences, and one head dim for
    q, k and v (the kernel's own condition: MLA's narrower values take the explicit path)."""
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float64)
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and q.dim() == 4
        and v.shape[-1] == q.shape[-1]
        and dropout_p <= 0.0
        and softcap <= 0.0
        and (attn_mask is None or attn_mask.dtype in (torch.bool, q.dtype))
        and q.shape[2] > 0
        and k.shape[2] > 0
    )


def _flash_mask(attn_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The mask as the CPU flash kernel takes it: additive, q's dtype, 4-D."""
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill(~attn_mask, -math.inf)
    return attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))


def _has_key(mask: torch.Tensor, is_causal: bool, T: int, S: int) -> torch.Tensor:
    """``[B|1, H|1, T]``: whether each query row keeps at least one key under the additive 4-D ``mask`` (a ``-inf``
    entry drops a key) and, with ``is_causal``, the top-left causal mask."""
    keep = mask != -math.inf
    if is_causal:
        keep = keep & torch.ones(T, S, dtype=torch.bool, device=mask.device).tril()
    return keep.any(-1)


def cpu_flash_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, scale: float, is_causal: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The sequence part by the CPU flash kernel (only where :func:`cpu_flash_applies`).

    Returns ``(o_s [B, Hq, T, d], lse_s [B, Hq, T], k, v, mask)``: the normalised sequence output and its
    log-sum-exp, and the (GQA-expanded) keys, values and mask as passed to the kernel, for its backward."""
    key = (k, v, attn_mask, scale, is_causal)
    if tracing():  # the backward's call in the same joint trace reuses the forward's (see _SEQUENCE_MEMO)
        hit = _SEQUENCE_MEMO.get(q)
        same = hit is not None and all(
            a is b if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) else a == b for a, b in zip(hit[0], key)
        )
        if same:
            return hit[1]
    G = q.shape[1] // k.shape[1]
    if G > 1:
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    mask = _flash_mask(attn_mask, q.dtype)
    o_s, lse_s = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale
    )
    if mask is not None:  # a row without any key: the kernel says lse 0, o 0; the joint softmax needs lse = -inf
        lse_s = torch.where(_has_key(mask, is_causal, q.shape[2], k.shape[2]), lse_s, -math.inf)
    out = (o_s, lse_s, k, v, mask)
    if tracing():
        _SEQUENCE_MEMO[q] = (key, out)
    return out


#: While the compile backend traces MoDA as a decomposition (forward and backward in one joint graph), the forward's
#: flash-attention outputs per query tensor, so that the backward's recomputation of the same call reuses them (they
#: become activations saved for backward, as SDPA's are) instead of a second flash forward: the flash op is tagged
#: nondeterministic (dropout), so AOT autograd's CSE does not merge the two calls. Keyed by the traced tensors'
#: identities (the same objects, and the same scale and causality, or no reuse); weak, so it holds nothing alive.
_SEQUENCE_MEMO: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _logsumexp(x: torch.Tensor) -> torch.Tensor:
    """``logsumexp(x, -1, keepdim=True)``, -inf for a row without any finite entry, whose gradient is 0 (torch's
    logsumexp gives ``exp(-inf - -inf)`` = NaN there, which an additive -inf mask would pass on to q and k)."""
    if x.shape[-1] == 0:
        return x.new_full((*x.shape[:-1], 1), -math.inf)
    empty = x.detach().amax(-1, keepdim=True) == -math.inf
    return torch.where(empty, -math.inf, torch.logsumexp(torch.where(empty, 0.0, x), dim=-1, keepdim=True))


def merge_weights(
    lse_s: torch.Tensor, lse_d: torch.Tensor, lam: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weights of the two parts in the joint softmax, relative to one shift ``m``: ``a = e^{lse_s − m}``,
    ``b = λ·e^{lse_d − m}`` (λ ≡ 1 when ``lam`` is None; ``lam`` is λ already clamped at 0, straight-through or not).

    ``m = max(lse_s, lse_d + log λ)`` (detached: the merge does not depend on it), so λ = 0 gives ``b = 0`` exactly
    and never ``0·∞``, whatever ``lse_d − lse_s`` (an additive finfo.min mask leaves a row's sequence mass at
    ~1e-38). ``empty`` marks the rows where both weights are 0 — no visible sequence key (a pad query row under a
    padding mask) and λ = 0 — whose output the callers define as 0 with no gradient, as SDPA gives a row without
    keys; a left-padded batch otherwise gets 0/0 there, which the next layer's masked keys carry into every real
    position through the value product. λ's gradient passes through ``e^{lse_d − m}`` (finite, 0 on empty rows).

    Returns ``(a, b, empty, m)``; ``m`` finite."""
    loglam = None if lam is None else torch.log(lam.detach())  # -inf at λ = 0
    ld = lse_d.detach() if loglam is None else lse_d.detach() + loglam
    m = torch.maximum(lse_s.detach(), ld)
    empty = m == -math.inf
    m = torch.where(empty, lse_d.detach(), m)
    m = torch.where(torch.isfinite(m), m, 0.0)
    a = torch.exp(lse_s - m)
    if lam is None:
        return a, torch.exp(lse_d - m), empty, m
    b = torch.exp(lse_d - m + loglam)
    if lam.requires_grad:
        e = torch.exp(lse_d.detach() - m).clamp_max(torch.finfo(m.dtype).max)
        b = b + (lam - lam.detach()) * torch.where(empty, 0.0, e)  # value 0; ∂b/∂λ = e^{lse_d − m}
    return a, b, empty, m


def joint_probabilities(
    lse_s: torch.Tensor, lse_d: torch.Tensor, lam: torch.Tensor | None, depth_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the backward formulas (no autograd): ``(L, e_d, p_d)`` — the joint log-sum-exp with λ, +inf on empty rows
    (so that every probability ``exp(s − L)`` of such a row is 0, not ``exp(-inf + inf)``), the depth exp-weights
    without λ (``e^{S_dep − L}``, the λ gradient's, finite) and the depth probabilities with λ (``λ·e_d``, computed as
    ``e^{S_dep + log λ − L}``: exactly 0 at λ = 0). ``lam``: λ clamped at 0, or None."""
    a, b, empty, m = merge_weights(lse_s, lse_d, lam)
    L = torch.where(empty, math.inf, m + torch.log(torch.where(empty, 1.0, a + b)))
    e_d = torch.exp(depth_logits - L).clamp_max(torch.finfo(L.dtype).max)
    p_d = e_d if lam is None else torch.exp(depth_logits + torch.log(lam) - L)
    return L, e_d, p_d


def _dropout(p: torch.Tensor, rate: float, gen: torch.Generator | None) -> torch.Tensor:
    if rate <= 0.0:
        return p
    keep = torch.rand(p.shape, generator=gen, device=p.device, dtype=p.dtype) >= rate
    return p * keep / (1.0 - rate)


def moda_attn_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    depth_k: torch.Tensor,
    depth_v: torch.Tensor,
    depth_weight: torch.Tensor | None,
    scale: float,
    is_causal: bool,
    dropout_p: float = 0.0,
    seed: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Joint softmax over the sequence keys and the same-token depth slots.

    Args:
        q (Tensor): ``[B, Hq, T, d]``.
        k, v (Tensor): ``[B, Hk, S, d]`` sequence keys and ``[B, Hk, S, dv]`` values (Hq a multiple of Hk; the value
            head dim dv may differ from d, as in MLA).
        attn_mask (Tensor, optional): boolean (True = attend) or additive, broadcastable to ``[B, Hq, T, S]``;
            applies to the sequence part only.
        depth_k, depth_v (Tensor): ``[B, T, n, Hk, d]`` and ``[B, T, n, Hk, dv]`` token-major depth slots (n >= 1).
        depth_weight (Tensor, optional): λ ``[Hq]``, clamped at 0 (straight-through); None means λ = 1 (the paper).
        scale (float): the attention scale, shared by both parts.
        is_causal (bool): causal sequence mask (lower-triangular, top-left aligned, as SDPA's ``is_causal``).
        dropout_p (float): attention dropout on the joint probabilities. Default: 0.
        seed (Tensor, optional): int64 seed for the dropout masks, so backward recomputes the same ones.
        softcap (float): logit soft-capping ``c·tanh(x/c)`` on both parts (Gemma2); 0 disables it. Default: 0.

    Returns:
        Tensor ``[B, Hq, T, dv]`` in q's dtype, laid out like SDPA's output (``[B, T, Hq, d]`` in memory), since
        model code may ``view`` the transposed output without a ``contiguous()``.
    """
    acc = torch.promote_types(q.dtype, torch.float32)
    B, Hq, T, d = q.shape
    Hk, S = k.shape[1], k.shape[2]
    G = Hq // Hk
    qf = q.to(acc)
    # the same math by PyTorch's CPU flash kernel (no [B, Hq, T, S] logits in memory), except under autograd: its
    # log-sum-exp output has no gradient, so a differentiated reference takes the explicit path
    taped = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, attn_mask, depth_k, depth_v, depth_weight)
    )
    flash = not taped and cpu_flash_applies(q, k, v, attn_mask, dropout_p, softcap)
    if flash:
        o_s, lse_s = cpu_flash_sequence(q, k, v, attn_mask, scale, is_causal)[:2]
        lse_s = lse_s.unsqueeze(-1)
    else:
        kf = k.to(acc).repeat_interleave(G, dim=1)  # query head h -> KV head h // G
        vf = v.to(acc).repeat_interleave(G, dim=1)
        scores = (qf @ kf.transpose(-1, -2)) * scale  # [B, Hq, T, S]
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        if is_causal:
            keep = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()  # top-left aligned, as SDPA's is_causal
            scores = scores.masked_fill(~keep, -math.inf)
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                scores = scores.masked_fill(~attn_mask, -math.inf)
            else:
                scores = scores + attn_mask.to(acc)
        # the row's softmax normalised by its own sum, not by exp(lse): with an additive finfo.min mask (HF eager) a
        # fully masked row's logits and its lse are all ~-3.4e38 in fp32, where exp(scores - lse) is 1, not 1/S
        mx = scores.detach().amax(-1, keepdim=True) if S else scores.new_full((B, Hq, T, 1), -math.inf)
        no_key = mx == -math.inf
        mx = torch.where(no_key, 0.0, mx)
        e_s = torch.exp(scores - mx)
        z_s = torch.where(no_key, 1.0, e_s.sum(-1, keepdim=True))
        lse_s = torch.where(no_key, -math.inf, mx + torch.log(z_s))  # [B, Hq, T, 1]; -inf for a row without any key
    Kd = depth_k.to(acc).repeat_interleave(G, dim=3)  # [B, T, n, Hq, d]
    Vd = depth_v.to(acc).repeat_interleave(G, dim=3)
    dlog = torch.einsum("bhtd,btnhd->bhtn", qf, Kd) * scale  # [B, Hq, T, n]
    if softcap > 0:
        dlog = softcap * torch.tanh(dlog / softcap)
    lse_d = torch.logsumexp(dlog, dim=-1, keepdim=True)
    gen = None
    if dropout_p > 0.0 and seed is not None:
        gen = torch.Generator(device=q.device).manual_seed(int(seed.reshape(-1)[0]))
    # dropout commutes with the per-row merge weights below, so it can act on each part's own softmax
    if not flash:
        # a row without any key contributes nothing (e_s = 0): depth-only attention, as the kernel does
        o_s = _dropout(e_s / z_s, dropout_p, gen) @ vf
    o_d = torch.einsum("bhtn,btnhd->bhtd", _dropout(torch.exp(dlog - lse_d), dropout_p, gen), Vd)
    lam = None
    if depth_weight is not None:
        lam = depth_weight.to(acc)
        lam = (lam + (lam.clamp_min(0.0) - lam).detach()).view(1, Hq, 1, 1)  # λ >= 0 forward, gradient unchanged
    a, b, empty, _ = merge_weights(lse_s, lse_d, lam)
    # SDPA's layout ([B, T, Hq, dv] in memory) written by the merge itself: an elementwise op lays its output out as
    # its first operand with full strides (TensorIterator), so `a` ([B, Hq, T, 1], B·Hq·T values) laid out as
    # [B, T, Hq] makes every op below write that layout. No transpose-and-copy of the output, and the result is a
    # tensor of its own, not a transposed view (FSDP2 warns about a block that returns a view)
    a = a.transpose(1, 2).contiguous().transpose(1, 2)
    out = (a * o_s + b * o_d) / torch.where(empty, 1.0, a + b)  # an empty row (nothing visible): 0, as SDPA's
    return out.to(q.dtype)  # a cast (when there is one) keeps the layout
