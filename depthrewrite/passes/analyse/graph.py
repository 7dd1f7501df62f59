"""Dataflow views of an FX graph: a networkx DiGraph of tensor edges, module paths, static (parameter-only) values.

The analysis reads dataflow only. Two facts about captured graphs shape this module:

* shape arithmetic (``sym_size``) and metadata asserts are edges of the FX graph but not of the dataflow, so they are
  left out;
* export writes a no-op ``x.to(x.dtype)`` as a node that later readers of ``x`` read instead of ``x`` (see
  :func:`~depthrewrite.passes.analyse.ops.is_alias`); :class:`Dataflow` folds such aliases into the tensor they alias,
  so "the users of h" includes the readers of its aliases;
* a wrapper region (``wrap_with_autocast``: see :mod:`~depthrewrite.passes.analyse.ops`) is one node reading its
  operands, whose outputs are its ``getitem`` readers; an output that only aliases an operand is folded into it.
"""

from __future__ import annotations

import re
from functools import cached_property
from typing import Iterable

import networkx as nx
import torch
import torch.fx as fx

from .ops import alias_of, is_alias, is_float_tensor, is_param, op_of, strip_alias, tensor_inputs, tensor_val, val, wrapper_call

__all__ = ["Dataflow", "module_path_of", "normalise_module_path"]

_DYNAMO_ROOT = re.compile(r"^L\[[^\]]*\](\[\d+\])?\.?")
_INDEX = re.compile(r"\[(\d+)\]")
_MODULES_ITEM = re.compile(r"\._modules\[['\"]([^'\"]+)['\"]\]")


def normalise_module_path(path: str) -> str:
    """``"L['self'].model.layers[0].mlp"`` (Dynamo) and ``"model.layers.0.mlp"`` (export) both -> ``"model.layers.0.mlp"``."""
    path = _DYNAMO_ROOT.sub("", path)
    path = _MODULES_ITEM.sub(r".\1", path)
    path = _INDEX.sub(r".\1", path)
    return path.strip(".")


def module_path_of(node: fx.Node) -> str | None:
    """The innermost module path of the module call that produced ``node`` (from ``nn_module_stack``)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    return normalise_module_path(path)


#: op namespaces of collective communication traced into a graph (a model's own tensor-parallel code)
COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d", "_c10d_functional_autograd")


def first_collective(graphs: Iterable[fx.Graph]) -> fx.Node | None:
    """The first node of ``graphs`` that communicates across ranks (a collective traced from the model's own code,
    such as a tensor-parallel plan's all-reduce run inside an inlined module), or None."""
    for g in graphs:
        for n in g.nodes:
            if n.op == "call_function" and getattr(n.target, "namespace", None) in COLLECTIVE_NAMESPACES:
                return n
    return None


def describe_collective(n: fx.Node) -> str:
    """``"_c10d_functional.all_reduce in layers.0.attention.wo, node all_reduce"``."""
    where = module_path_of(n) or "the model's own code"
    return f"{n.target.namespace}.{n.target._opname} in {where}, node {n.name}"


class Dataflow:
    """Tensor dataflow of one graph, with aliases folded into the tensors they alias."""

    def __init__(self, gm: fx.GraphModule, static_inputs=()):
        """``static_inputs``: placeholders to count as static (a wrapper subgraph's operands that are parameters)."""
        self.gm = gm
        self.static_inputs = frozenset(static_inputs)
        self.nodes: list[fx.Node] = list(gm.graph.nodes)
        self.order = {n: i for i, n in enumerate(self.nodes)}
        self.by_name = {n.name: n for n in self.nodes}

    def canon(self, node: fx.Node) -> fx.Node:
        return strip_alias(node)

    def _graph(self, keep) -> nx.DiGraph:
        """Canonical (alias-free) nodes, with an edge along every tensor input ``a`` for which ``keep(a)``."""
        g = nx.DiGraph()
        for n in self.nodes:
            if is_alias(n):
                continue
            g.add_node(n)
            for a in tensor_inputs(n):
                if keep(a):
                    g.add_edge(self.canon(a), n)
        return g

    @cached_property
    def nx(self) -> nx.DiGraph:
        """Edges between canonical (alias-free) nodes along every tensor input."""
        return self._graph(lambda a: True)

    @cached_property
    def nx_float(self) -> nx.DiGraph:
        """Like :attr:`nx`, but only along floating-point edges: an index computed from activations (MoE routing,
        ``topk``) does not make the tensor it selects an activation."""

        def is_float(a: fx.Node) -> bool:
            v = val(a)
            return is_float_tensor(a) or a.op == "get_attr" or (
                isinstance(v, (tuple, list)) and any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in v)
            )

        return self._graph(is_float)

    def users(self, node: fx.Node) -> list[fx.Node]:
        """Tensor-valued readers of ``node`` and of its aliases (aliases themselves excluded), in graph order."""
        node = self.canon(node)
        seen: dict[fx.Node, None] = {}
        todo = [node]
        while todo:
            cur = todo.pop()
            for u in cur.users:
                if alias_of(u) is cur:
                    todo.append(u)
                    continue
                if wrapper_call(u) is not None:  # a region's outputs that alias cur are cur too
                    todo.extend(g for g in u.users if alias_of(g) is cur)
                if u.op == "output" or (isinstance(val(u), (torch.Tensor, tuple, list)) and cur in tensor_inputs(u)):
                    seen[u] = None
        return sorted(seen, key=self.order.__getitem__)

    @cached_property
    def static(self) -> set[fx.Node]:
        """Nodes whose value depends on parameters, buffers and constants only (never on a graph input)."""
        out: set[fx.Node] = set()
        for n in self.nodes:
            if n.op in ("get_attr",) or (n.op == "placeholder" and (is_param(n) or n in self.static_inputs)):
                out.add(n)
            elif op_of(n) in ("shape_as", "cast"):
                # bias.expand_as(h): h gives only the shape; w.type_as(h), w.to(h): h gives only the dtype
                if isinstance(n.args[0], fx.Node) and n.args[0] in out:
                    out.add(n)
            elif n.op in ("call_function", "call_method", "call_module"):
                ins = [a for a in n.all_input_nodes]
                if ins and all(a in out for a in ins):
                    out.add(n)
                elif not ins and tensor_val(n) is not None:
                    out.add(n)  # a constant tensor built from literals (torch.tensor(2.0))
        return out

    def between(self, src: fx.Node, dst: fx.Node) -> set[fx.Node]:
        """Nodes on some path from ``src`` to ``dst`` (both included when a path exists)."""
        g = self.nx
        src, dst = self.canon(src), self.canon(dst)
        if src not in g or dst not in g:
            return set()
        down = nx.descendants(g, src) | {src}
        up = nx.ancestors(g, dst) | {dst}
        return down & up if dst in down else set()

