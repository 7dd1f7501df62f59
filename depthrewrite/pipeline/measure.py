"""Measuring a split graph at one example micro-batch: the graph specialised to its shapes, the stage of every node,
what crosses each boundary (labelled by the scheme record's ``boundary_labels``, predicted by its ``state_at``), and
:func:`boundary_info`, the report's pipeline section."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from ..passes.rewrite.registry import scheme
from .nodes import CLONE_KEY, is_split, reads_as_depth_state
from .records import Boundary, Crossing, PipelineInfo

__all__ = ["boundary_info", "measure", "example_batch", "flat_inputs", "specialise", "crossings"]


def _meta_like(v: Any) -> Any:
    """What the stage planning needs of a value: Python scalars as they are, tensors as meta tensors (shape and dtype,
    no storage)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), v)


class _Record(fx.Interpreter):
    """Runs the graph once with garbage collection on (intermediates, attention probabilities included, are freed as
    in a normal forward) and keeps only each node's shape and dtype (:func:`_meta_like`) and its scalar values."""

    def __init__(self, gm, graph):
        super().__init__(gm, graph=graph, garbage_collect_values=True)
        self.values: dict[fx.Node, Any] = {}

    def run_node(self, n):
        v = super().run_node(n)
        self.values[n] = _meta_like(v)
        return v


def flat_inputs(converted, args, kwargs) -> list:
    """A call's inputs as the graph's placeholders take them (bound to the forward's signature, flattened)."""
    pos, kw = converted.bind_inputs(tuple(args or ()), dict(kwargs or {}))
    info = converted.graph._codegen.pytree_info if hasattr(converted.graph._codegen, "pytree_info") else None
    if info is None or info.in_spec is None:
        return list(pos) + list(kw.values())
    flat, spec = pytree.tree_flatten((pos, kw))
    if spec != info.in_spec:
        import torch.fx._pytree as fx_pytree

        flat = fx_pytree.tree_flatten_spec((pos, kw), info.in_spec)
    return list(flat)


def _stage_of(graph: fx.Graph) -> dict[fx.Node, int]:
    st, s = {}, 0
    for n in graph.nodes:
        if is_split(n):
            s += 1
        st[n] = s
    return st


def specialise(converted, graph: fx.Graph, flat: list) -> tuple[fx.Graph, dict[fx.Node, Any]]:
    """A copy of ``graph`` with every shape value fixed to the example's (static shapes), and per node the example's
    value: Python scalars as computed, tensors as meta tensors of the example's shape and dtype."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = g.graph_copy(graph, env)
    g.output(out)
    rec = _Record(converted, g)
    with torch.no_grad():
        rec.run(*flat)
    vals = rec.values
    for n in list(g.nodes):
        if n.op == "call_module" and not n.users:
            g.erase_node(n)  # export's _guards_fn: the stage shapes are fixed
        elif n.op == "call_function" and isinstance(vals.get(n), (int, float, bool)) and not isinstance(vals[n], torch.Tensor):
            for u in list(n.users):
                u.args = pytree.tree_map_only(fx.Node, lambda a: vals[n] if a is n else a, u.args)
                u.kwargs = pytree.tree_map_only(fx.Node, lambda a: vals[n] if a is n else a, u.kwargs)
            g.erase_node(n)
    g.eliminate_dead_code()
    return g, vals


def _tokens(vals: dict[fx.Node, Any], graph: fx.Graph) -> int:
    """B·T: the leading two dims of the first 3-d floating tensor (the stream)."""
    for n in graph.nodes:
        v = vals.get(n)
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() >= 3:
            return int(v.shape[0] * v.shape[1])
    return 1


def crossings(g: fx.Graph) -> tuple[dict[fx.Node, int], list[list[fx.Node]]]:
    """``(stage of each node, live)``: ``live[k]`` holds the values computed in stage k or before and read after it
    (what crosses boundary k -> k+1)."""
    st = _stage_of(g)
    P = max(st.values()) + 1 if st else 1
    live: list[list[fx.Node]] = [[] for _ in range(P - 1)]
    for n in g.nodes:
        if n.op in ("get_attr", "output") or is_split(n):
            continue
        last = max((st[u] for u in n.users), default=st[n])
        for k in range(st[n], min(last, P - 1)):
            live[k].append(n)
    return st, live


def _labels(converted, g: fx.Graph, j: int) -> dict[fx.Node, str]:
    """Readable names of the depth-state values at a cut before sublayer j: the scheme record's ``boundary_labels``."""
    report = converted.report()
    return scheme(report.config).hook("boundary_labels", "pipeline boundary report")(g, report, j)


