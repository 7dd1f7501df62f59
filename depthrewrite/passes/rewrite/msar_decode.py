"""MSAR's decoding state: the last k−1 positions of every source, carried in the KV cache (msar.md §5, ``left``).

A causal depthwise conv of width k at position t reads positions t−k+1..t of its source. When a model decodes with a
KV cache, a call sees only the new tokens, so every MSAR graph captured for a cached call gets:

* one history input per distinct source of its ``msar_mix`` ops (``[B, 1, k_max−1, D]``, read from extra layers the
  converted model appends to the caller's ``DynamicCache``; none on the first, prefill, call: zeros);
* each ``msar_mix`` given its sources' histories as ``left``: the convs read them as left context and the op computes
  the new positions only (until 2026-12-05 each source was ``cat([history, source])`` and the whole mix ran on
  k_max−1 + T positions, whose first outputs were dropped: ~12× the work of a decoding step at the default taps);
* one new history output per source: the last k_max−1 positions of that concatenation, returned beside the model's
  own output (the graph returns ``(output, (history, ...))``) and written into the cache by the converted model.

The padding mask (``padding_mask``), ``[B, past + T]`` while decoding, is cut to the last T positions before it
masks the new sources; the history holds masked values already.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ..meta import NodeRole, inherit_meta

__all__ = ["DECODE_META", "HISTORY_META", "add_decode_state", "cut_mask_to_new_tokens"]

#: gm.meta key set by the converted model before the rewrite: the history placeholders' names (``[]`` on prefill)
DECODE_META = "depthrewrite_decode"
#: gm.meta key set by this pass: the number of history tensors the graph returns
HISTORY_META = "depthrewrite_history"

_MAX = 2**63 - 1


def _call(graph: fx.Graph, target, args, like: fx.Node, scheme: str, role: str) -> fx.Node:
    n = graph.call_function(target, args)
    inherit_meta(n, like, NodeRole(role, None, scheme), copy_val=False)
    return n


def add_decode_state(gm: fx.GraphModule, k1: int, scheme: str) -> int:
    """Give ``gm``'s ``msar_mix`` ops k1 = k_max−1 positions of left context from history inputs and return the new
    history (see the module docstring). Returns the number of history tensors (0: nothing to do)."""
    names = gm.meta.get(DECODE_META)
    graph = gm.graph
    mixes = [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.depthrewrite.msar_mix.default]
    if names is None or not mixes or k1 <= 0:
        return 0
    sources: list[fx.Node] = []
    for m in mixes:
        for s in m.args[0]:
            if s not in sources:
                sources.append(s)
    by_name = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    history = [by_name[n] for n in names][: len(sources)]
    if history and len(history) != len(sources):
        raise RuntimeError(f"depthrewrite: {len(history)} MSAR history inputs for {len(sources)} sources")
    left: dict[fx.Node, fx.Node] = {}
    new_hist: list[fx.Node] = []
    for i, s in enumerate(sources):
        if history:
            with graph.inserting_after(s):
                h = _call(graph, torch.ops.aten.squeeze.dim, (history[i], 1), s, scheme, "msar_history")
            with graph.inserting_after(h):
                cat = _call(graph, torch.ops.aten.cat.default, ([h, s], -2), s, scheme, "msar_history")
            left[s] = h
        else:
            with graph.inserting_after(s):
                cat = _call(graph, torch.ops.aten.constant_pad_nd.default, (s, [0, 0, k1, 0]), s, scheme, "msar_history")
        with graph.inserting_after(cat):
            tail = _call(graph, torch.ops.aten.slice.Tensor, (cat, -2, -k1, _MAX), s, scheme, "msar_history")
        with graph.inserting_after(tail):
            out = _call(graph, torch.ops.aten.unsqueeze.default, (tail, 1), s, scheme, "msar_history")
        new_hist.append(out)
    if left:  # the mixes read the history as their convs' left context and compute the new positions only
        for m in mixes:
            m.kwargs = {**m.kwargs, "left": [left[s] for s in m.args[0]]}
    # without history (zeros) the mixes' own zero padding is the same left context: they stay as they are
    return_history(gm, new_hist)
    gm.meta[HISTORY_META] = len(new_hist)
    return len(new_hist)


def return_history(gm: fx.GraphModule, hist: list[fx.Node]) -> None:
    """The graph returns ``(its output, (history, ...))``: the output node gets the history leaves after its own, and
    the generated forward's output spec becomes a 2-tuple around the old one."""
    graph = gm.graph
    out = next(n for n in graph.nodes if n.op == "output")
    leaves = out.args[0]
    leaves = list(leaves) if isinstance(leaves, (list, tuple)) else [leaves]
    out.args = (type(out.args[0])(leaves + hist) if isinstance(out.args[0], (list, tuple)) else tuple(leaves + hist),)
    info = getattr(graph._codegen, "pytree_info", None)
    if info is None or info.out_spec is None:
        raise RuntimeError("depthrewrite: MSAR decoding state needs an exported graph (with an output spec)")
    leaf = pytree.treespec_leaf() if hasattr(pytree, "treespec_leaf") else pytree.LeafSpec()
    spec = pytree.treespec_tuple([info.out_spec, pytree.treespec_tuple([leaf] * len(hist))]) \
        if hasattr(pytree, "treespec_tuple") else pytree.TreeSpec(tuple, None, [info.out_spec, pytree.TreeSpec(tuple, None, [leaf] * len(hist))])
    graph._codegen.pytree_info = info._replace(out_spec=spec)


def cut_mask_to_new_tokens(graph: fx.Graph, mask_keep: fx.Node, source: fx.Node, scheme: str) -> fx.Node:
    """``keep[:, -T:]`` for T = the source's sequence length: a padding mask covers past and new tokens while
    decoding; a no-op otherwise."""
    T = _call(graph, torch.ops.aten.sym_size.int, (source, -2), source, scheme, "source_mask")
    neg = _call(graph, operator.neg, (T,), source, scheme, "source_mask")
    return _call(graph, torch.ops.aten.slice.Tensor, (mask_keep, 1, neg, _MAX), source, scheme, "source_mask")
