"""Draw a chain or rewritten-graph diagram with matplotlib: the picture when Graphviz's ``dot`` is not installed.

:func:`draw_layered` takes the networkx graphs of :meth:`ChainReport.to_networkx`,
:meth:`ConvertReport.to_networkx` and :func:`depthrewrite.views.draw.rewritten_networkx` (nodes with ``role`` and ``label``)
and lays them out in layers, top to bottom in dataflow order: one row per step of the longest path from the stream
source (a *lateral* edge keeps its head on its tail's row: a norm and the branch it feeds sit side by side), and one
column per role (the stream on the left, depth-mixing ops in the middle, sublayers on the right). Boxes are coloured by
role, long edges bend so they do not run through the boxes they pass, and a legend names the colours.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import networkx as nx

from ..errors import ConfigError

__all__ = ["ROLE_STYLE", "draw_layered", "layered_positions"]

#: role -> (fill colour, legend text, column)
ROLE_STYLE: dict[str, tuple[str, str, int]] = {
    "source": ("#cfe2ff", "stream source (embedding)", 0),
    "residual_add": ("#e9ecef", "residual add (stream h_k)", 0),
    "stream": ("#e9ecef", "residual add / kept stream sum", 0),
    "final_norm": ("#ffe69c", "final norm", 0),
    "output": ("#e2d9f3", "output", 0),
    "op": ("#ffc078", "depth-mixing op (new)", 1),
    "site": ("#ffc078", "depth-mixing site (new): reads the listed sources", 1),
    "pre_norm": ("#fff3cd", "pre-norm", 1),
    "attention": ("#d1e7dd", "attention sublayer (its norm inside)", 2),
    "mlp": ("#f8d7da", "MLP sublayer (its norm inside)", 2),
    "other": ("#e2d9f3", "other sublayer", 2),
    "branch:attention": ("#d1e7dd", "attention branch", 2),
    "branch:mlp": ("#f8d7da", "MLP branch", 2),
    "branch:other": ("#e2d9f3", "other branch", 2),
    "post_norm": ("#fff3cd", "post-norm", 3),
}
_EDGE = "#495057"
_READ = "#e8590c"  # edges into a depth-mixing op: what it reads

# sizes in inches (the axes are in inches, y down)
_CHAR_W = 0.068  # at 8 pt
_LINE_H = 0.16
_PAD = 0.12
_ROW_H = 0.62
_COL_GAP = 0.8


def _style_key(d: dict[str, Any]) -> str:
    role = d.get("role", "other")
    if role == "branch":
        kind = d.get("kind") or "other"
        return f"branch:{kind if kind in ('attention', 'mlp') else 'other'}"
    return role if role in ROLE_STYLE else "other"


def _lines(label: str) -> list[str]:
    return [line for line in str(label).replace("\\n", "\n").split("\n")]


def layered_positions(g: nx.DiGraph) -> tuple[dict[Any, tuple[int, float]], dict[Any, str]]:
    """(row, column) of every node and its style key. Rows: longest path over the edges that go forward in the
    graph's dataflow order (a back edge, such as MoDA's op inside its own sublayer, does not lower a row); an edge with
    ``lateral=True`` keeps its head on its tail's row. Nodes that would share a row and a column move down; a node that
    an edge along its column would pass through moves half a column to the right."""
    order = {n: i for i, n in enumerate(g.nodes)}
    if nx.is_directed_acyclic_graph(g):  # dataflow order, ties in the graph's node order
        order = {n: i for i, n in enumerate(nx.lexicographical_topological_sort(g, key=order.__getitem__))}
    rank: dict[Any, int] = {}
    for n in sorted(g.nodes, key=order.__getitem__):
        r = 0
        for p in g.predecessors(n):
            if order[p] < order[n]:
                lateral = g.edges[p, n].get("lateral", False)
                r = max(r, rank[p] + (0 if lateral else 1))
        rank[n] = r
    keys = {n: _style_key(d) for n, d in g.nodes(data=True)}
    taken: set[tuple[int, int]] = set()
    pos: dict[Any, tuple[int, float]] = {}
    shift = 0  # rows inserted so far by collisions: later rows move down with them
    for n in sorted(g.nodes, key=lambda n: (rank[n], order[n])):
        col = ROLE_STYLE[keys[n]][2]
        row = rank[n] + shift
        while (row, col) in taken:
            row += 1
            shift += 1
        taken.add((row, col))
        pos[n] = (row, col)
    # a node that an edge along its own column would run through steps aside, into a half column to its right
    # (mHC: the coefficients and pre-mix between one post-mix and the next)
    aside = set()
    for u, v in g.edges:
        (ru, cu), (rv, cv) = pos[u], pos[v]
        if cu == cv and abs(rv - ru) > 1:
            lo, hi = sorted((ru, rv))
            aside.update(n for n, (r, c) in pos.items() if c == cu and lo < r < hi)
    for n in aside:
        pos[n] = (pos[n][0], pos[n][1] + 0.5)
    return pos, keys


_RADS = (0.0, 0.15, -0.15, 0.3, -0.3, 0.45, -0.45)
_LANE = 0.16  # spacing of the vertical lanes that long edges run along, left of the first / right of the last column


def _hits(a: tuple[float, float], b: tuple[float, float], rad: float, boxes: list[tuple[float, float, float, float]],
          height: float) -> int:
    """How many boxes the ``arc3`` curve from a to b crosses. matplotlib bends in display space (y up): the control
    point is the chord's midpoint + rad x (dy, -dx)."""
    (x1, y1), (x2, y2) = (a[0], height - a[1]), (b[0], height - b[1])
    cx, cy = (x1 + x2) / 2 + rad * (y2 - y1), (y1 + y2) / 2 - rad * (x2 - x1)
    hits = 0
    for box in boxes:
        for i in range(1, 40):
            t = i / 40
            px = (1 - t) ** 2 * x1 + 2 * (1 - t) * t * cx + t * t * x2
            py = height - ((1 - t) ** 2 * y1 + 2 * (1 - t) * t * cy + t * t * y2)
            if box[0] <= px <= box[2] and box[1] <= py <= box[3]:
                hits += 1
                break
    return hits


