"""The placement pass: cut a converted model's graphs into pipeline stages with ``torch.ops.pippy._pipe_split``
nodes, copying side values built from shapes and buffers (RoPE, a causal mask) into each later stage that reads them,
and :func:`split`, which places the same cuts in both graphs and records the measured boundaries in the report."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from ..passes.lower.module_calls import reopen_autocast_at
from ..passes.result import Change, PassResult
from .measure import example_batch, measure
from .nodes import CLONE_KEY, PIPE_SPLIT, is_depth_op, is_split, is_sym, nondeterministic, op_name
from ..converted import graph_module_of
from .plan import check_stages, plan, stage_anchor

__all__ = ["place_boundaries", "split"]


def _free_nodes(converted, graph: fx.Graph) -> set[fx.Node]:
    """Tensor nodes computed from shapes, buffers and constants only (no input data, no trainable parameter): any
    stage can recompute them instead of receiving them."""
    free: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "get_attr":
            obj = converted.resolve_attr(n.target)
            if not (isinstance(obj, nn.Parameter) and obj.requires_grad) and not isinstance(obj, nn.Module):
                free.add(n)
        elif n.op == "call_function":
            if is_sym(n) or is_split(n) or nondeterministic(n) or n.is_impure() or is_depth_op(n):
                continue
            if all(a in free or is_sym(a) for a in n.all_input_nodes):
                free.add(n)
    return free


def _fold_buffer_casts(converted, graph: fx.Graph) -> int:
    """``buffer.to(its own dtype/device)`` returns the buffer itself; reading the buffer directly lets each stage (and
    pipeline()'s re-export, which sees one tensor) use its own replica instead of receiving the alias. Returns the
    number of casts folded."""
    folded = 0
    for n in list(graph.nodes):
        if n.op == "call_function" and op_name(n) == "to" and n.args and isinstance(n.args[0], fx.Node) \
                and n.args[0].op == "get_attr":
            src, v = converted.resolve_attr(n.args[0].target), n.meta.get("val")
            if isinstance(src, torch.Tensor) and isinstance(v, torch.Tensor) and v.dtype == src.dtype and v.device == src.device:
                n.replace_all_uses_with(n.args[0])
                graph.erase_node(n)
                folded += 1
    return folded


def place_boundaries(converted, graph: fx.Graph, report, cuts: Sequence[int]) -> PassResult:
    """Give every node of ``graph`` (one of ``converted.graphs``) a stage, copy side values built from shapes and
    buffers into each later stage that reads them, reorder ``graph`` stage by stage and insert the pipe_split nodes
    between stages; boundaries placed earlier are replaced. The caller recompiles ``converted``.

    Returns:
        A :class:`~depthrewrite.passes.result.PassResult` with one :class:`~depthrewrite.passes.result.Change` per
        boundary: ``site`` is the sublayer the new stage begins with, ``created`` the pipe_split node and the
        recomputed copies placed in that stage.
    """
    old = [n for n in graph.nodes if is_split(n)]
    for n in old:
        graph.erase_node(n)  # re-splitting replaces earlier boundaries
    # convert() already dropped export's dtype asserts and the dead code they kept alive (converted.drop_dead_code)
    folded = _fold_buffer_casts(converted, graph)
    anchors = {stage_anchor(graph, report, j): k + 1 for k, j in enumerate(cuts)}
    order = list(graph.nodes)
    idx = {n: i for i, n in enumerate(order)}
    stage: dict[fx.Node, int] = {}
    s = 0
    for n in order:
        s = anchors.get(n, s)
        stage[n] = s
    # parameters and buffers live with their readers
    for n in order:
        if n.op == "get_attr" and n.users:
            stage[n] = min(stage[u] for u in n.users)
    free = _free_nodes(converted, graph)
    clones: dict[tuple[fx.Node, int], fx.Node] = {}

    def clone(n: fx.Node, st: int) -> fx.Node:
        if stage[n] == st or n not in free:
            return n
        key = (n, st)
        if key not in clones:
            args = pytree.tree_map_only(fx.Node, lambda a: clone(a, st) if a in free else a, (n.args, n.kwargs))
            with graph.inserting_before(n):
                c = graph.create_node(n.op, n.target, args[0], args[1], name=f"{n.name}_s{st}")
            c.meta = dict(n.meta)
            c.meta[CLONE_KEY] = n.meta.get(CLONE_KEY, n.name)
            stage[c], idx[c] = st, idx[n]
            clones[key] = c
        return clones[key]

    for n in order:
        if n not in free or n.op == "get_attr":
            continue
        for u in list(n.users):
            if u.op != "output" and stage.get(u, 0) > stage[n]:
                u.replace_input_with(n, clone(n, stage[u]))
    graph.eliminate_dead_code()
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    nodes.sort(key=lambda n: (stage[n], idx[n]))
    out = next(n for n in graph.nodes if n.op == "output")
    cur = 0
    splits: list[fx.Node] = []
    for n in nodes:
        while stage[n] > cur:
            cur += 1
            with graph.inserting_before(out):
                splits.append(graph.call_function(PIPE_SPLIT, ()))
        out.prepend(n)
    reopened = reopen_autocast_at(graph, splits)
    graph.lint()
    return PassResult(converted, changes=_changes(graph, report, cuts, splits, clones),
                      notes=tuple(note for count, note in (
                          (len(old), f"replaced {len(old)} earlier stage boundaries"),
                          (folded, f"folded {folded} casts of a buffer to its own dtype and device"),
                          (reopened, f"closed {reopened} torch.autocast blocks at a boundary and opened them again "
                                     "after it"),
                      ) if count))


def _changes(graph: fx.Graph, report, cuts: Sequence[int], splits: list[fx.Node],
             clones: dict[tuple[fx.Node, int], fx.Node]) -> tuple[Change, ...]:
    """One :class:`Change` per boundary: its pipe_split node and the recomputed copies (still in use) of its stage."""
    alive = set(graph.nodes)
    copies: dict[int, list[fx.Node]] = defaultdict(list)
    for (_, st), c in clones.items():
        if c in alive:
            copies[st].append(c)
    changes = []
    for k, j in enumerate(cuts):
        made = copies[k + 1]
        recomputed = len({c.meta[CLONE_KEY] for c in made})
        detail = f"stage {k + 1} begins" + (f"; {recomputed} side values recomputed in it" if recomputed else "")
        changes.append(Change(site=j, module=report.chain.sublayers[j].module,
                              created=tuple(n.name for n in splits[k:k + 1] + made), replaced=None, detail=detail))
    return tuple(changes)


def split(converted, P: int, *, align_blocks: bool = True, example_inputs: tuple | None = None,
          example_kwargs: dict | None = None):
    """Place P-1 ``torch.ops.pippy._pipe_split`` boundaries in both graphs of ``converted`` (in place; returns it).

    ``torch.distributed.pipelining.pipeline(converted, mb_args)`` then splits at them. The conversion report gains a
    pipeline section (``converted.report().pipeline``): per boundary the tensors crossing and their bytes per token,
    measured at ``example_inputs`` (default: the inputs the model was converted with).

    For a converted model (what :func:`depthrewrite.convert` returns) the same cuts go into every graph it has captured
    (both modes of its example call are captured first) and into every graph it captures later; its report gains the
    pipeline section.

    Raises:
        ConfigError: P < 1, more stages than sublayers, or (Block schemes) more stages than block boundaries.
    """
    from ..runtime.handle import is_converted, state_of

    if is_converted(converted):
        check_stages(converted, P)
        st = state_of(converted)
        converted.graphs  # noqa: B018 - both modes of the example call, so both carry the cuts
        st.pipeline_stages, st.pipeline_kw = P, {"align_blocks": align_blocks}  # and every graph captured later
        for entry in st.entries():
            split(entry.module, P, align_blocks=align_blocks)
        info = graph_module_of(converted).report().pipeline
        if example_inputs is not None or example_kwargs is not None:
            info = measure(graph_module_of(converted), graph_module_of(converted).pipeline_cuts,
                           *example_batch(graph_module_of(converted), example_inputs, example_kwargs))
        st.report = dataclasses.replace(st.report, pipeline=info)
        return converted
    report, _, _ = check_stages(converted, P)
    cuts = plan(converted, P, align_blocks=align_blocks)
    for graph in converted.graphs.values():  # the same cuts in the training and the eval graph
        place_boundaries(converted, graph, report, cuts)
    converted.recompile()
    converted.record_pipeline(cuts)  # the graphs hold these cuts now, whether or not measuring below succeeds
    info = measure(converted, cuts, *example_batch(converted, example_inputs, example_kwargs))
    converted.record_pipeline(cuts, info)
    return converted
