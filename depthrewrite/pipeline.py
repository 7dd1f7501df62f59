"""Pipeline-parallel stages for converted models (torch.distributed.pipelining).

Three entry points:

* :func:`split` (also ``convert(..., pipeline_stages=P)``) places P-1 ``torch.ops.pippy._pipe_split`` nodes in both
  graphs of a converted model (training and eval), so ``torch.distributed.pipelining.pipeline(model, mb_args)``
  splits it without further hints. Cuts are placed before a sublayer, balanced by parameter count, and for Block
  schemes only at block boundaries (where the depth state is smallest).
* :func:`stages` returns the P stage modules for users who build ``PipelineStage`` objects by hand: stage ``s`` takes
  exactly what stage ``s-1`` returns (explicit tensors, static shapes) and keeps the original parameter names.
* ``stages(..., ranks=R)`` with R < P (several stages per rank, "loop" placement: stage s on rank s % R) adds
  **cross-stage caching**: a rank keeps the completed depth summaries it already holds for a micro-batch and the next
  stage on that rank receives only the new ones (the backward gradient for a cached summary is deposited in the rank
  cache and added by the stage that first held it).

What crosses a boundary is the scheme's depth state (Block AttnRes / Block MSAR: completed block summaries plus the
open partial sum; Full AttnRes: every source so far; mHC: the n streams; MoDA: the residual stream and the depth
slots) plus any *side input*: a value computed once at the graph top (RoPE cos/sin, the attention mask, position ids)
that later stages also read. Side values that depend only on shapes and buffers (RoPE, a causal mask built from the
sequence length) are **recomputed** in every stage that reads them (a copy of their computation is placed in that
stage); side values that depend on input data (a padding ``attention_mask`` passed in) are **sent** and reported.
See docs/pipelines.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict, deque
from typing import Any, Sequence

import torch
import torch.distributed.pipelining  # noqa: F401  (registers torch.ops.pippy._pipe_split)
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from .converted import _resolve
from .errors import ConfigError, PipelineError
from .passes.meta import META_KEY, NodeRole
from .passes.rewrite.registry import depth_state_ops, scheme

__all__ = [
    "PIPE_SPLIT",
    "contiguous_grad",
    "Boundary",
    "Crossing",
    "PipelineInfo",
    "RankCache",
    "CachedStage",
    "plan",
    "split",
    "stages",
    "boundary_info",
]

PIPE_SPLIT = torch.ops.pippy._pipe_split.default
aten = torch.ops.aten


# ---------------------------------------------------------------------------------------------------------------------
# report records


@dataclasses.dataclass(frozen=True)
class Crossing:
    """One tensor that crosses a stage boundary."""

    name: str  # the FX node
    label: str  # "emb", "b1", "partial b2", "X (4 streams)", "h (residual stream)", "slot K attn0", or the node name
    kind: str  # "depth" | "side" (sent) | "recomputed" (a side value each stage computes itself; not sent)
    shape: tuple[int, ...]  # at the example micro-batch
    dtype: str
    bytes_per_token: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Boundary:
    """Stage ``index`` -> ``index + 1``, placed before sublayer ``before``."""

    index: int
    before: int  # sublayer index of the first sublayer of the next stage
    tensors: tuple[Crossing, ...]
    formula: str  # the depth-state size the scheme predicts, e.g. "(N_done+1)·d = 3·32"
    formula_bytes_per_token: int

    @property
    def depth_bytes_per_token(self) -> float:
        return sum(t.bytes_per_token for t in self.tensors if t.kind == "depth")

    @property
    def side_bytes_per_token(self) -> float:
        return sum(t.bytes_per_token for t in self.tensors if t.kind == "side")

    @property
    def sent_bytes_per_token(self) -> float:
        return self.depth_bytes_per_token + self.side_bytes_per_token


@dataclasses.dataclass(frozen=True)
class PipelineInfo:
    """Where the stage boundaries are and what crosses each (part of the ConvertReport)."""

    stages: int
    cuts: tuple[int, ...]  # sublayer index where each stage after the first begins
    stage_params: tuple[int, ...]
    boundaries: tuple[Boundary, ...]
    tokens: int  # B·T of the example the shapes were measured at
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return dict(
            stages=self.stages, cuts=list(self.cuts), stage_params=list(self.stage_params), tokens=self.tokens,
            boundaries=[dict(index=b.index, before=b.before, formula=b.formula,
                             formula_bytes_per_token=b.formula_bytes_per_token,
                             sent_bytes_per_token=b.sent_bytes_per_token,
                             tensors=[t.to_dict() for t in b.tensors]) for b in self.boundaries],
            notes=list(self.notes),
        )

    def table(self) -> str:
        from tabulate import tabulate

        rows = []
        for b in self.boundaries:
            for t in b.tensors:
                rows.append([f"{b.index}->{b.index + 1}", b.before, t.kind, t.label, "x".join(map(str, t.shape)), t.dtype,
                             f"{t.bytes_per_token:g}" if t.kind != "recomputed" else f"({t.bytes_per_token:g}, not sent)"])
            rows.append([f"{b.index}->{b.index + 1}", b.before, "total sent", "", "", "",
                         f"{b.sent_bytes_per_token:g} (formula {b.formula} = {b.formula_bytes_per_token})"])
        head = (f"pipeline: {self.stages} stages, cuts before sublayers {list(self.cuts)}, "
                f"parameters per stage {[f'{p:,}' for p in self.stage_params]}")
        text = head + "\n" + tabulate(rows, headers=["boundary", "before", "kind", "tensor", "shape", "dtype", "bytes/token"],
                                      tablefmt="simple")
        if self.notes:
            text += "\n" + "\n".join(f"note: {n}" for n in self.notes)
        return text

    def __str__(self) -> str:
        return self.table()


# ---------------------------------------------------------------------------------------------------------------------
# where the cuts go


def _role(n: fx.Node) -> NodeRole | None:
    r = n.meta.get(META_KEY)
    return r if isinstance(r, NodeRole) else None


def _op_name(n: fx.Node) -> str | None:
    packet = getattr(n.target, "overloadpacket", None)
    return getattr(packet, "__name__", None) if packet is not None else None


def _is_depth_op(n: fx.Node) -> bool:
    return n.op == "call_function" and getattr(n.target, "namespace", None) == "depthrewrite" and _op_name(n) in depth_state_ops()


def _anchor(graph: fx.Graph, report, j: int) -> fx.Node:
    """The first node of the stage that begins with sublayer j (1 <= j < L): the scheme record's ``stage_anchor``."""
    record = scheme(report.config)
    node = record.hook("stage_anchor", "pipeline planning")(graph, report, j)
    if node is None:
        raise ConfigError(
            f"pipeline: cannot find where sublayer {j} begins in the converted {record.name} graph (a graph converted by "
            "depthrewrite marks every mixing site); convert the model again and split the fresh conversion"
        )
    return node


