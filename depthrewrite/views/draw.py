"""Pictures of a *converted* model: its rewritten FX graph, contracted to the parts a reader cares about.

``depthrewrite.views.report.ChainReport`` draws the chain that detection found in the original model. This module draws what
the rewrite produced, read back from the converted graph itself (not from the report's summary)::

    g = rewritten_networkx(converted)        # networkx DiGraph: source, sublayers, stream values, depthrewrite ops
    text = rewritten_text(converted)         # the same as lines of text (the demo writes it next to the picture)
    path = save_rewritten(converted, "attnres.svg")   # .svg/.png: Graphviz if installed, else matplotlib;
                                                      # attnres.dot and attnres.txt beside it, always

Contraction: every node of the converted graph is put in a group by the module that produced it — the stream source,
one group per sublayer (its branch modules and norms), the final norm — or is one of the scheme's own
``depthrewrite::`` ops (``depth_attn``, ``msar_mix``, ``mhc_*``, ``moda_*``), or is a residual add of the stream that the
rewrite kept. Everything else (adds of partial sums, stacks, views, casts, new projections) is glue: an edge joins two
groups when a dataflow path runs between them through glue only.
"""

from __future__ import annotations

from pathlib import Path

import networkx as nx
import torch
import torch.fx as fx

from ..errors import ConfigError
from ..passes.analyse.graph import module_path_of
from .report import write_dot

__all__ = ["rewritten_networkx", "rewritten_dot", "rewritten_text", "save_rewritten"]

_FILL = dict(
    source="#cfe2ff", stream="#e9ecef", final_norm="#fff3cd", op="#ffd8a8", output="#e2d9f3",
    attention="#d1e7dd", mlp="#f8d7da", other="#e2d9f3",
)


def _graph(converted):
    """``(report, graph module)`` of a converted model (its graph in the current mode) or of one converted graph."""
    from ..converted import graph_module_of

    gm = graph_module_of(converted, "rewritten-graph drawing")
    return gm.report(), gm


def _owner(path: str | None, owners: list[tuple[str, str]]) -> str | None:
    if not path:
        return None
    for prefix, group in owners:  # longest prefixes first
        if path == prefix or path.startswith(prefix + "."):
            return group
    return None


def rewritten_networkx(converted: fx.GraphModule) -> nx.DiGraph:
    """The converted graph contracted to groups (see the module docstring); node attributes ``role``, ``label`` and
    ``nodes`` (the FX node names in the group)."""
    report, gm = _graph(converted)
    chain = report.chain
    g = nx.DiGraph(model=report.model_class, scheme=report.config.describe(report.block_size))

    owners: list[tuple[str, str]] = []
    labels: dict[str, tuple[str, str]] = {}  # group -> (role, label)
    for s in chain.sublayers:
        group = f"sub{s.index}"
        labels[group] = (s.kind.split("+")[0] if "+" not in s.kind else "other", f"{s.index}: {s.kind}\\n{s.branch_module or s.module}")
        for b in s.branches:
            for site in (b.pre_norm, b.post_norm):
                if site is not None and site.module:
                    owners.append((site.module, group))
            if b.module:
                owners.append((b.module, group))
    if chain.final_norm.module:
        owners.append((chain.final_norm.module, "final_norm"))
    labels["final_norm"] = ("final_norm", f"final norm\\n{chain.final_norm.module or chain.final_norm.output}")
    if chain.source_module:
        owners.append((chain.source_module, "source"))
    labels["source"] = ("source", f"stream source\\n{chain.source_module or chain.source}")
    owners.sort(key=lambda o: -len(o[0]))

    kept_adds = {s.residual_add: s.index for s in chain.sublayers}
    live = _live_nodes(gm.graph)
    group_of: dict[fx.Node, str] = {}
    after_source = False  # sums before the stream source build it (token + position embeddings): not drawn
    for n in gm.graph.nodes:
        after_source = after_source or n.name == chain.source
        if n not in live:
            continue
        target = getattr(n, "target", None)
        ns = getattr(target, "namespace", None) or getattr(getattr(target, "_schema", None), "name", "").split("::")[0]
        if n.op == "call_function" and ns == "depthrewrite":
            role = n.meta.get("depthrewrite")
            op = str(target).split(".")[1] if str(target).count(".") >= 1 else str(target)
            site = getattr(role, "site", None)
            group = f"op:{n.name}"
            labels[group] = ("op", f"{op}" + (f" (site {site})" if site is not None else "") + f"\\n`{n.name}`")
            group_of[n] = group
        elif n.name in kept_adds:
            k = kept_adds[n.name]
            group_of[n] = f"h{k + 1}"
            labels[f"h{k + 1}"] = ("stream", f"h{k + 1} = h{k} + out{k}")
        elif n.name == chain.source:
            group_of[n] = "source"
        elif n.op == "output":
            group_of[n] = "output"
            labels["output"] = ("output", "output")
        elif n.op == "call_function":
            grp = _owner(module_path_of(n), owners)
            if grp is not None:
                group_of[n] = grp
            elif after_source and _is_stream_sum(n, chain.hidden_size):  # a sum the rewrite keeps: Block AttnRes/MSAR's block sums
                group_of[n] = f"sum:{n.name}"
                labels[f"sum:{n.name}"] = ("stream", f"Σ `{n.name}`")

    for n, group in group_of.items():  # nodes in graph order of their first FX node
        if group not in g:
            role, label = labels[group]
            g.add_node(group, role=role, label=label, nodes=[])
        g.nodes[group]["nodes"].append(n.name)

    # every FX edge between value nodes, except through shape arithmetic and metadata asserts (not dataflow)
    def passes(node: fx.Node) -> bool:
        name = str(getattr(node, "target", ""))
        if node not in live or "sym_size" in name or node.op in ("get_attr", "placeholder"):
            return False
        return not isinstance(node.meta.get("val"), (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool))

    for n, group in group_of.items():
        seen = {n}
        todo = [u for u in n.users if passes(u)]
        while todo:
            cur = todo.pop()
            if cur in seen:
                continue
            seen.add(cur)
            other = group_of.get(cur)
            if other is None:
                todo.extend(u for u in cur.users if passes(u))
            elif other != group:
                g.add_edge(group, other)
    for s in chain.sublayers:  # a kept residual add reads the previous stream value (through the pre-norm's cast)
        h, prev = f"h{s.index + 1}", ("source" if s.index == 0 else f"h{s.index}")
        if h in g and prev in g:
            g.add_edge(prev, h)
    return g


