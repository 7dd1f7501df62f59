"""Our node metadata lives under one key, ``node.meta["depthrewrite"]``; new nodes inherit ``nn_module_stack`` and
``stack_trace`` from the node whose role they take, so module-path based splits stay correct."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .analyse.ops import op_name, tensor_val

__all__ = ["META_KEY", "SCHEME_TAG", "NodeRole", "inherit_meta", "sizes_of", "unsafe_view_of", "role_of",
           "depth_op_name", "scheme_tags"]

META_KEY = "depthrewrite"
#: the scheme name also goes under ``node.meta["custom"][SCHEME_TAG]``: "custom" is one of the few meta keys Dynamo
#: copies from a GraphModule's nodes into the graph it traces (``torch.fx.proxy._COPY_META_FIELDS``), so the compile
#: backend can tell a converted graph by it, whichever ops the scheme inserts (none, for a scheme of aten ops only)
SCHEME_TAG = "depthrewrite_scheme"


@dataclass(frozen=True)
class NodeRole:
    role: str  # mix, partial_sum, source_sum (AttnRes/MSAR); source_mask (MSAR's padding mask); expand, mhc_pre,
    #            mhc_state, collapse (mHC); moda_attn, kv_proj (MoDA)
    site: int | str
    scheme: str


def inherit_meta(new: fx.Node, old: fx.Node, role: NodeRole | None = None, val_from: fx.Node | None = None,
                 copy_val: bool = True) -> None:
    """``new`` takes ``old``'s place: its module stack and stack trace, ``role``, and the value metadata of
    ``val_from`` (default ``old``); ``copy_val=False`` for a node whose value has no other node's shape."""
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in old.meta:
            new.meta[key] = old.meta[key]
    src = val_from if val_from is not None else old
    for key in ("val", "example_value", "tensor_meta") if copy_val else ():
        if key in src.meta:
            new.meta[key] = src.meta[key]
    if role is not None:
        new.meta[META_KEY] = role
        new.meta["custom"] = {**new.meta.get("custom", {}), SCHEME_TAG: role.scheme}


def sizes_of(graph: fx.Graph, x: fx.Node, ndim: int) -> list:
    """The first ``ndim`` sizes of ``x``: the static ones as ints, the others as ``aten.sym_size`` nodes (inserted at
    the current point) that read them at run time."""
    val = tensor_val(x)
    out: list = []
    for i in range(ndim):
        size = val.shape[i] if val is not None else None
        if isinstance(size, int):
            out.append(size)
        else:
            out.append(graph.call_function(torch.ops.aten.sym_size.int, (x, i)))
            if size is not None:
                out[-1].meta["val"] = size
    return out


def unsafe_view_of(graph: fx.Graph, x: fx.Node) -> fx.Node:
    """``aten._unsafe_view(x, x.shape)``, inserted at the current point: the same storage and values as ``x`` but no
    autograd view (no copy; its gradient is the incoming one reshaped), as aten's own matmul returns its folded
    products. ``x`` must have a tensor value."""
    sizes = sizes_of(graph, x, tensor_val(x).dim())
    for n in sizes:
        if isinstance(n, fx.Node):
            inherit_meta(n, x, copy_val=False)
    own = graph.call_function(torch.ops.aten._unsafe_view.default, (x, sizes))
    inherit_meta(own, x)
    return own


def role_of(n: fx.Node) -> NodeRole | None:
    """The role a rewrite gave node ``n`` (None for the model's own nodes)."""
    r = n.meta.get(META_KEY)
    return r if isinstance(r, NodeRole) else None


def scheme_tags(graph: fx.Graph) -> set[str]:
    """The schemes whose rewrite made nodes of ``graph``: read from ``NodeRole`` or, in a graph Dynamo traced from a
    converted model (where our own meta key is not copied), from the ``custom`` tag."""
    out = set()
    for n in graph.nodes:
        r = role_of(n)
        tag = r.scheme if r is not None else (n.meta.get("custom") or {}).get(SCHEME_TAG)
        if isinstance(tag, str):
            out.add(tag)
    return out


def depth_op_name(n: fx.Node) -> str | None:
    """``"moda_attn_slots"`` for a call of ``torch.ops.depthrewrite.moda_attn_slots``; None for any other node."""
    if n.op != "call_function" or getattr(n.target, "namespace", None) != "depthrewrite":
        return None
    return op_name(n)
