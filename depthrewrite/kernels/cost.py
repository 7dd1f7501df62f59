"""What a training step costs, counted from what runs: FLOPs of every registered depth op, bytes of every op.

Importing this module registers a FLOP formula for every ``depthrewrite::*`` op (forward and backward) with
``torch.utils.flop_counter.register_flop_formula``, so ``FlopCounterMode`` counts our ops next to torch's matmuls;
``import depthrewrite`` does not import it. :class:`TrafficMode` counts the bytes every dispatched op moves (and
the FLOPs the same formulas give), and :func:`count_step` runs it over one forward + backward step of a model.

FLOP convention (the formulas below, one per op, from the argument shapes; each follows the op's PyTorch reference
term by term):

    a multiply-add = 2 FLOPs (torch's 2·M·N·K for a matmul); an add, multiply, subtract or max = 1;
    exp, log, rsqrt, sigmoid, tanh, div = 1 each; a sum of n terms = n; a dot product of length n = 2n;
    softmax over n = 5n (max, subtract, exp, sum, divide); log-sum-exp over n = 4n + 2 (max, subtract, exp, sum;
    log, add back); casts, stacks, pads and layout copies = 0 (they move bytes, computed nothing).

A backward op recomputes what it needs of the forward from the inputs (as the ops do: nothing but the inputs is
saved), then the gradients; both are counted. Two exceptions keep our counts comparable with torch's: the sequence
part of ``moda_attn`` (and its backward) is counted exactly as torch counts SDPA (the two matmuls forward, five
backward, full T×S: no causal discount, no softmax), so MoDA's extra is its depth part and the merge; and the
stacking of ``moda_attn_slots``'s slots (a layout copy) counts 0. Torch's own registry counts matmuls, convolutions
and attention only:
elementwise aten ops (norms, activations, residual adds, the loss) count 0 on both the vanilla and the converted
side, whereas our ops count all their arithmetic. The extra FLOPs of a converted model are therefore its depth ops'
arithmetic (plus any new matmul), an upper estimate of what a compute-bound kernel has to do.

Bytes (:class:`TrafficMode`): *unfused traffic*. Every op dispatched at the top level counts as if it read each of
its tensor inputs once and wrote each of its tensor outputs once (``numel · element_size`` of each, a view at its
viewed size, one tensor passed twice counted once). Pure view and metadata ops (``view``, ``transpose``,
``expand``, ``detach``, ...) and allocations (``empty``) move nothing and count 0; an overwrite (``copy_``,
``fill_``, ``zero_``) does not read its destination; ``embedding`` reads the rows it gathers, not the whole table.
A depth op is one op (its PyTorch reference runs below the mode and is not seen), so it counts as its fused Triton
kernel moves: its inputs once, its outputs once (``moda_attn_slots`` also the stack of its slots it writes and its
kernel reads). Nothing else is fused, so vanilla's elementwise chains count at
full unfused cost too: the extra bytes are a fraction of an unfused vanilla, the floor a compiler must beat on both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# importing an op package registers its ops (torch.ops.depthrewrite.*)
from .depth_attn import op as _depth_attn_op  # noqa: F401
from .mhc import op as _mhc_op  # noqa: F401
from .moda import op as _moda_op  # noqa: F401
from .msar import op as _msar_op  # noqa: F401

__all__ = [
    "FORMULAS",
    "EXTRA_ATEN_FORMULAS",
    "register_flop_formulas",
    "flop_formula",
    "flop_mapping",
    "op_bytes",
    "OpCost",
    "StepCost",
    "TrafficMode",
    "tensor_bytes",
    "count_step",
    "lm_step",
]

Shape = Sequence[int]


# ---- building blocks (FLOPs) ----------------------------------------------------------------------------------------


def _rows(shape: Shape, keep: int = 1) -> int:
    """Number of rows of a tensor: the product of all but its last ``keep`` dims."""
    return math.prod(shape[: len(shape) - keep])


def _rms(rows: int, d: int) -> int:
    """``rsqrt(mean(x²) + eps)`` per row of width d: sum of squares 2d, ``/d``, ``+eps``, rsqrt."""
    return rows * (2 * d + 3)


def _score(rows: int, d: int) -> int:
    """``(x · u) · r`` per row: a dot product 2d, then the multiply by the RMS factor."""
    return rows * (2 * d + 1)


def _softmax(n: int) -> int:
    """Softmax over n elements in all (max, subtract, exp, sum, divide)."""
    return 5 * n


def _lse(n: int, rows: int) -> int:
    """Log-sum-exp of n elements in all, reduced to ``rows`` results (max, subtract, exp, sum; log, add back)."""
    return 4 * n + 2 * rows


# ---- depth_attn, depth_attn_partial, depth_attn_merge ---------------------------------------------------------------


def depth_attn_flop(sources: list[Shape], query: Shape, gain: Shape, eps: float = 0.0, scale: float = 1.0,
                    *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """``h = scale · Σ_i softmax_i((v_i·u) r_i) v_i`` over K sources of N rows of width D."""
    K, N, D = len(sources), _rows(sources[0]), sources[0][-1]
    return (
        D  # u = γ ⊙ w
        + K * _rms(N, D)  # r_i
        + K * _score(N, D)  # s_i
        + _softmax(K * N)  # α
        + 2 * K * N * D  # Σ_i α_i v_i
        + N * D  # · scale
    )


def _partial_backward_flop(S: int, K: int, N: int, D: int, with_lse: bool) -> int:
    """The reference backward of the S-query mix (``_partial_backward_ref``): recompute, then the gradients."""
    recompute = S * D + K * _rms(N, D) + S * K * _score(N, D) + _softmax(S * K * N)
    skn = S * K * N
    grads = (
        2 * skn * D  # go · v_i
        + 3 * skn + (skn if with_lse else 0)  # inner = gv − Σ p·gv (+ grad_lse)
        + 2 * skn  # ds = p · inner, cu = ds · r
        + 2 * skn + 3 * K * N  # cv = r²/D · Σ_s ds·s
        + 2 * skn * D  # du = Σ cu v
        + 2 * S * D  # grad w, grad γ
        + K * (4 * S * N * D + 3 * N * D)  # dv_i = Σ_s p go + Σ_s cu u − cv v_i
    )
    return recompute + grads


def depth_attn_backward_flop(grad: Shape, sources: list[Shape], query: Shape, gain: Shape, eps: float = 0.0,
                             scale: float = 1.0, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """Gradients of :func:`depth_attn_flop`'s mix: ``grad · scale``, then the one-query backward."""
    K, N, D = len(sources), _rows(sources[0]), sources[0][-1]
    return N * D + _partial_backward_flop(1, K, N, D, with_lse=False)