def _is_stream_sum(n: fx.Node, hidden: int) -> bool:
    v = n.meta.get("val")
    return (
        n.target is torch.ops.aten.add.Tensor
        and isinstance(v, torch.Tensor)
        and v.is_floating_point()
        and v.dim() >= 2
        and isinstance(v.shape[-1], int)
        and v.shape[-1] == hidden
    )


def _live_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes whose value reaches the output. Export's metadata asserts keep otherwise dead values in the graph (a
    rewrite may leave the original residual adds behind them); they do not count as readers here."""
    live: set[fx.Node] = set()
    for n in reversed(list(graph.nodes)):
        if n.op == "output" or any(u in live for u in n.users):
            if "_assert" not in str(n.target):
                live.add(n)
    return live


def rewritten_dot(converted: fx.GraphModule, g: nx.DiGraph | None = None) -> str:
    """Graphviz DOT text of :func:`rewritten_networkx` (``g``: that graph, when already built)."""
    g = rewritten_networkx(converted) if g is None else g
    title = f"{g.graph['model']} -> {g.graph['scheme']}".replace('"', '\\"')
    lines = [
        'digraph "rewritten" {',
        "  rankdir=TB;",
        f'  labelloc=t; label="{title}"; fontname="Helvetica";',
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
        '  edge [color="#495057"];',
    ]
    for n, d in g.nodes(data=True):
        shape = {"stream": "ellipse", "op": "hexagon", "output": "plaintext"}.get(d["role"], "box")
        label = d["label"].replace('"', '\\"')
        lines.append(f'  "{n}" [label="{label}", fillcolor="{_FILL.get(d["role"], "#ffffff")}", shape={shape}];')
    for a, b in g.edges():
        lines.append(f'  "{a}" -> "{b}";')
    lines.append("}")
    return "\n".join(lines) + "\n"


def rewritten_text(converted: fx.GraphModule, g: nx.DiGraph | None = None) -> str:
    """The contracted graph as text: one line per group, in graph order, with the groups it reads (``g``: the graph of
    :func:`rewritten_networkx`, when already built)."""
    g = rewritten_networkx(converted) if g is None else g
    order = {n: i for i, n in enumerate(g.nodes)}
    lines = [f"{g.graph['model']} -> {g.graph['scheme']}", ""]
    for n in sorted(g.nodes, key=order.__getitem__):
        d = g.nodes[n]
        reads = ", ".join(sorted(g.predecessors(n), key=order.__getitem__))
        label = d["label"].replace("\\n", "  ")
        lines.append(f"{n:<22} {label:<64} <- {reads or '(graph inputs)'}")
    return "\n".join(lines) + "\n"


_FORMATS = (".svg", ".png", ".dot", ".txt")


def save_rewritten(converted: fx.GraphModule, path: str | Path) -> Path:
    """Write the rewritten graph to ``path`` and, beside it, always its text (``.txt``, :func:`rewritten_text`) and
    its DOT source (``.dot``): ``save_rewritten(conv, "g.png")`` writes ``g.png``, ``g.dot`` and ``g.txt``.
    ``.svg`` / ``.png`` are rendered by Graphviz (pydot and ``dot``) when installed, else drawn with matplotlib; when
    neither can draw, the :class:`ConfigError` comes after the ``.dot`` and ``.txt`` are written. Returns ``path``."""
    path = Path(path)
    if path.suffix not in _FORMATS:
        raise ConfigError(f"cannot save a rewritten graph as {path.suffix!r}: use {', '.join(_FORMATS[:-1])} or .txt")
    g = rewritten_networkx(converted)
    dot = rewritten_dot(converted, g)
    path.with_suffix(".txt").write_text(rewritten_text(converted, g))
    path.with_suffix(".dot").write_text(dot)
    if path.suffix in (".txt", ".dot"):
        return path
    return write_dot(
        dot,
        path,
        what="a rewritten graph",
        formats=", ".join(_FORMATS),
        no_pydot=f" (and Graphviz's `dot`), or matplotlib; {path.with_suffix('.dot').name} and "
        f"{path.with_suffix('.txt').name} were written",
        no_graphviz=f"; {path.with_suffix('.dot').name} and {path.with_suffix('.txt').name} were written",
        graph=g,
        title=f"{g.graph['model']} -> {g.graph['scheme']}",
    )
