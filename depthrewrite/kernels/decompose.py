"""Depth ops as decompositions: what ``torch.compile(backend="depthrewrite")`` lowers a depth op to when no Triton
kernel would run it, so inductor fuses the op's arithmetic with its neighbours instead of calling it as an opaque
extern kernel.

A registered depth op (``torch.ops.depthrewrite.*``) stays one node in Dynamo's graph and in exported graphs. When
AOT autograd traces that graph (forward and backward, through the op's registered autograd formula), the backend
hands it :func:`decompositions`: each entry asks the op's own routing (:func:`~depthrewrite.kernels.dispatch.would_fuse`
on the fake tensors of the call: the kernel backend, the device, then the op's ``covers`` gate) and

- returns ``NotImplemented`` when the fused Triton kernel would run: the op stays one extern node and the kernel
  runs, exactly as without this table;
- otherwise returns the PyTorch reference traced into aten ops: the forward op becomes its ``*_ref`` function, the
  backward op (``*_backward``) its hand-written reference formulas. The registered autograd formulas are unchanged,
  so the backward still recomputes from the op's inputs (except MoDA's CPU flash-attention call, which the backward
  reuses from the forward in the same joint trace: :data:`.moda.reference._SEQUENCE_MEMO`) and both directions reach
  inductor as plain aten ops.

The routing is asked when the graph is compiled (Dynamo does not guard on the kernel backend): switching the backend
afterwards needs ``torch._dynamo.reset()`` and a new compile.

References must therefore be functional: no in-place writes, even into their own intermediates (AOT autograd
traces decompositions below its functionalization; ``tests/test_decompose.py`` fails on any in-place op). The
result is the same math the op body would have run (the same reference functions), so a compiled model computes
what the eager one does; tests check forward and backward against the registered op. Calls that cannot be traced stay
opaque: MoDA with attention dropout (its reference draws seeded ``torch.rand`` masks from a generator).

``decompositions(counts)`` counts what it decomposed, per op (the backend shows it in ``depthrewrite.explain()``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from ._trace import traced, tracing
from .dispatch import would_fuse

__all__ = ["decompositions", "DECOMPOSABLE", "tracing"]



def _depth_attn_entries() -> dict[str, tuple[Callable, Callable]]:
    from .depth_attn import op as m
    from .depth_attn.reference import depth_attn_merge_ref, depth_attn_partial_ref, depth_attn_ref

    return {
        "depth_attn": (m.depth_attn, depth_attn_ref),
        "depth_attn_backward": (m.depth_attn_backward, m._backward_ref),
        "depth_attn_partial": (m.depth_attn_partial, depth_attn_partial_ref),
        "depth_attn_partial_backward": (m.depth_attn_partial_backward, m._partial_backward_ref),
        "depth_attn_merge": (m.depth_attn_merge, depth_attn_merge_ref),
        "depth_attn_merge_backward": (m.depth_attn_merge_backward, m._merge_backward_ref),
        "depth_attn_stack": (m.depth_attn_stack, m.depth_attn_stack_ref),
        "depth_attn_stack_backward": (m.depth_attn_stack_backward, m._stack_backward_ref),
    }


def _msar_entries() -> dict[str, tuple[Callable, Callable]]:
    from .msar import op as m
    from .msar.reference import msar_mix_ref

    def mix(sources, query, gain, conv, phi, bias, alpha, eps, scale, conv_values, sigmoid_mixer, eps_mix=1e-6,
            left=None):
        # the op's signature (eps_mix may come positionally; the reference has ``left`` in that place)
        return msar_mix_ref(sources, query, gain, conv, phi, bias, alpha, eps, scale, conv_values, sigmoid_mixer,
                            left=left, eps_mix=eps_mix)

    return {
        "msar_mix": (m.msar_mix, mix),
        "msar_mix_backward": (m.msar_mix_backward, m._backward_ref),
        "msar_mix_stack": (m.msar_mix_stack, m.msar_mix_stack_ref),
        "msar_mix_stack_backward": (m.msar_mix_stack_backward, m._stack_backward_ref),
    }


def _mhc_entries() -> dict[str, tuple[Callable, Callable]]:
    from .mhc import op as m
    from .mhc.reference import mhc_coeffs_ref, mhc_collapse_ref, mhc_post_ref, mhc_pre_ref

    return {
        "mhc_coeffs": (m.mhc_coeffs, mhc_coeffs_ref),
        "mhc_pre": (m.mhc_pre, mhc_pre_ref),
        "mhc_post": (m.mhc_post, mhc_post_ref),
        "mhc_collapse": (None, mhc_collapse_ref),
        "mhc_coeffs_backward": (m.mhc_coeffs_backward, m._coeffs_backward_ref),
        "mhc_pre_backward": (m.mhc_pre_backward, m._pre_backward_ref),
        "mhc_post_backward": (m.mhc_post_backward, m._post_backward_ref),
    }


def _moda_entries() -> dict[str, tuple[Callable, Callable]]:
    from .moda import op as m
    from .moda.reference import moda_attn_ref, moda_slots_ref

    def attn(q, k, v, attn_mask, depth_k, depth_v, depth_weight, scale, is_causal, dropout_p, seed, softcap):
        if dropout_p > 0.0:  # seeded masks from a torch.Generator: not traceable; the op runs as it is
            return NotImplemented
        return moda_attn_ref(q, k, v, attn_mask, depth_k, depth_v, depth_weight, scale, is_causal, 0.0, None, softcap)

    def attn_bwd(grad, q, k, v, attn_mask, depth_k, depth_v, depth_weight, out, scale, is_causal, dropout_p, seed,
                 softcap, mask_grad):
        if dropout_p > 0.0:
            return NotImplemented
        args = [q, k, v, attn_mask, depth_k, depth_v, depth_weight, scale, is_causal, 0.0, None, softcap]
        got = m._reference_grads(grad, args, mask_grad)
        like = (q, k, v, attn_mask if mask_grad else None, depth_k, depth_v, depth_weight)
        return tuple(
            q.new_empty(0) if x is None else torch.zeros_like(x) if g is None else g.to(x.dtype)
            for g, x in zip(got, like)
        )

    def attn_slots(q, k, v, attn_mask, slots_k, slots_v, depth_weight, scale, is_causal, dropout_p, seed, softcap):
        return attn(q, k, v, attn_mask, moda_slots_ref(slots_k), moda_slots_ref(slots_v), depth_weight, scale,
                    is_causal, dropout_p, seed, softcap)

    def attn_slots_stack(q, k, v, attn_mask, stack_k, stack_v, extra_k, extra_v, depth_weight, scale, is_causal,
                         dropout_p, seed, softcap):
        return attn(q, k, v, attn_mask, m.moda_stack_slots(stack_k, extra_k), m.moda_stack_slots(stack_v, extra_v),
                    depth_weight, scale, is_causal, dropout_p, seed, softcap)

    return {
        "moda_attn": (m.moda_attn, attn),
        "moda_attn_slots": (m.moda_attn_slots, attn_slots),
        "moda_attn_slots_stack": (m.moda_attn_slots_stack, attn_slots_stack),
        "moda_attn_backward": (m.moda_attn_backward, attn_bwd),
    }


def _entries() -> dict[str, tuple[Callable | None, Callable]]:
    """op name -> (the registered op, or None for a reference-only op; its decomposition)."""
    return {**_depth_attn_entries(), **_msar_entries(), **_mhc_entries(), **_moda_entries()}


DECOMPOSABLE: tuple[str, ...] = tuple(_entries())
"""Every depth op :func:`decompositions` has an entry for (a test checks it is every registered op)."""


def _entry(name: str, op: Any, ref: Callable, counts: Counter | None) -> Callable:
    body = getattr(op, "_init_fn", None) if op is not None else None

    def decomposed(*args: Any, **kwargs: Any) -> Any:
        if body is not None and would_fuse(body, *args, **kwargs):
            return NotImplemented  # the Triton kernel runs: keep the op
        with traced():
            out = ref(*args, **kwargs)  # references are functional (no in-place writes): AOT autograd needs that here
        if out is not NotImplemented and counts is not None:
            counts[name] += 1
        return out

    decomposed.__name__ = f"decompose_{name}"
    return decomposed


def decompositions(counts: Counter | None = None) -> dict[torch._ops.OpOverload, Callable]:
    """A decomposition table (``{OpOverload: fn}``, for AOT autograd / inductor's ``decompositions=``) with an entry
    per depth op: the op's PyTorch reference where its Triton kernel would not run, ``NotImplemented`` (keep the op)
    where it would. ``counts``, if given, counts each op name it decomposed (one per traced call)."""
    table = {}
    for name, (op, ref) in _entries().items():
        overload = getattr(torch.ops.depthrewrite, name).default
        table[overload] = _entry(name, op, ref, counts)
    return table