def _stack_sources(stack: Shape, extra: list[Shape]) -> list[Shape]:
    return [tuple(stack[1:])] * stack[0] + list(extra)


def depth_attn_stack_flop(stack: Shape, extra: list[Shape], query: Shape, gain: Shape, *args: Any,
                          out_shape: Any = None, **kwargs: Any) -> int:
    """:func:`depth_attn_flop` of the sources ``[*stack, *extra]``."""
    return depth_attn_flop(_stack_sources(stack, extra), query, gain)


def depth_attn_stack_backward_flop(grad: Shape, stack: Shape, extra: list[Shape], query: Shape, gain: Shape,
                                   *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """:func:`depth_attn_backward_flop` of the sources ``[*stack, *extra]``."""
    return depth_attn_backward_flop(grad, _stack_sources(stack, extra), query, gain)


def depth_attn_partial_flop(sources: list[Shape], queries: Shape, gains: Shape, eps: float = 0.0,
                            *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """S queries against K sources: ``o = Σ_i softmax_i(s) v_i`` and ``lse`` per query and row."""
    K, N, D, S = len(sources), _rows(sources[0]), sources[0][-1], queries[0]
    return (
        S * D  # u_s
        + K * _rms(N, D)
        + S * K * _score(N, D)
        + _lse(S * K * N, S * N)
        + _softmax(S * K * N)
        + 2 * S * K * N * D  # o
    )


def depth_attn_partial_backward_flop(grad_o: Shape, grad_lse: Shape, sources: list[Shape], queries: Shape,
                                     gains: Shape, eps: float = 0.0, *args: Any, out_shape: Any = None,
                                     **kwargs: Any) -> int:
    K, N, D, S = len(sources), _rows(sources[0]), sources[0][-1], queries[0]
    return _partial_backward_flop(S, K, N, D, with_lse=True)


def depth_attn_merge_flop(o: Shape, lse: Shape, last: Shape, query: Shape, gain: Shape, eps: float = 0.0,
                          scale: float = 1.0, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """One more source merged into a partial mix by log-sum-exp."""
    N, D = _rows(last), last[-1]
    return (
        D  # u
        + _rms(N, D) + _score(N, D)  # the last source's r and s2
        + N + 4 * N  # m = max(lse, s2); a, b = exp(lse − m), exp(s2 − m)
        + 4 * N * D + N  # (a·o + b·v) / (a + b)
        + N * D  # · scale
    )


def depth_attn_merge_backward_flop(grad: Shape, o: Shape, lse: Shape, last: Shape, query: Shape, gain: Shape,
                                   eps: float = 0.0, scale: float = 1.0, *args: Any, out_shape: Any = None,
                                   **kwargs: Any) -> int:
    N, D = _rows(last), last[-1]
    return (
        D + _rms(N, D) + _score(N, D)  # recompute u, r, s2
        + 3 * N  # w1 = σ(lse − s2), w2 = 1 − w1
        + N * D  # g = grad · scale
        + 3 * N * D + 2 * N  # t = w1 w2 Σ g (v − o)
        + N  # cr = t r
        + 5 * N * D + 3 * N  # dv
        + 2 * N * D  # du = Σ cr v
        + N * D + N  # grad o, grad lse
        + 2 * D  # grad w, grad γ
    )


# ---- msar_mix ------------------------------------------------------------------------------------------------------


def _msar_dims(sources: list[Shape], query: Shape) -> tuple[int, int, int, int]:
    return len(sources), _rows(sources[0]), sources[0][-1], query[0]


def _msar_streams_flop(K: int, N: int, D: int, taps: list[int]) -> int:
    """The m stream views, their depth softmaxes and Z (``taps``: the m−1 conv lengths)."""
    m = len(taps) + 1
    conv = sum(2 * K * N * D * k for k in taps)  # causal depthwise convs, k multiply-adds per element
    per_stream = D + K * _rms(N, D) + K * _score(N, D) + _softmax(K * N) + 2 * K * N * D
    return conv + m * per_stream


def msar_mix_flop(sources: list[Shape], query: Shape, gain: Shape, conv: list[Shape], phi: Shape | None,
                  bias: Shape | None, alpha: Shape | None, eps: float = 0.0, scale: float = 1.0,
                  conv_values: bool = True, sigmoid_mixer: bool = True, *args: Any, out_shape: Any = None,
                  **kwargs: Any) -> int:
    """m stream views of K sources, a depth softmax per view, a sigmoid (or mean) mixer over the m results."""
    K, N, D, m = _msar_dims(sources, query)
    total = _msar_streams_flop(K, N, D, [w[-1] for w in conv])
    if sigmoid_mixer and phi is not None:
        total += _rms(N, m * D) + N * m * D  # RMS-normed flat Z
        total += 2 * N * (m * D) * m  # @ φ
        total += 3 * N * m  # α·, +b, σ
    return total + 2 * N * m * D + N * D  # Σ_r g_r Z_r, · scale


def msar_mix_backward_flop(grad: Shape, sources: list[Shape], query: Shape, gain: Shape, conv: list[Shape],
                           phi: Shape | None, bias: Shape | None, alpha: Shape | None, eps: float = 0.0,
                           scale: float = 1.0, conv_values: bool = True, sigmoid_mixer: bool = True, *args: Any,
                           out_shape: Any = None, **kwargs: Any) -> int:
    """The reference backward (``_backward_ref``): recompute views, softmaxes and mixer, then every gradient."""
    K, N, D, m = _msar_dims(sources, query)
    taps = [w[-1] for w in conv]
    total = _msar_streams_flop(K, N, D, taps)
    if sigmoid_mixer and phi is not None:
        mD = m * D
        total += _rms(N, mD) + 2 * N * mD * m + 3 * N * m + N  # ρ, p = Z φ, g
        total += 2 * N * mD + 4 * N * m  # e = c (dh·Z_r) g (1 − g)
        total += 2 * N * m + 2 * N * m + 4 * N  # dp, c_z
        total += 4 * N * mD + 2 * N * m * mD + N * m  # dZ = c g dh + φ dp + c_z Z
        total += 2 * N * mD * m + N * m + 3 * N * m  # dφ, db, dα
    else:
        total += N * D  # dZ = c/m · dh
    skn = K * N
    total += m * (10 * skn * D + 10 * skn)  # da, ds, c1/c2, du, dV, the value path, dX
    total += sum(4 * skn * D * k for k in taps)  # transposed conv and tap gradients
    return total + 2 * m * D  # grad w, grad γ


def msar_mix_stack_flop(stack: Shape, extra: list[Shape], query: Shape, gain: Shape, conv: list[Shape],
                        phi: Shape | None, bias: Shape | None, alpha: Shape | None, eps: float = 0.0,
                        scale: float = 1.0, per_source: bool = False, conv_values: bool = True,
                        sigmoid_mixer: bool = True, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """:func:`msar_mix_flop` of the sources ``[*stack, *extra]``."""
    return msar_mix_flop(_stack_sources(stack, extra), query, gain, conv, phi, bias, alpha, eps, scale, conv_values,
                         sigmoid_mixer)


def msar_mix_stack_backward_flop(grad: Shape, stack: Shape, extra: list[Shape], query: Shape, gain: Shape,
                                 conv: list[Shape], phi: Shape | None, bias: Shape | None, alpha: Shape | None,
                                 eps: float = 0.0, scale: float = 1.0, per_source: bool = False,
                                 conv_values: bool = True, sigmoid_mixer: bool = True, *args: Any,
                                 out_shape: Any = None, **kwargs: Any) -> int:
    """:func:`msar_mix_backward_flop` of the sources ``[*stack, *extra]``."""
    return msar_mix_backward_flop(grad, _stack_sources(stack, extra), query, gain, conv, phi, bias, alpha, eps, scale,
                                  conv_values, sigmoid_mixer)


# ---- mHC -----------------------------------------------------------------------------------------------------------


def _sinkhorn_flop(n: int, iters: int) -> int:
    """One token's Sinkhorn: softmax over outputs, +eps, then 2·iters − 1 normalisations (sum, +eps, divide)."""
    return _softmax(n * n) + n * n + (2 * iters - 1) * (2 * n * n + n)


def _sinkhorn_backward_flop(n: int, iters: int) -> int:
    """One token's Sinkhorn backward: the forward iterates again, 5n² per normalisation back, the softmax's 4n²."""
    return _sinkhorn_flop(n, iters) + (2 * iters - 1) * 5 * n * n + 4 * n * n


def _mhc_dims(X: Shape, phi: Shape) -> tuple[int, int, int, int]:
    """(tokens N, streams n, width D, coefficient columns M = n² + 2n)."""
    return _rows(X, 2), X[-2], X[-1], phi[-1]


def mhc_coeffs_flop(X: Shape, phi: Shape, bias: Shape, alpha: Shape, iters: int = 20, eps: float = 0.0,
                    *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """H_pre, H_post, H_res from the RMS-normed flat state: one [n·D, M] projection, σ's and Sinkhorn."""
    N, n, D, M = _mhc_dims(X, phi)
    per_token = (
        2 * n * D * M  # x⃗ @ φ
        + (2 * n * D + 3) + M  # · r
        + 4 * n + 4 * n  # H_pre = σ(α·m + b) + ε, H_post = 2σ(α·m + b)
        + 2 * n * n  # Sinkhorn logits α·m + b
        + _sinkhorn_flop(n, iters)
    )
    return N * per_token


def mhc_coeffs_backward_flop(X: Shape, phi: Shape, bias: Shape, alpha: Shape, gpre: Shape, gpost: Shape,
                             gres: Shape, iters: int = 20, eps: float = 0.0, *args: Any, out_shape: Any = None,
                             **kwargs: Any) -> int:
    N, n, D, M = _mhc_dims(X, phi)
    per_token = (
        (2 * n * D + 3) + 2 * n * D * M + M  # recompute r, mix
        + 6 * n + 2 * n * n  # σ arguments and σ of pre/post, Sinkhorn logits
        + 3 * n + 4 * n  # grads of the σ arguments
        + _sinkhorn_backward_flop(n, iters)
        + M + M + 2 * M  # gmix, grad bias, grad α
        + M + 2 * M + 3  # gz, the RMS term c
        + 2 * M * n * D + 2 * n * D  # grad X = gz φᵀ − c x⃗
        + 2 * n * D * M  # grad φ = x⃗ᵀ gz
    )
    return N * per_token


def mhc_pre_flop(X: Shape, pre: Shape, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """u = Σ_i H_pre[i] X_i."""
    return 2 * math.prod(X)


def mhc_pre_backward_flop(X: Shape, pre: Shape, gu: Shape, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """grad X = H_pre ⊗ gu (1 per element), grad H_pre = Σ_d gu X (2 per element)."""
    return 3 * math.prod(X)


def mhc_post_flop(X: Shape, res: Shape, post: Shape, y: Shape, *args: Any, out_shape: Any = None,
                  **kwargs: Any) -> int:
    """X' = H_res X + H_postᵀ y: an [n, n] @ [n, D] per token, then n·D multiplies and adds."""
    N, n, D = _rows(X, 2), X[-2], X[-1]
    return N * (2 * n * n * D + 2 * n * D)


def mhc_post_backward_flop(X: Shape, res: Shape, post: Shape, y: Shape, gout: Shape, *args: Any,
                           out_shape: Any = None, **kwargs: Any) -> int:
    """grad X = H_resᵀ g, grad H_res = g Xᵀ, grad H_post = Σ_d g y, grad y = Σ_i H_post g."""
    N, n, D = _rows(X, 2), X[-2], X[-1]
    return N * (4 * n * n * D + 4 * n * D)


def mhc_collapse_flop(X: Shape, mode: str = "mean", *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """The n streams summed (and divided by n for ``"mean"``)."""
    return math.prod(X) + (math.prod(X) // X[-2] if mode == "mean" else 0)


# ---- MoDA ----------------------------------------------------------------------------------------------------------


def _moda_dims(q: Shape, depth_k: Shape, depth_v: Shape) -> tuple[int, int, int, int]:
    """(query rows R = B·Hq·T, depth slots n, query/key head dim d, value head dim dv: MLA's differs from d)."""
    B, Hq, T, d = q
    return B * Hq * T, depth_k[2], d, depth_v[-1]


def moda_attn_flop(q: Shape, k: Shape, v: Shape, attn_mask: Shape | None, depth_k: Shape, depth_v: Shape,
                   depth_weight: Shape | None, scale: float = 1.0, is_causal: bool = False, dropout_p: float = 0.0,
                   seed: Shape | None = None, softcap: float = 0.0, *args: Any, out_shape: Any = None,
                   **kwargs: Any) -> int:
    """The sequence part as torch counts SDPA; the depth slots and the log-sum-exp merge term by term."""
    R, n, d, dv = _moda_dims(q, depth_k, depth_v)
    depth = (
        2 * R * n * d + R * n  # q · Kd, · scale
        + (3 * R * n if softcap > 0 else 0)  # c · tanh(x / c)
        + _lse(R * n, R)
        + 2 * R * n  # exp(dlog − lse_d)
        + 2 * R * n * dv  # o_d
    )
    merge = 5 * R + (R if depth_weight is not None else 0) + 4 * R * dv + R
    return flop_counter.sdpa_flop_count(q, k, v) + depth + merge


def moda_attn_backward_flop(grad: Shape, q: Shape, k: Shape, v: Shape, attn_mask: Shape | None, depth_k: Shape,
                            depth_v: Shape, depth_weight: Shape | None, out: Shape, scale: float = 1.0,
                            is_causal: bool = False, dropout_p: float = 0.0, seed: Shape | None = None,
                            softcap: float = 0.0, mask_grad: bool = False, *args: Any, out_shape: Any = None,
                            **kwargs: Any) -> int:
    """The sequence part as torch counts SDPA's backward; the depth part recomputed, then its gradients."""
    R, n, d, dv = _moda_dims(q, depth_k, depth_v)
    lam = depth_weight is not None
    cap = softcap > 0
    depth = (
        2 * R * n * d + R * n + (3 * R * n if cap else 0)  # recompute depth logits
        + _lse(R * n, R) + 5 * R + (R if lam else 0) + 2 * R  # lse_d, merge weights, joint LSE
        + 2 * R * n + (R * n if lam else 0)  # e_d, p_d
        + 2 * R * dv  # δ = rowsum(do · o)
        + 2 * R * n * dv  # dP_d = do · Vd
        + 2 * R * n  # dS_d = p_d (dP_d − δ)
        + (3 * R * n if lam else 0)  # dλ
        + (4 * R * n if cap else 0)  # soft-cap chain rule
        + 2 * R * n * d + 2 * R * d  # dq += dS_d Kd, · scale
        + 3 * R * n * d  # dKd (with scale)
        + 2 * R * n * dv  # dVd
    )
    return flop_counter.sdpa_backward_flop_count(grad, q, k, v) + depth


def moda_attn_slots_flop(q: Shape, k: Shape, v: Shape, attn_mask: Shape | None, slots_k: list[Shape],
                         slots_v: list[Shape], *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """:func:`moda_attn_flop` of the slots stacked token-major (the stack is a layout copy: no arithmetic)."""
    def stacked(slots: list[Shape]) -> Shape:
        B, Hk, T, d = slots[0]
        return (B, T, len(slots), Hk, d)

    return moda_attn_flop(q, k, v, attn_mask, stacked(slots_k), stacked(slots_v), *args, **kwargs)


def moda_attn_slots_stack_flop(q: Shape, k: Shape, v: Shape, attn_mask: Shape | None, stack_k: Shape, stack_v: Shape,
                               extra_k: list[Shape], extra_v: list[Shape], *args: Any, out_shape: Any = None,
                               **kwargs: Any) -> int:
    """:func:`moda_attn_slots_flop` of the slots ``[*stack, *extra]``."""
    return moda_attn_slots_flop(q, k, v, attn_mask, _stack_sources(stack_k, extra_k), _stack_sources(stack_v, extra_v),
                                *args, **kwargs)


#: op name (``torch.ops.depthrewrite.<name>``) -> FLOP formula over argument shapes
FORMULAS: dict[str, Callable[..., int]] = {
    "depth_attn": depth_attn_flop,
    "depth_attn_backward": depth_attn_backward_flop,
    "depth_attn_stack": depth_attn_stack_flop,
    "depth_attn_stack_backward": depth_attn_stack_backward_flop,
    "msar_mix_stack": msar_mix_stack_flop,
    "msar_mix_stack_backward": msar_mix_stack_backward_flop,
    "depth_attn_partial": depth_attn_partial_flop,
    "depth_attn_partial_backward": depth_attn_partial_backward_flop,
    "depth_attn_merge": depth_attn_merge_flop,
    "depth_attn_merge_backward": depth_attn_merge_backward_flop,
    "msar_mix": msar_mix_flop,
    "msar_mix_backward": msar_mix_backward_flop,
    "mhc_coeffs": mhc_coeffs_flop,
    "mhc_pre": mhc_pre_flop,
    "mhc_post": mhc_post_flop,
    "mhc_collapse": mhc_collapse_flop,
    "mhc_coeffs_backward": mhc_coeffs_backward_flop,
    "mhc_pre_backward": mhc_pre_backward_flop,
    "mhc_post_backward": mhc_post_backward_flop,
    "moda_attn": moda_attn_flop,
    "moda_attn_backward": moda_attn_backward_flop,
    "moda_attn_slots": moda_attn_slots_flop,
    "moda_attn_slots_stack": moda_attn_slots_stack_flop,
}


# ---- aten ops torch's registry misses on CPU ---------------------------------------------------------------------


def _cpu_sdpa_flop(query: Shape, key: Shape, value: Shape, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return flop_counter.sdpa_flop_count(query, key, value)


def _cpu_sdpa_backward_flop(grad_out: Shape, query: Shape, key: Shape, value: Shape, *args: Any,
                            out_shape: Any = None, **kwargs: Any) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)


#: SDPA's CPU kernels, which torch's registry does not know (it would count CPU attention as 0): counted as torch
#: counts the CUDA ones. Used by :class:`TrafficMode` only, not registered globally.
EXTRA_ATEN_FORMULAS: dict[Any, Callable[..., int]] = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flop,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flop,
}


def register_flop_formulas() -> None:
    """Register :data:`FORMULAS` with ``torch.utils.flop_counter`` (idempotent; runs on import of this module).

    ``FlopCounterMode`` copies the registry when it is constructed: construct it after this ran.
    """
    for name, formula in FORMULAS.items():
        packet = getattr(torch.ops.depthrewrite, name)
        if packet not in flop_counter.flop_registry:
            flop_counter.register_flop_formula(packet)(formula)


register_flop_formulas()


def flop_mapping() -> dict[Any, Callable[..., int]]:
    """Overload packet -> formula over raw arguments (``out_val=``): torch's registry (ours included), the CPU SDPA
    ops. A snapshot: formulas registered later are not in it."""
    extra = {k: flop_counter.shape_wrapper(f) for k, f in EXTRA_ATEN_FORMULAS.items()}
    return {**flop_counter.flop_registry, **extra}


def flop_formula(func: Any) -> Callable[..., int] | None:
    """The FLOP formula for an op overload (or packet), over raw arguments plus ``out_val=``; None when it has none."""
    return flop_mapping().get(getattr(func, "_overloadpacket", func))


# ---- bytes ---------------------------------------------------------------------------------------------------------

_aten = torch.ops.aten
#: ops that move no data: views and metadata (checked besides ``OpOverload.is_view``) and bare allocations
_FREE = {
    _aten.view, _aten._unsafe_view, _aten.reshape, _aten.transpose, _aten.t, _aten.expand, _aten.permute,
    _aten.detach, _aten.alias, _aten.slice, _aten.select, _aten.unsqueeze, _aten.squeeze, _aten.as_strided,
    _aten.unbind, _aten.split, _aten.split_with_sizes, _aten.chunk, _aten.unflatten, _aten.flatten, _aten.narrow,
    _aten.lift_fresh, _aten.empty, _aten.empty_like, _aten.empty_strided, _aten.new_empty,
    _aten.new_empty_strided, _aten._reshape_alias, _aten.view_as, _aten.expand_as, _aten.resize_,
    _aten.set_, _aten.sym_size, _aten.sym_stride, _aten.sym_numel, _aten.sym_storage_offset, _aten.size,
    _aten.stride, _aten.is_contiguous, _aten.is_same_size, _aten.promote_types, _aten._local_scalar_dense,
}
#: in-place ops that overwrite their first argument without reading it
_OVERWRITE = {_aten.copy_, _aten.fill_, _aten.zero_}
#: gathers: read as many table rows as they write, not the whole table (first argument)
_GATHER = {_aten.embedding, _aten.index_select}


def tensor_bytes(t: torch.Tensor) -> int:
    """``numel · element_size``: what reading or writing ``t`` once moves (a view at its viewed size)."""
    return t.numel() * t.element_size()


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The distinct tensors of a pytree (by identity), in order."""
    seen, out = set(), []
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor) and id(leaf) not in seen:
            seen.add(id(leaf))
            out.append(leaf)
    return out


def op_bytes(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """Unfused traffic of one op call: its tensor inputs read once, its tensor outputs written once."""
    packet = getattr(func, "_overloadpacket", func)
    if packet in _FREE or getattr(func, "is_view", False):
        return 0
    written = sum(tensor_bytes(t) for t in _tensors(out))
    inputs = _tensors((args, kwargs))
    if packet in _OVERWRITE or packet in _GATHER:
        inputs = inputs[1:]  # the destination is written, not read; a gather reads `written` bytes of its table
        if packet in _GATHER:
            written *= 2
    if str(packet) == "depthrewrite.moda_attn_slots":  # its slots are stacked before the kernel: written, read again
        written += 2 * sum(tensor_bytes(t) for t in _tensors((args[4], args[5])))
    if str(packet) == "depthrewrite.moda_attn_slots_stack":  # the same, of its stacks and extra slots
        written += 2 * sum(tensor_bytes(t) for t in _tensors(args[4:8]))
    return written + sum(tensor_bytes(t) for t in inputs)


@dataclass
class OpCost:
    """What the calls of one op added up to."""

    calls: int = 0
    flops: int = 0
    bytes: int = 0


class TrafficMode(TorchDispatchMode):
    """Counts, per op overload packet, the calls, FLOPs (registered formulas) and unfused bytes of every op
    dispatched while active (see the module docstring). A depth op is one call: its reference runs below the mode.

    Uses no module hooks (``FlopCounterMode`` registers a global one, which a converted model refuses), so it can
    wrap a converted model's training step.

    Example::

        with TrafficMode() as tm:
            model(ids, labels=ids).loss.backward()
        tm.flops, tm.bytes, tm.by_op["depthrewrite.depth_attn"]
    """

    def __init__(self) -> None:
        super().__init__()
        self.by_op: dict[str, OpCost] = {}
        self._formulas = flop_mapping()

    @property
    def flops(self) -> int:
        return sum(c.flops for c in self.by_op.values())

    @property
    def bytes(self) -> int:
        return sum(c.bytes for c in self.by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = getattr(func, "_overloadpacket", func)
        formula = self._formulas.get(packet)
        cost = self.by_op.setdefault(str(packet), OpCost())
        cost.calls += 1
        cost.flops += _flops(formula, args, kwargs, out) if formula is not None else 0
        cost.bytes += op_bytes(func, args, kwargs, out)
        return out


def _heads_repeated(x: Any, heads: int) -> Any:
    """A meta stand-in for a 4-D (batch, heads, seq, dim) tensor whose head count divides ``heads``, with ``heads``."""
    if isinstance(x, torch.Tensor) and x.dim() == 4 and x.shape[1] < heads and heads % x.shape[1] == 0:
        return torch.empty(x.shape[0], heads, *x.shape[2:], dtype=x.dtype, device="meta")
    if isinstance(x, (tuple, list)):
        return type(x)(_heads_repeated(y, heads) for y in x)
    return x


def _flops(formula: Callable, args: tuple, kwargs: dict, out: Any) -> int:
    """``formula``'s count; for attention with grouped K/V heads (GQA: the CUDA kernels take K and V with fewer
    heads than Q, which torch's sdpa formulas reject), the count with K/V repeated to Q's heads: what they compute."""
    try:
        return int(formula(*args, **kwargs, out_val=out))
    except AssertionError:
        heads = max((a.shape[1] for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor) and a.dim() == 4),
                    default=0)
        if not heads:
            raise
        return int(formula(*_heads_repeated(args, heads), **kwargs, out_val=_heads_repeated(out, heads)))


# ---- one training step ---------------------------------------------------------------------------------------------


@dataclass
class StepCost:
    """FLOPs and unfused bytes of one forward + backward step, with the op breakdown."""

    flops: int
    bytes: int
    tokens: int
    by_op: dict[str, OpCost] = field(default_factory=dict)

    @property
    def flops_per_token(self) -> float:
        return self.flops / self.tokens

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / self.tokens

    def part(self, prefix: str) -> OpCost:
        """The summed cost of the ops whose name starts with ``prefix`` (``"depthrewrite."``: every depth op)."""
        got = OpCost()
        for name, c in self.by_op.items():
            if name.startswith(prefix):
                got.calls, got.flops, got.bytes = got.calls + c.calls, got.flops + c.flops, got.bytes + c.bytes
        return got


def lm_step(model: torch.nn.Module, ids: torch.Tensor) -> None:
    """One training step of a causal LM that takes ``labels`` (Hugging Face): forward, loss, backward."""
    model(ids, labels=ids).loss.backward()


def count_step(
    model: torch.nn.Module,
    make_inputs: Callable[[], torch.Tensor],
    step: Callable[[torch.nn.Module, torch.Tensor], None] = lm_step,
    warmup: bool = True,
) -> StepCost:
    """FLOPs and unfused bytes of one forward + backward ``step(model, make_inputs())`` (default: :func:`lm_step`).

    Runs one uncounted step first when ``warmup`` (a converted model captures its graph on its first call) and clears
    the gradients before and after the counted step (``set_to_none``: the counted step allocates them, as a training
    step after ``zero_grad`` does). ``tokens`` is the inputs' ``numel``.
    """
    ids = make_inputs()
    if warmup:
        step(model, ids)
    model.zero_grad(set_to_none=True)
    with TrafficMode() as tm:
        step(model, ids)
    model.zero_grad(set_to_none=True)
    return StepCost(tm.flops, tm.bytes, ids.numel(), dict(tm.by_op))