def _segment_clear(x1: float, x2: float, y: float, boxes: list[tuple[float, float, float, float]]) -> bool:
    lo, hi = sorted((x1, x2))
    return not any(b[1] <= y <= b[3] and b[0] < hi and b[2] > lo for b in boxes)


def _route(g: nx.DiGraph, pos, xy, size, cols, height: float) -> dict[tuple[Any, Any], tuple]:
    """Per edge: ``("arc", rad)`` for the least bend that crosses no other box, or ``("lane", side)`` for an edge that
    would cross boxes: it leaves its tail sideways into a vertical lane beside the columns and enters its head from the
    side (a bus: the edges of one tail share a lane)."""
    boxes = {n: (xy[n][0] - size[n][0] / 2 - 0.04, xy[n][1] - size[n][1] / 2 - 0.04,
                 xy[n][0] + size[n][0] / 2 + 0.04, xy[n][1] + size[n][1] / 2 + 0.04) for n in g}
    routes = {}
    for a, b in g.edges:
        others = [box for n, box in boxes.items() if n not in (a, b)]
        span = abs(pos[b][0] - pos[a][0])
        outer = pos[a][1] in (min(cols), max(cols))
        best = None
        # from an outer column (the stream, the sublayers), an edge past more than one row runs along a lane
        same_column = pos[a][1] == pos[b][1]
        for rad in _RADS if span <= 2 or not outer else (0.0,) if same_column else ():
            h = _hits(xy[a], xy[b], rad, others, height)
            if h == 0:
                best = ("arc", rad)
                break
        if best is None:
            side = "right" if pos[a][1] == max(cols) else "left"
            edge_x = min(x for x, _, _, _ in boxes.values()) if side == "left" else max(x for _, _, x, _ in boxes.values())
            tail_ok = _segment_clear(xy[a][0], edge_x, xy[a][1], [o for n, o in boxes.items() if n != a])
            head_ok = _segment_clear(xy[b][0], edge_x, xy[b][1], [o for n, o in boxes.items() if n != b])
            if tail_ok and head_ok:
                best = ("lane", side)
            else:
                best = ("arc", min(_RADS, key=lambda r: _hits(xy[a], xy[b], r, others, height)))
        routes[(a, b)] = best
    return routes