def _segment_params(gm: fx.GraphModule, graph: fx.Graph, anchors: list[fx.Node]) -> list[int]:
    """Parameter count of each segment between consecutive candidate anchors (a parameter counts where first used)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    starts = [order[a] for a in anchors]
    seg = [0] * (len(anchors) + 1)
    seen: set[int] = set()
    for n in graph.nodes:
        if n.op != "get_attr":
            continue
        p = _resolve(gm, n.target)
        if not isinstance(p, nn.Parameter) or id(p) in seen:
            continue
        seen.add(id(p))
        first = min((order[u] for u in n.users), default=order[n])
        k = sum(1 for s in starts if s <= first)
        seg[k] += p.numel()
    return seg


def _check(converted, P) -> tuple[Any, int, int]:
    from .converted import ConvertedGraphModule

    if not isinstance(converted, ConvertedGraphModule):
        raise ConfigError(f"pipeline: expected a model returned by depthrewrite.convert(), got {type(converted).__name__}")
    report = converted.report()
    L = len(report.chain.sublayers)
    if not isinstance(P, int) or isinstance(P, bool) or P < 1:
        raise ConfigError(f"pipeline_stages must be an integer >= 1, got {P!r}")
    if P > L:
        raise ConfigError(
            f"pipeline_stages={P} is more than the model's {L} sublayers: each stage needs at least one sublayer; use 1..{L}"
        )
    S = report.block_size or 1
    return report, L, S


def plan(converted, P: int, *, align_blocks: bool = True) -> tuple[int, ...]:
    """The sublayer index where each of stages 1..P-1 begins: balanced by parameter count (the embedding counts for
    stage 0, the final norm and head for the last); for Block AttnRes / Block MSAR only block boundaries (sublayer
    j with j % S == 0, where the state is smallest) unless ``align_blocks=False``."""
    report, L, S = _check(converted, P)
    if P == 1:
        return ()
    name = report.config.name
    aligned = align_blocks and scheme(report.config).block_form and S > 1
    allowed = [j for j in range(1, L) if not aligned or j % S == 0]
    if len(allowed) < P - 1:
        n_eff = math.ceil(L / S)
        raise ConfigError(
            f"pipeline_stages={P}: Block {name} with S={S} sublayers per block has {n_eff} blocks, so only "
            f"{len(allowed) + 1} stages can begin on a block boundary; use pipeline_stages <= {len(allowed) + 1}, more "
            "blocks (blocks=...), or align_blocks=False to cut inside a block (the open partial sum then crosses too)"
        )
    graph = converted.graph
    anchors = [_anchor(graph, report, j) for j in range(1, L)]
    seg = _segment_params(converted, graph, anchors)  # seg[k]: sublayer k (+ embedding / head at the ends)
    pref = [0]
    for c in seg:
        pref.append(pref[-1] + c)

    def cost(a: int, b: int) -> int:
        return pref[b] - pref[a]

    # minimise the largest stage (then the earliest cuts) over cuts at allowed positions; L is small
    table = {a: (cost(0, a), (a,)) for a in allowed}  # last cut -> (largest stage so far, cuts)
    for _ in range(P - 2):
        nxt: dict[int, tuple[int, tuple[int, ...]]] = {}
        for a, (m, cuts) in table.items():
            for b in allowed:
                if b > a:
                    cand = (max(m, cost(a, b)), cuts + (b,))
                    if b not in nxt or cand < nxt[b]:
                        nxt[b] = cand
        table = nxt
    best = min((max(m, cost(a, L)), cuts) for a, (m, cuts) in table.items())
    return best[1]


# ---------------------------------------------------------------------------------------------------------------------
# placing the boundaries in a graph


def _nondeterministic(n: fx.Node) -> bool:
    tags = getattr(n.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags or _op_name(n) in ("dropout", "native_dropout", "bernoulli")


def _is_sym(n: fx.Node) -> bool:
    v = n.meta.get("val", n.meta.get("example_value"))
    return isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)) and not isinstance(v, torch.Tensor)


def _free_nodes(gm: fx.GraphModule, graph: fx.Graph) -> set[fx.Node]:
    """Tensor nodes computed from shapes, buffers and constants only (no input data, no trainable parameter): any
    stage can recompute them instead of receiving them."""
    free: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "get_attr":
            obj = _resolve(gm, n.target)
            if not (isinstance(obj, nn.Parameter) and obj.requires_grad) and not isinstance(obj, nn.Module):
                free.add(n)
        elif n.op == "call_function":
            if _is_sym(n) or n.target is PIPE_SPLIT or _nondeterministic(n) or n.is_impure() or _is_depth_op(n):
                continue
            if all(a in free or _is_sym(a) for a in n.all_input_nodes):
                free.add(n)
    return free


def _fold_buffer_casts(gm: fx.GraphModule, graph: fx.Graph) -> None:
    """``buffer.to(its own dtype/device)`` returns the buffer itself; reading the buffer directly lets each stage (and
    pipeline()'s re-export, which sees one tensor) use its own replica instead of receiving the alias."""
    for n in list(graph.nodes):
        if n.op == "call_function" and _op_name(n) == "to" and n.args and isinstance(n.args[0], fx.Node) \
                and n.args[0].op == "get_attr":
            src, v = _resolve(gm, n.args[0].target), n.meta.get("val")
            if isinstance(src, torch.Tensor) and isinstance(v, torch.Tensor) and v.dtype == src.dtype and v.device == src.device:
                n.replace_all_uses_with(n.args[0])
                graph.erase_node(n)


_CLONE_KEY = "depthrewrite_pipeline_recomputed"  # node.meta: the side value a per-stage copy recomputes


def _place(gm: fx.GraphModule, graph: fx.Graph, report, cuts: Sequence[int]) -> None:
    """Give every node a stage, copy side values built from shapes and buffers into each later stage that reads them,
    reorder ``graph`` stage by stage and insert the pipe_split nodes between stages."""
    for n in [n for n in graph.nodes if n.op == "call_function" and n.target is PIPE_SPLIT]:
        graph.erase_node(n)  # re-splitting replaces earlier boundaries
    # convert() already dropped export's dtype asserts and the dead code they kept alive (converted.drop_dead_code)
    _fold_buffer_casts(gm, graph)
    anchors = {_anchor(graph, report, j): k + 1 for k, j in enumerate(cuts)}
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
    free = _free_nodes(gm, graph)
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
            c.meta[_CLONE_KEY] = n.meta.get(_CLONE_KEY, n.name)
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
    for n in nodes:
        while stage[n] > cur:
            cur += 1
            with graph.inserting_before(out):
                graph.call_function(PIPE_SPLIT, ())
        out.prepend(n)
    graph.lint()


def split(converted, P: int, *, align_blocks: bool = True, example_inputs: tuple | None = None,
          example_kwargs: dict | None = None):
    """Place P-1 ``torch.ops.pippy._pipe_split`` boundaries in both graphs of ``converted`` (in place; returns it).

    ``torch.distributed.pipelining.pipeline(converted, mb_args)`` then splits at them. The conversion report gains a
    pipeline section (``converted.report().pipeline``): per boundary the tensors crossing and their bytes per token,
    measured at ``example_inputs`` (default: the inputs the model was converted with).

    Raises:
        ConfigError: P < 1, more stages than sublayers, or (Block schemes) more stages than block boundaries.
    """
    report, L, S = _check(converted, P)
    cuts = plan(converted, P, align_blocks=align_blocks)
    for graph in converted._dr_graphs.values():  # the same cuts in the training and the eval graph
        _place(converted, graph, report, cuts)
    converted.recompile()
    converted._dr_pipeline_cuts = cuts
    if example_inputs is None and example_kwargs is None:
        example_inputs, example_kwargs = converted.meta.get("depthrewrite_inputs", ((), {}))
    info = boundary_info(converted, example_inputs, example_kwargs)
    converted._dr_report = dataclasses.replace(report, pipeline=info)
    return converted


# ---------------------------------------------------------------------------------------------------------------------
# stage modules


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


def _flat_inputs(converted, args, kwargs) -> list:
    from .converted import _bind_inputs

    pos, kw = _bind_inputs(converted, tuple(args or ()), dict(kwargs or {}))
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
        if n.op == "call_function" and n.target is PIPE_SPLIT:
            s += 1
        st[n] = s
    return st


def _specialise(converted, graph: fx.Graph, flat: list) -> tuple[fx.Graph, dict[fx.Node, Any]]:
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


def _crossings(g: fx.Graph) -> tuple[dict[fx.Node, int], list[list[fx.Node]]]:
    st = _stage_of(g)
    P = max(st.values()) + 1 if st else 1
    live: list[list[fx.Node]] = [[] for _ in range(P - 1)]
    for n in g.nodes:
        if n.op in ("get_attr", "output") or (n.op == "call_function" and n.target is PIPE_SPLIT):
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
    from .passes.analyse.graph import module_path_of

    where = module_path_of(n)
    return f"{name or n.name} ({where})" if where else (name or n.name)


def _formula(report, j: int) -> tuple[str, int]:
    """The depth state per token at a cut before sublayer j (the scheme record's ``state_at``) and its bytes."""
    state = scheme(report.config).hook("state_at", "pipeline boundary report")(report, j)
    return state.formula, state.elements * report.bytes_per_element


def boundary_info(converted, example_inputs: tuple | None = None, example_kwargs: dict | None = None) -> PipelineInfo:
    """Measure what crosses each boundary of a split converted model at one example (micro-)batch."""
    if example_inputs is None and example_kwargs is None:
        example_inputs, example_kwargs = converted.meta.get("depthrewrite_inputs", ((), {}))
    report = converted.report()
    cuts = getattr(converted, "_dr_pipeline_cuts", ())
    flat = _flat_inputs(converted, example_inputs, example_kwargs)
    g, vals = _specialise(converted, converted.graph, flat)
    tokens = _tokens(vals, g)
    st, live = _crossings(g)
    # recomputed side values: the clones the split placed in later stages
    clone_of = {n: n.meta[_CLONE_KEY] for n in g.nodes if n.op == "call_function" and _CLONE_KEY in n.meta}
    bounds = []
    for k, nodes in enumerate(live):
        rows = []
        labels = _labels(converted, g, cuts[k] if k < len(cuts) else -1)
        for n in nodes:
            v = vals.get(n)
            if not isinstance(v, torch.Tensor):
                continue
            depth = n in labels or any(_is_depth_op(u) for u in n.users)
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
            p = _resolve(converted, n.target)
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


class _ContiguousGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def contiguous_grad(x):
    """Identity whose gradient is contiguous. PipelineStage sizes the previous stage's receive buffer from the gradient
    this stage computes for its input, and gloo refuses non-contiguous buffers (a custom op's backward may return an
    expanded gradient), so every received tensor passes through this."""
    return _ContiguousGrad.apply(x) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _build(converted, g: fx.Graph, st: dict[fx.Node, int], live: list[list[fx.Node]], s: int) -> fx.GraphModule:
    P = len(live) + 1
    sg = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    root: dict[str, Any] = {}
    if s == 0:
        for n in g.nodes:
            if n.op == "placeholder":
                env[n] = sg.placeholder(n.name)
    else:
        for n in live[s - 1]:
            ph = sg.placeholder(n.name)
            ph.meta = dict(n.meta)
            floating = isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_floating_point()
            env[n] = sg.call_function(contiguous_grad, (ph,)) if floating or "val" not in n.meta else ph

    def get(a: fx.Node) -> fx.Node:
        if a not in env:
            if a.op != "get_attr":
                raise ConfigError(f"pipeline: stage {s} reads `{a.name}` from stage {st[a]} without it crossing")
            root[a.target] = _resolve(converted, a.target)
            env[a] = sg.get_attr(a.target)
        return env[a]

    for n in g.nodes:
        if st[n] != s or n.op in ("placeholder", "get_attr", "output") or (n.op == "call_function" and n.target is PIPE_SPLIT):
            continue
        for a in n.all_input_nodes:
            get(a)
        env[n] = sg.node_copy(n, lambda a: env[a])
    if s < P - 1:
        sg.output(tuple(get(n) for n in live[s]))
    else:
        out = next(n for n in g.nodes if n.op == "output")
        res = pytree.tree_map_only(fx.Node, get, out.args[0])
        flat = pytree.tree_leaves(res)
        sg.output(flat[0] if len(flat) == 1 else tuple(flat))
    sg.eliminate_dead_code()
    sg.lint()
    return fx.GraphModule(root, sg, class_name=f"Stage{s}")


def stages(converted, P: int | None = None, example_inputs: tuple | None = None, example_kwargs: dict | None = None,
           *, ranks: int | None = None, align_blocks: bool = True) -> list[nn.Module]:
    """The P stage modules of ``converted`` for one micro-batch shape, in the current mode (training or eval).

    Args:
        converted: a model from :func:`depthrewrite.convert`; split here if it is not yet split into P stages.
        P: number of stages (default: the split already placed by ``convert(..., pipeline_stages=P)``).
        example_inputs, example_kwargs: one **micro-batch**, as you call the converted model; the stages are specialised
            to its shapes (pipelining needs static shapes): build them again for another micro-batch shape.
        ranks: pipeline ranks R, when R < P (several stages per rank, stage s on rank s % R): the stages cache the
            completed depth summaries per rank (:class:`CachedStage`) and receive only the new ones.

    Returns:
        ``[stage_0, ..., stage_{P-1}]``: stage 0 takes the model's inputs (flattened, tensors only), stage s > 0 takes
        exactly the tuple stage s-1 returns, the last returns the model's output tensor(s). Parameters keep their
        names in ``converted`` and are the same objects (their gradients land in ``converted``).
    """
    if ranks is not None and (not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1):
        raise ConfigError(f"ranks must be an integer >= 1 (the number of pipeline ranks), got {ranks!r}")
    cuts = getattr(converted, "_dr_pipeline_cuts", None)
    if P is None:
        P = len(cuts) + 1 if cuts is not None else 1
    if cuts is None or len(cuts) + 1 != P:
        split(converted, P, align_blocks=align_blocks, example_inputs=example_inputs, example_kwargs=example_kwargs)
    if example_inputs is None and example_kwargs is None:
        example_inputs, example_kwargs = converted.meta.get("depthrewrite_inputs", ((), {}))
    flat = _flat_inputs(converted, example_inputs, example_kwargs)
    g, vals = _specialise(converted, converted.graph, flat)
    st, live = _crossings(g)
    mods = [_build(converted, g, st, live, s) for s in range(len(live) + 1)]
    for s, m in enumerate(mods):
        m._dr_inputs = tuple(n.name for n in live[s - 1]) if s else tuple(n.name for n in g.nodes if n.op == "placeholder")
        m._dr_outputs = tuple(n.name for n in live[s]) if s < len(live) else ()
        m.train(converted.training)
    if ranks is None or ranks >= P:
        return mods
    return _cached(mods, g, st, live, vals, ranks)


# ---------------------------------------------------------------------------------------------------------------------
# cross-stage caching


class _Entry:
    __slots__ = ("value", "grad")

    def __init__(self, value: torch.Tensor):
        self.value, self.grad = value, None

    def deposit(self, g: torch.Tensor) -> None:
        self.grad = g.detach().clone() if self.grad is None else self.grad + g


class RankCache:
    """Per-rank store of depth summaries already held for a micro-batch: one FIFO per (value, consumer stage); stages
    run their micro-batches in order, so the consumer's next read is the owner's next write."""

    def __init__(self):
        self._q: dict[tuple[str, int], deque] = defaultdict(deque)

    def put(self, name: str, consumer: int, entry: _Entry) -> None:
        self._q[(name, consumer)].append(entry)

    def take(self, name: str, consumer: int) -> _Entry:
        q = self._q.get((name, consumer))
        if not q:
            raise PipelineError(
                f"cross-stage cache: stage {consumer} found no cached `{name}` for its next micro-batch (the earlier "
                "stage on its rank has not run that micro-batch's forward yet). Use a schedule that runs each stage's "
                "micro-batches in order with stage s on rank s % R (ScheduleLoopedBFS; not ZBV's V-shaped placement), "
                "and build fresh stages with pp.stages(..., ranks=R) after an interrupted step", stage=consumer)
        return q.popleft()

    def __len__(self) -> int:
        return sum(len(q) for q in self._q.values())


class _Deposit(torch.autograd.Function):
    """Identity on ``anchor``; in backward, the gradients later stages on this rank deposited for the cached values are
    added to those values' gradients (before they travel upstream)."""

    @staticmethod
    def forward(ctx, anchor, entries, *values):
        ctx.entries = entries
        return anchor.view_as(anchor)

    @staticmethod
    def backward(ctx, g):
        return (g, None, *[e.grad for e in ctx.entries])


class CachedStage(nn.Module):
    """A stage module that exchanges only what the neighbouring rank does not already hold.

    ``wire_inputs`` / ``wire_outputs`` name what is received / sent; the rest of the full interface comes from (goes
    to) the :class:`RankCache` shared by the stages on one rank. ``sent_bytes`` and ``full_bytes`` count the forward
    payload sent with and without the cache over ``forwards`` calls (PipelineStage's shape inference is one of them);
    the backward sends gradients of the same tensors. Parameters keep the converted model's names.
    """

    def __init__(self, module: fx.GraphModule, index: int, cache: RankCache, wire_in: list[int], cached_in: list[int],
                 wire_out: list[int], puts: list[tuple[int, int, list[int]]]):
        super().__init__()
        # the stage's parameters keep the converted model's names (no "module." prefix): share its children
        object.__setattr__(self, "module", module)
        for name, child in module.named_children():
            self.add_module(name, child)
        for name, p in module._parameters.items():
            self.register_parameter(name, p)
        for name, b in module._buffers.items():
            self.register_buffer(name, b)
        self.index = index
        self.cache = cache
        self._wire_in, self._cached_in, self._wire_out, self._puts = wire_in, cached_in, wire_out, puts
        names_in, names_out = module._dr_inputs, module._dr_outputs
        self.wire_inputs = tuple(names_in[i] for i in wire_in)
        self.cached_inputs = tuple(names_in[i] for i in cached_in)
        self.wire_outputs = tuple(names_out[i] for i in wire_out) if names_out else ()
        self.sent_bytes = 0
        self.full_bytes = 0
        self.forwards = 0

    def forward(self, *wire):
        names_in = self.module._dr_inputs
        full: list[Any] = [None] * len(names_in)
        for i, v in zip(self._wire_in, wire):
            full[i] = v
        grad = torch.is_grad_enabled()
        for i in self._cached_in:
            e = self.cache.take(names_in[i], self.index)
            x = e.value.detach()
            if grad and x.is_floating_point():
                x.requires_grad_(True)
                x.register_hook(lambda g, e=e: e.deposit(g))
            full[i] = x
        out = self.module(*full)
        self.forwards += 1
        if not self.module._dr_outputs:  # last stage
            return out
        out = tuple(out)
        entries, values = [], []
        for where, i, consumers in self._puts:  # this stage is the first on its rank to hold these values
            v = full[i] if where == 0 else out[i]
            e = _Entry(v.detach())
            for c in consumers:
                self.cache.put((names_in if where == 0 else self.module._dr_outputs)[i], c, e)
            entries.append(e)
            values.append(v)
        sent = [out[i] for i in self._wire_out]
        self.full_bytes += sum(t.numel() * t.element_size() for t in out)
        self.sent_bytes += sum(t.numel() * t.element_size() for t in sent)
        if entries and grad:
            k = next((k for k, t in enumerate(sent) if t.is_floating_point() and t.requires_grad), None)
            if k is None:
                raise PipelineError(
                    f"cross-stage cache: stage {self.index} sends no floating tensor that requires grad, so the gradients "
                    "of the depth summaries cached on its rank have nothing to travel back with. Run this stage with "
                    "parameters that require grad, or build the stages without the cache (pp.stages(..., ranks=None))",
                    stage=self.index)
            sent[k] = _Deposit.apply(sent[k], entries, *values)
        return tuple(sent)


def _cached(mods, g, st, live, vals, R: int) -> list[nn.Module]:
    P = len(mods)
    defined = {n: st[n] for n in g.nodes}
    caches = {r: RankCache() for r in range(R)}

    def held_by_rank_before(n: fx.Node, stage: int) -> bool:
        # stage - R is on the same rank; it held n if n was defined at or before it (n is live in between)
        return stage - R >= 0 and defined[n] <= stage - R and vals.get(n) is not None and isinstance(vals[n], torch.Tensor)

    out = []
    for s, m in enumerate(mods):
        ins = live[s - 1] if s else []
        outs = live[s] if s < P - 1 else []
        cached_in = [i for i, n in enumerate(ins) if held_by_rank_before(n, s)]
        wire_in = [i for i in range(len(ins) if s else len(m._dr_inputs)) if i not in cached_in]
        wire_out = [i for i, n in enumerate(outs) if not held_by_rank_before(n, s + 1)]
        # values this stage is the first on its rank to hold, which later stages on the rank read from the cache
        puts = []
        for where, lst in ((0, ins), (1, outs)):
            for i, n in enumerate(lst):
                if where == 1 and n in ins:
                    continue  # passed through: recorded as an input
                if s - R >= 0 and defined[n] <= s - R:
                    continue  # an earlier stage on this rank owns it
                consumers = [c for c in range(s + R, P, R) if c >= 1 and n in live[c - 1] and held_by_rank_before(n, c)]
                if consumers and isinstance(vals.get(n), torch.Tensor):
                    puts.append((where, i, consumers))
        out.append(CachedStage(m, s, caches[s % R], wire_in, cached_in, wire_out, puts))
    return out
