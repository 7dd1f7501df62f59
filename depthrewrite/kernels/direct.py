"""The ops' own Python bodies called directly, for a plain eager call that needs nothing of the dispatcher.

A call of a ``torch.library.custom_op`` passes through the dispatcher, the op's Python autograd kernel, its backend
wrapper and a ``torch._dynamo.disable`` frame before it reaches the body: about 20 µs on a CPU. At a decoding step
(one token, no gradient) that is a third of a depth op's cost and, with a handful of depth ops per block, a
visible share of a generated token's time (bench/generation.py). None of those layers does anything for such a call:
no gradient is recorded, no mode or tracer is watching, every tensor is a plain tensor.

:func:`direct_forward` gives a graph module's code with each ``depthrewrite`` op replaced by a function that calls the
op's body when its tensors are plain ``torch.Tensor`` and the op itself otherwise (a DTensor, a fake tensor, any
subclass); :func:`plain_eager` says whether the whole call qualifies: gradients off, not compiling, tracing or
exporting, no Dynamo frame callback, no torch-function or dispatch mode (``FlopCounterMode``), no functorch transform,
no forward-mode AD level (a dual tensor is a plain tensor; the op refuses forward AD where a fused kernel called
directly would drop the tangent). The body is the one function the op runs (routing to its fused kernel or its
reference), so results are the same bits.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.autograd.forward_ad as forward_ad
import torch.fx as fx

__all__ = ["direct_call", "direct_forward", "plain_eager"]

NAMESPACE = "depthrewrite"
ENABLED = True  # False: every call goes through the dispatcher (bench/generation.py --ab direct measures both)


def _frame_callback() -> Callable[[], Any]:
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
    except ImportError:  # pragma: no cover - another torch layout: never direct
        return lambda: True
    return get_eval_frame_callback


_callback = _frame_callback()


def plain_eager() -> bool:
    """Whether this call runs plainly eager: gradients off, no compiler, tracer, mode, transform or forward-AD level
    active."""
    if torch.compiler.is_compiling():  # first: under Dynamo this folds to False and nothing below is traced
        return False
    return (
        ENABLED
        and not torch.is_grad_enabled()
        and _callback() is None
        and not torch._C._is_torch_function_mode_enabled()
        and torch._C._len_torch_dispatch_stack() == 0
        and torch._C._functorch.peek_interpreter_stack() is None
        and torch._C._get_tracing_state() is None
        # a dual tensor is a plain tensor: the op refuses forward AD, a kernel called directly would drop the tangent
        and forward_ad._current_level < 0
    )


@functools.cache
def _body(op: torch._ops.OpOverload) -> Callable[..., Any] | None:
    """The Python function a ``depthrewrite`` custom op runs on every device, or None (an op with kernels of its own
    per device, or a torch without these records: the op is then always called)."""
    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:  # pragma: no cover
        return None
    opdef = OPDEFS.get(op._schema.name)
    if opdef is None or set(getattr(opdef, "_backend_fns", {None: None})) - {None}:
        return None
    return getattr(opdef, "_init_fn", None)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _plain(args: tuple) -> bool:
    for a in args:
        if isinstance(a, torch.Tensor):
            if type(a) not in _PLAIN:
                return False
        elif isinstance(a, (list, tuple)) and not _plain(a):
            return False
    return True


@functools.cache
def _direct(op: torch._ops.OpOverload) -> Callable[..., Any] | None:
    body = _body(op)
    if body is None:
        return None

    def call(*args: Any, **kwargs: Any) -> Any:
        if _plain(args) and _plain(tuple(kwargs.values())):
            return body(*args, **kwargs)
        return op(*args, **kwargs)

    call.__name__ = call.__qualname__ = f"{op._schema.name.split('::')[-1]}_direct"
    return call


def direct_call(op: torch._ops.OpOverload) -> Callable[..., Any]:
    """What to call for ``op`` in a plain eager call (:func:`plain_eager`): its body when its tensors are plain, else
    the op (a function with the op's signature; the op itself when it has no single body)."""
    return _direct(op) or op


def direct_forward(gm: fx.GraphModule) -> Callable[..., Any] | None:
    """``gm``'s forward with every ``depthrewrite`` op called through its body (see the module docstring), to be
    called with ``gm`` (or a module holding what its code reads) as ``self``; None when ``gm`` calls no such op or
    one of them has no single body (then ``gm.forward`` is as fast)."""
    graph = gm.graph
    swap: dict[fx.Node, Callable[..., Any]] = {}
    for n in graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == NAMESPACE:
            fn = _direct(n.target)
            if fn is None:
                return None
            swap[n] = fn
    if not swap:
        return None
    g = fx.Graph(owning_module=None, tracer_cls=graph._tracer_cls)
    env: dict[fx.Node, fx.Node] = {}
    out = g.graph_copy(graph, env)
    g.output(out)
    g._codegen = graph._codegen
    for old, fn in swap.items():
        env[old].target = fn
    return type(fx.GraphModule(gm, g, class_name=type(gm).__name__)).forward