def _side_label(n: fx.Node, name: str | None = None) -> str:
    from ..passes.analyse.graph import module_path_of

    where = module_path_of(n)
    return f"{name or n.name} ({where})" if where else (name or n.name)


def _formula(report, j: int) -> tuple[str, int]:
    """The depth state per token at a cut before sublayer j (the scheme record's ``state_at``) and its bytes."""
    state = scheme(report.config).hook("state_at", "pipeline boundary report")(report, j)
    return state.formula, state.elements * report.bytes_per_element


def example_batch(converted, example_inputs: tuple | None, example_kwargs: dict | None) -> tuple[tuple, dict]:
    """The example (micro-)batch to measure at: the one given, else the inputs the model was converted with."""
    if example_inputs is None and example_kwargs is None:
        return converted.meta.get("depthrewrite_inputs", ((), {}))
    return example_inputs, example_kwargs


def boundary_info(converted, example_inputs: tuple | None = None, example_kwargs: dict | None = None) -> PipelineInfo:
    """Measure what crosses each boundary of a split converted model at one example (micro-)batch."""
    from ..converted import graph_module_of

    converted = graph_module_of(converted, "pipeline")
    return measure(converted, converted.pipeline_cuts or (), *example_batch(converted, example_inputs, example_kwargs))


def measure(converted, cuts: Sequence[int], example_inputs: tuple | None, example_kwargs: dict | None) -> PipelineInfo:
    """:func:`boundary_info` of ``converted``'s graph (in the current mode) split before sublayers ``cuts``."""
    report = converted.report()
    flat = flat_inputs(converted, example_inputs, example_kwargs)
    g, vals = specialise(converted, converted.graph, flat)
    tokens = _tokens(vals, g)
    st, live = crossings(g)
    # recomputed side values: the clones the split placed in later stages
    clone_of = {n: n.meta[CLONE_KEY] for n in g.nodes if n.op == "call_function" and CLONE_KEY in n.meta}
    bounds = []
    for k, nodes in enumerate(live):
        rows = []
        labels = _labels(converted, g, cuts[k] if k < len(cuts) else -1)
        for n in nodes:
            v = vals.get(n)
            if not isinstance(v, torch.Tensor):
                continue
            depth = n in labels or any(reads_as_depth_state(u, n) for u in n.users)
            rows.append(Crossing(
                name=n.name, label=labels.get(n, _side_label(n)), kind="depth" if depth else "side", shape=tuple(v.shape),
                dtype=str(v.dtype).replace("torch.", ""), bytes_per_token=v.numel() * v.element_size() / tokens,
            ))
        seen = set()
        for n in g.nodes:
            if st[n] == k + 1 and n in clone_of and n.op == "call_function" and clone_of[n] not in seen:
                # report only the values the stage reads (not the intermediate steps of their computation)
                if any(st[u] == k + 1 and u not in clone_of for u in n.users):
                    v = vals.get(n)
                    if isinstance(v, torch.Tensor):
                        seen.add(clone_of[n])
                        rows.append(Crossing(name=n.name, label=_side_label(n, clone_of[n]), kind="recomputed", shape=tuple(v.shape),
                                             dtype=str(v.dtype).replace("torch.", ""),
                                             bytes_per_token=v.numel() * v.element_size() / tokens))
        j = cuts[k] if k < len(cuts) else -1
        formula, fb = _formula(report, j)
        bounds.append(Boundary(index=k, before=j, tensors=tuple(rows), formula=formula, formula_bytes_per_token=fb))
    stage_params = [0] * (len(live) + 1)
    readers: dict[int, tuple[str, set[int]]] = {}
    for n in g.nodes:
        if n.op == "get_attr":
            p = converted.resolve_attr(n.target)
            if isinstance(p, nn.Parameter):
                if id(p) not in readers:
                    stage_params[st[n]] += p.numel()
                readers.setdefault(id(p), (n.target, set()))[1].update(st[u] for u in n.users)
    notes = [f"parameter {name} is read by stages {sorted(where)} (tied weights): each stage holds it and computes "
             "part of its gradient; sum those gradients across the ranks before the optimiser step"
             for name, where in readers.values() if len(where) > 1]
    if any(t.kind == "side" for b in bounds for t in b.tensors):
        notes.append("side inputs that depend on input data are sent to every stage that reads them")
    if any(t.kind == "recomputed" for b in bounds for t in b.tensors):
        notes.append("recomputed: side values built from shapes and buffers only (RoPE, causal mask); each stage "
                     "computes its own copy and nothing is sent")
    return PipelineInfo(stages=len(live) + 1, cuts=tuple(cuts), stage_params=tuple(stage_params),
                        boundaries=tuple(bounds), tokens=tokens, notes=tuple(notes))
