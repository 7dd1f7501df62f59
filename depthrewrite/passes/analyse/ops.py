"""What an FX node computes, read the same way on both IRs the analysis sees.

``torch.export`` (training IR) gives ATen overloads (``aten.add.Tensor``) with ``meta["val"]``; a Dynamo graph, as a
``torch.compile`` backend receives it, gives torch-level callables (``operator.add``, ``torch.rsqrt``,
``F.layer_norm``), ``call_method`` nodes (``x.pow(2)``) and ``meta["example_value"]``. :func:`op_of` maps either to
one small vocabulary, so the passes never look at targets directly.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

__all__ = [
    "op_name",
    "op_of", "val", "tensor_val", "is_float_tensor", "tensor_inputs", "is_alias", "strip_alias", "strip_casts", "is_param",
    "shape_str",
]

aten = torch.ops.aten

# Canonical name -> ATen overload packets, torch-level callables, and tensor method names.
_TABLE: dict[str, tuple[tuple, tuple, tuple]] = {
    "add": ((aten.add,), (operator.add, operator.iadd, torch.add), ("add", "add_", "__add__")),
    "sub": ((aten.sub,), (operator.sub, torch.sub), ("sub",)),
    "mul": ((aten.mul,), (operator.mul, operator.imul, torch.mul), ("mul", "mul_", "__mul__")),
    "div": ((aten.div,), (operator.truediv, torch.div), ("div",)),
    "pow": ((aten.pow,), (operator.pow, torch.pow), ("pow",)),
    "square": ((aten.square,), (torch.square,), ("square",)),
    "mean": ((aten.mean,), (torch.mean,), ("mean",)),
    "rsqrt": ((aten.rsqrt,), (torch.rsqrt,), ("rsqrt",)),
    "sqrt": ((aten.sqrt,), (torch.sqrt,), ("sqrt",)),
    "cast": (
        (aten.to, aten._to_copy, aten.type_as, aten.alias, aten.detach),
        (),
        ("to", "float", "half", "bfloat16", "double", "type_as", "type", "contiguous", "detach"),
    ),
    "layer_norm": ((aten.layer_norm, aten.native_layer_norm), (F.layer_norm, torch.layer_norm), ()),
    "rms_norm": ((aten.rms_norm,), (F.rms_norm, getattr(torch, "rms_norm", F.rms_norm)), ()),
    "linear": ((aten.linear, aten.addmm, aten.mm), (F.linear, torch.addmm, torch.mm), ()),
    "matmul": ((aten.matmul, aten.bmm, aten.einsum, aten.baddbmm), (torch.matmul, operator.matmul, torch.bmm, torch.einsum, torch.baddbmm), ("matmul", "bmm", "__matmul__")),
    "sdpa": (
        tuple(
            p
            for p in (
                aten.scaled_dot_product_attention,
                getattr(aten, "_scaled_dot_product_flash_attention", None),
                getattr(aten, "_scaled_dot_product_efficient_attention", None),
                getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None),
                getattr(aten, "_scaled_dot_product_cudnn_attention", None),
            )
            if p is not None
        ),
        (F.scaled_dot_product_attention,),
        (),
    ),
    "softmax": ((aten.softmax, aten._softmax), (F.softmax, torch.softmax), ("softmax",)),
    "embedding": ((aten.embedding,), (F.embedding,), ()),
    "dropout": ((aten.dropout, aten.native_dropout), (F.dropout,), ()),
    "getitem": ((), (operator.getitem,), ()),
    "cat": ((aten.cat, aten.stack), (torch.cat, torch.stack), ()),
    # change a tensor's shape, never its elements (in row-major order)
    "view": (
        (aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.unflatten),
        (torch.reshape, torch.flatten, torch.unflatten),
        ("view", "reshape", "flatten", "unflatten"),
    ),
    "slice": ((aten.slice,), (), ()),
    "select": ((aten.select,), (torch.select,), ("select",)),
    # read only the shape / dtype / device of their tensor argument: no dataflow
    "like": (
        (aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like, aten.new_zeros, aten.new_ones, aten.new_empty, aten.new_full),
        (torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like),
        ("new_zeros", "new_ones", "new_empty", "new_full"),
    ),
    "sym": ((aten.sym_size, aten.sym_numel, aten.sym_stride), (), ("size", "dim")),
    # read the data of their first argument and only the shape of the second (bias.expand_as(h))
    "shape_as": ((aten.expand_as, aten.view_as, aten.reshape_as), (), ("expand_as", "view_as", "reshape_as")),
}

_BY_PACKET: dict[Any, str] = {}
_BY_CALLABLE: dict[Any, str] = {}
_BY_METHOD: dict[str, str] = {}
for _name, (_packets, _callables, _methods) in _TABLE.items():
    for _p in _packets:
        _BY_PACKET[_p] = _name
    for _c in _callables:
        _BY_CALLABLE[_c] = _name
    for _m in _methods:
        _BY_METHOD[_m] = _name

_MODULE_OPS = {torch.nn.LayerNorm: "layer_norm", torch.nn.Linear: "linear", torch.nn.Dropout: "dropout", torch.nn.Embedding: "embedding"}
if hasattr(torch.nn, "RMSNorm"):
    _MODULE_OPS[torch.nn.RMSNorm] = "rms_norm"


def op_name(n: fx.Node) -> str | None:
    """The name of the aten or custom op ``n`` calls, without namespace and overload (``"to"``, ``"dropout"``,
    ``"moda_slots"``), or None when ``n`` calls no op overload."""
    packet = getattr(n.target, "overloadpacket", None)
    return getattr(packet, "__name__", None) if packet is not None else None


def op_of(node: fx.Node, gm: fx.GraphModule | None = None) -> str | None:
    """The canonical op name of ``node`` (``"add"``, ``"rms_norm"``, ``"sdpa"``, ...), or None if it is none of ours."""
    if node.op == "call_function":
        target = node.target
        packet = getattr(target, "overloadpacket", None)
        if packet is not None:
            return _BY_PACKET.get(packet)
        try:
            return _BY_CALLABLE.get(target)
        except TypeError:  # unhashable target
            return None
    if node.op == "call_method":
        return _BY_METHOD.get(node.target)
    if node.op == "call_module" and gm is not None:
        mod = gm.get_submodule(node.target)
        for cls, name in _MODULE_OPS.items():
            if isinstance(mod, cls):
                return name
    return None


def val(node: Any) -> Any:
    """The example value of a node: ``meta["val"]`` (export) or ``meta["example_value"]`` (Dynamo)."""
    if not isinstance(node, fx.Node):
        return None
    v = node.meta.get("val")
    if v is None:
        v = node.meta.get("example_value")
    return v


def tensor_val(node: Any) -> torch.Tensor | None:
    v = val(node)
    return v if isinstance(v, torch.Tensor) else None


def is_float_tensor(node: Any) -> bool:
    v = tensor_val(node)
    return v is not None and v.is_floating_point()


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The input nodes of ``node`` whose tensor data it reads, in argument order (lists flattened).

    A cast reads only its first argument (``type_as(x, y)`` takes y's dtype, not its data), and so does
    ``x.expand_as(y)`` (y's shape); ``zeros_like`` and ``new_ones`` read no data at all."""
    op = op_of(node)
    if op == "like":
        return []
    out: list[fx.Node] = []

    def visit(a: Any) -> None:
        if isinstance(a, fx.Node):
            v = val(a)
            if (
                isinstance(v, torch.Tensor)
                or (isinstance(v, (tuple, list)) and any(isinstance(t, torch.Tensor) for t in v))
                or a.op == "get_attr"
            ):
                out.append(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                visit(x)
        elif isinstance(a, dict):
            for x in a.values():
                visit(x)

    if op in ("cast", "shape_as"):
        visit(node.args[:1])
        return out
    visit(node.args)
    visit(node.kwargs)
    return out


def is_alias(node: fx.Node) -> bool:
    """True for a cast that changes nothing (same dtype and shape as its input): ``x.to(x.dtype)``.

    Export records such no-op ``.to()`` calls as nodes, and later readers of the same tensor read the alias node
    (``residual = h`` is taken before the norm's ``h.to(float32)``, but the tracer maps both to the alias).
    """
    if op_of(node) != "cast" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    a, b = tensor_val(node), tensor_val(node.args[0])
    return a is not None and b is not None and a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)


def strip_alias(node: fx.Node) -> fx.Node:
    while is_alias(node):
        node = node.args[0]
    return node


def strip_casts(node: fx.Node) -> fx.Node:
    """Follow every cast (real or not) back to the tensor it was made from."""
    while op_of(node) == "cast" and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def is_param(node: fx.Node) -> bool:
    """A parameter or buffer: a ``get_attr`` (unlifted export, symbolic trace) or a Dynamo parameter placeholder."""
    if node.op == "get_attr":
        return True
    if node.op == "placeholder":
        return isinstance(val(node), torch.nn.Parameter)
    return False


def shape_str(shape) -> str:
    """A shape as text, ``[2, s0, 64]`` (symbolic sizes by name): for messages, and to compare shapes that may be
    symbolic (two equal strings are the same sizes)."""
    return "[" + ", ".join(str(d) for d in shape) + "]"
