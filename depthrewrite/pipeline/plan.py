"""Where the stage boundaries go: before a sublayer (the scheme record's ``stage_anchor``), balanced by parameter
count, and for Block schemes only at block boundaries."""

from __future__ import annotations

import math
from typing import Any

import torch.fx as fx
import torch.nn as nn

from ..converted import graph_module_of
from ..errors import ConfigError
from ..passes.rewrite.registry import scheme

__all__ = ["plan", "stage_anchor", "check_stages"]


def stage_anchor(graph: fx.Graph, report, j: int) -> fx.Node:
    """The first node of the stage that begins with sublayer j (1 <= j < L): the scheme record's ``stage_anchor``."""
    record = scheme(report.config)
    node = record.hook("stage_anchor", "pipeline planning")(graph, report, j)
    if node is None:
        raise ConfigError(
            f"pipeline: cannot find where sublayer {j} begins in the converted {record.name} graph (a graph converted by "
            "depthrewrite marks every mixing site); convert the model again and split the fresh conversion"
        )
    return node


def _segment_params(converted, graph: fx.Graph, anchors: list[fx.Node]) -> list[int]:
    """Parameter count of each segment between consecutive candidate anchors (a parameter counts where first used)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    starts = [order[a] for a in anchors]
    seg = [0] * (len(anchors) + 1)
    seen: set[int] = set()
    for n in graph.nodes:
        if n.op != "get_attr":
            continue
        p = converted.resolve_attr(n.target)
        if not isinstance(p, nn.Parameter) or id(p) in seen:
            continue
        seen.add(id(p))
        first = min((order[u] for u in n.users), default=order[n])
        k = sum(1 for s in starts if s <= first)
        seg[k] += p.numel()
    return seg


def check_stages(converted, P) -> tuple[Any, int, int]:
    """``(report, L, S)`` of a converted model that can be cut into P stages (L sublayers, S per block, 1 if none)."""
    converted = graph_module_of(converted, "pipeline")
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
    stage 0, the final norm and head for the last); for a scheme in block form (the record's ``block_form``, S > 1)
    only block boundaries (sublayer j with j % S == 0, where the state is smallest) unless ``align_blocks=False``."""
    converted = graph_module_of(converted, "pipeline")
    report, L, S = check_stages(converted, P)
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
    anchors = [stage_anchor(graph, report, j) for j in range(1, L)]
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