def _lanes(routes, pos) -> dict[tuple[str, Any], int]:
    """A lane index per (side, tail): tails whose row spans do not overlap share a lane."""
    spans: dict[tuple[str, Any], list[int]] = {}
    for (a, b), r in routes.items():
        if r[0] == "lane":
            lo_hi = spans.setdefault((r[1], a), [pos[a][0], pos[a][0]])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], pos[b][0]), max(lo_hi[1], pos[b][0])
    lane: dict[tuple[str, Any], int] = {}
    ends: dict[str, list[int]] = {"left": [], "right": []}
    for key, (lo, hi) in sorted(spans.items(), key=lambda kv: (kv[1][0], kv[1][1])):
        side = ends[key[0]]
        free = next((i for i, end in enumerate(side) if end < lo), None)
        if free is None:
            side.append(hi)
            free = len(side) - 1
        side[free] = hi
        lane[key] = free
    return lane


def draw_layered(g: nx.DiGraph, path: str | Path, title: str = "") -> Path:
    """Render ``g`` to ``path`` (``.png`` or ``.svg``) with matplotlib; see the module docstring."""
    path = Path(path)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch
    except ImportError as e:
        raise ConfigError(
            f"saving {path.name} needs matplotlib (or pydot and Graphviz's `dot`): `pip install 'depthrewrite[viz]'`"
        ) from e

    pos, keys = layered_positions(g)
    size: dict[Any, tuple[float, float]] = {}
    for n, d in g.nodes(data=True):
        lines = _lines(d.get("label", n))
        size[n] = (max(len(s) for s in lines) * _CHAR_W + 2 * _PAD, len(lines) * _LINE_H + _PAD)
    cols = sorted({c for _, c in pos.values()})
    width = {c: max(size[n][0] for n in g if pos[n][1] == c) for c in cols}
    x_of, x = {}, 0.0
    for c in cols:
        x_of[c] = x + width[c] / 2
        x += width[c] + _COL_GAP
    rows = max(r for r, _ in pos.values()) + 1
    used = [k for k in ROLE_STYLE if k in set(keys.values())]
    y_of = {n: (r + 0.5) * _ROW_H for n, (r, _) in pos.items()}
    xy = {n: (x_of[c], y_of[n]) for n, (_, c) in pos.items()}
    routes = _route(g, pos, xy, size, cols, rows * _ROW_H)
    lanes = _lanes(routes, pos)
    n_left = 1 + max((i for (side, _), i in lanes.items() if side == "left"), default=-1)
    n_right = 1 + max((i for (side, _), i in lanes.items() if side == "right"), default=-1)
    left = 0.3 + n_left * _LANE
    content_w = x - _COL_GAP
    fig_w = max(left + content_w + n_right * _LANE + 0.3, 6.5)
    left += (fig_w - (left + content_w + n_right * _LANE + 0.3)) / 2  # centre a narrow drawing
    title_lines = textwrap.wrap(title, max(20, int(fig_w / (_CHAR_W * 1.35)))) if title else []
    title_h = 0.2 + 0.22 * len(title_lines) if title else 0.1
    n_handles = len(used) + 2
    legend_h = 0.2 * ((n_handles + 1) // 2) + 0.15
    fig_h = title_h + rows * _ROW_H + legend_h + 0.2
    xy = {n: (left + x_of[c], title_h + y_of[n]) for n, (_, c) in pos.items()}
    x_min = left - 0.04
    x_max = left + content_w + 0.04

    fig = plt.figure(figsize=(fig_w, fig_h))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, fig_w)
    ax.set_ylim(fig_h, 0)
    ax.axis("off")
    if title:
        ax.text(fig_w / 2, 0.12, "\n".join(title_lines), ha="center", va="top", fontsize=10, fontweight="bold",
                family="sans-serif")

    boxes = {}
    for n, d in g.nodes(data=True):
        (cx, cy), (w, h) = xy[n], size[n]
        fill = ROLE_STYLE[keys[n]][0]
        box = FancyBboxPatch((cx - w / 2, cy - h / 2), w, h, boxstyle="round,pad=0,rounding_size=0.08",
                             fc=fill, ec="#343a40", lw=0.8, zorder=3)
        ax.add_patch(box)
        boxes[n] = box
        ax.text(cx, cy, "\n".join(_lines(d.get("label", n))), ha="center", va="center", fontsize=8,
                family="sans-serif", zorder=4, linespacing=1.15)

    # lane edges enter their head at slightly different heights, so each stays visible
    entries: dict[Any, list[tuple[Any, Any]]] = {}
    for (a, b), r in routes.items():
        if r[0] == "lane":
            entries.setdefault(b, []).append((a, b))
    offset = {}
    for b, es in entries.items():
        es.sort(key=lambda e: (routes[e][1], lanes[(routes[e][1], e[0])]))
        step = min(0.07, max(0.0, size[b][1] - 0.1) / max(1, len(es)))
        for k, e in enumerate(es):
            offset[e] = (k - (len(es) - 1) / 2) * step

    for a, b, d in g.edges(data=True):
        into_op = keys[b] in ("op", "site")
        skip = d.get("kind") == "skip"
        colour = _READ if into_op else ("#868e96" if skip else _EDGE)
        style = dict(color=colour, lw=1.1 if into_op else 0.9, linestyle="--" if skip else "-", zorder=2)
        kind, arg = routes[(a, b)]
        if kind == "arc":
            ax.add_patch(FancyArrowPatch(posA=xy[a], posB=xy[b], patchA=boxes[a], patchB=boxes[b], arrowstyle="-|>",
                                         mutation_scale=9, connectionstyle=f"arc3,rad={arg}", shrinkA=1, shrinkB=1,
                                         alpha=0.95, **style))
            continue
        i = lanes[(arg, a)]
        lx = x_min - (i + 1) * _LANE if arg == "left" else x_max + (i + 1) * _LANE
        (xa, ya), (xb, yb) = xy[a], xy[b]
        yb += offset[(a, b)]
        ax.add_line(Line2D([xa, lx, lx], [ya, ya, yb], alpha=0.85, **style))
        edge_b = xb - size[b][0] / 2 if arg == "left" else xb + size[b][0] / 2
        ax.add_patch(FancyArrowPatch(posA=(lx, yb), posB=(edge_b, yb), arrowstyle="-|>", mutation_scale=9,
                                     shrinkA=0, shrinkB=1, alpha=0.85, **style))

    handles = [Patch(fc=ROLE_STYLE[k][0], ec="#343a40", label=ROLE_STYLE[k][1]) for k in used]
    if any(keys[b] in ("op", "site") for _, b in g.edges):
        handles.append(Line2D([], [], color=_READ, lw=1.2, label="what a depth-mixing op reads"))
    if any(d.get("kind") == "skip" for *_, d in g.edges(data=True)):
        handles.append(Line2D([], [], color="#868e96", lw=1, ls="--", label="skip (identity) path"))
    top = title_h + rows * _ROW_H + 0.05
    ax.legend(handles=handles, loc="upper center", ncol=2, fontsize=7.5, frameon=False,
              bbox_to_anchor=(0.5, 1 - top / fig_h), bbox_transform=ax.transAxes)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
