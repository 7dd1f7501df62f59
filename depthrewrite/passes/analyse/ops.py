"""What an FX node computes, read the same way on both IRs the analysis sees.

``torch.export`` (training IR) gives ATen overloads (``aten.add.Tensor``) with ``meta["val"]``; a Dynamo graph, as a
``torch.compile`` backend receives it, gives torch-level callables (``operator.add``, ``torch.rsqrt``,
``F.layer_norm``), ``call_method`` nodes (``x.pow(2)``) and ``meta["example_value"]``. :func:`op_of` maps either to
one small vocabulary, so the passes never look at targets directly.

Export also leaves *wrapper* higher-order ops in the training IR: a region run under ``torch.autocast`` or
``torch.set_grad_enabled`` (OLMo-core runs its RMSNorm under ``autocast(enabled=False)``) becomes one
``wrap_with_autocast(..., submod, *operands)`` node whose result is a tuple read by ``getitem``. The region's body is
a subgraph that computes its outputs from the operands. :func:`wrapper_call` reads such a node; the dataflow
helpers here see through it: a region output that is only a no-op cast of an operand is an alias of that operand
(:func:`alias_of`), and the region node reads the data of its operands only (:func:`tensor_inputs`).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from ... import flexattention as _flexattention

__all__ = [
    "op_name", "wrapper_call", "wrapper_body", "wrapper_outputs", "wrapper_output_node", "alias_of",
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
    # FlexAttention's operator (torchtitan's default attention): attention over the sequence with a block mask
    "flex_attention": ((), tuple(op for op in (getattr(torch.ops.higher_order, "flex_attention", None),
                                               _flexattention.flex_attention) if op), ()),
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


#: higher-order ops that only run a subgraph on their operands (under a grad or autocast mode, or for checkpointing):
#: name -> (index of the subgraph argument, index of the first operand)
_WRAPPERS: dict[str, tuple[int, int]] = {
    "wrap": (0, 1),
    "wrap_with_set_grad_enabled": (1, 2),
    "wrap_with_autocast": (4, 5),
    "tag_activation_checkpoint": (0, 1),
    "wrap_activation_checkpoint": (0, 1),
    "invoke_subgraph": (0, 2),
}


def wrapper_call(node: Any) -> tuple[fx.GraphModule, tuple] | None:
    """For a call of a wrapper higher-order op (``wrap_with_autocast``, ``wrap_with_set_grad_enabled``, ``wrap``,
    ``tag_activation_checkpoint``, ``invoke_subgraph``): (the subgraph it runs, its operands, one per placeholder of
    the subgraph, in order). None for any other node."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    target = node.target
    if not isinstance(target, torch._ops.HigherOrderOperator):
        return None
    pos = _WRAPPERS.get(target.name())
    if pos is None or len(node.args) <= pos[0]:
        return None
    ref = node.args[pos[0]]
    owner = node.graph.owning_module
    if not isinstance(ref, fx.Node) or ref.op != "get_attr" or owner is None:
        return None
    sub: Any = owner
    try:
        for part in str(ref.target).split("."):
            sub = getattr(sub, part)
    except AttributeError:
        return None
    if not isinstance(sub, fx.GraphModule):
        return None
    operands = tuple(node.args[pos[1]:])
    if sum(1 for n in sub.graph.nodes if n.op == "placeholder") != len(operands):
        return None
    return sub, operands


def wrapper_body(node: fx.Node) -> str:
    """The name of the subgraph a wrapper call runs (``submod_1``), for messages."""
    return str(node.args[_WRAPPERS[node.target.name()][0]].target)


def wrapper_outputs(sub: fx.GraphModule) -> list[Any]:
    """The values a wrapper's subgraph returns, in order (its output node's arguments, flattened one level)."""
    out = next((n for n in reversed(sub.graph.nodes) if n.op == "output"), None)
    if out is None or not out.args:
        return []
    ret = out.args[0]
    return list(ret) if isinstance(ret, (tuple, list)) else [ret]


def wrapper_output_node(node: fx.Node, i: int) -> fx.Node | None:
    """The node of the outer graph that carries output ``i`` of the wrapper call ``node``: ``getitem(node, i)`` when
    it returns a tuple (the first such node), ``node`` itself when it returns one tensor; None when unused."""
    if isinstance(val(node), (tuple, list)):
        return next(
            (u for u in node.users if u.op == "call_function" and u.target is operator.getitem and u.args[1] == i),
            None,
        )
    return node if i == 0 else None


def _wrapper_output_index(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(wrapper call, output index) for a node that carries one output of a wrapper call."""
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        if wrapper_call(node.args[0]) is not None and isinstance(node.args[1], int):
            return node.args[0], node.args[1]
        return None
    if wrapper_call(node) is not None and not isinstance(val(node), (tuple, list)):
        return node, 0
    return None


def op_name(n: fx.Node) -> str | None:
    """The name of the aten or custom op ``n`` calls, without namespace and overload (``"to"``, ``"dropout"``,
    ``"moda_attn_slots"``), or None when ``n`` calls no op overload."""
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
    wrapped = wrapper_call(node)
    if wrapped is not None:  # the subgraph argument is a module, not data
        visit(wrapped[1])
        return out
    visit(node.args)
    visit(node.kwargs)
    return out


def alias_of(node: fx.Node) -> fx.Node | None:
    """The tensor ``node`` is an alias of, or None: a cast that changes nothing (same dtype and shape as its input,
    ``x.to(x.dtype)``, ``w.type_as(x)`` for a ``w`` of x's dtype), or a wrapper region's output that is such a cast
    of (or is) one of the region's operands (OLMo-core's RMSNorm returns its input's no-op ``x.float()`` from its
    ``autocast`` region, which the residual add then reads).

    Export records such no-op ``.to()`` calls as nodes, and later readers of the same tensor read the alias node
    (``residual = h`` is taken before the norm's ``h.to(float32)``, but the tracer maps both to the alias).
    """
    if op_of(node) == "cast":
        if not node.args or not isinstance(node.args[0], fx.Node):
            return None
        a, b = tensor_val(node), tensor_val(node.args[0])
        same = a is not None and b is not None and a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
        return node.args[0] if same else None
    out = _wrapper_output_index(node)
    if out is None:
        return None
    hop, i = out
    sub, operands = wrapper_call(hop)
    rets = wrapper_outputs(sub)
    if i >= len(rets) or not isinstance(rets[i], fx.Node):
        return None
    inner = strip_alias(rets[i])
    if inner.op != "placeholder":
        return None
    k = [n for n in sub.graph.nodes if n.op == "placeholder"].index(inner)
    src = operands[k]
    if not isinstance(src, fx.Node):
        return None
    a, b = tensor_val(node), tensor_val(src)
    same = a is not None and b is not None and a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
    return src if same else None


def is_alias(node: fx.Node) -> bool:
    """True for a node that only aliases another tensor (see :func:`alias_of`)."""
    return alias_of(node) is not None


def strip_alias(node: fx.Node) -> fx.Node:
    while (a := alias_of(node)) is not None:
        node = a
    return node


def strip_casts(node: fx.Node) -> fx.Node:
    """Follow every cast (real or not), and every wrapper output that aliases an operand, back to the tensor it was
    made from."""
    while True:
        if op_of(node) == "cast" and node.args and isinstance(node.args[0], fx.Node):
            node = node.args[0]
        elif (a := alias_of(node)) is not None:
            node = a
        else:
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
