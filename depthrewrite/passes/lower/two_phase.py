"""Two-phase batching of Block AttnRes sites (AttnRes paper §4.2, Alg. 1; spec attnres.md §7).

Inside one block, every mixing site reads the same completed block summaries and differs only in its last source
(the block's open partial sum). Computed site by site, each summary is read S times per block. Two-phase computes:

- phase 1, once per block: ``depth_attn_partial(summaries, Q[S, D], G[S, D])`` — all S pseudo-queries against the
  completed summaries in one pass, giving a normalised partial mix ``o[s]`` and its log-sum-exp ``lse[s]``;
- phase 2, at each site: ``depth_attn_merge(o[s], lse[s], partial_sum, q_s, γ_s)`` — folds the one remaining source in
  by log-sum-exp.

The result equals the single-pass ``depth_attn`` exactly in real arithmetic (floating-point rounding differs at the
1e-7 level in fp32), forward and backward: no parameter changes, no new state. Candidates are groups of at least
``min_group`` ``depth_attn`` nodes that share every source but the last — what Block AttnRes produces; Full AttnRes
sites all have different prefixes.

It is not free: phase 1 writes the partial mix in fp32 (4·D bytes per token per site) and every merge reads it back
and keeps it for backward. Per token and block of S sites over n completed sources of e bytes per element, the
forward moves ``D·(n·e·(S−1) − 8·S)`` fewer bytes than S single passes, so it pays only from
``n > 8·S / (e·(S−1))`` sources (bf16, S = 8: n ≥ 5). :attr:`TwoPhaseGroup.worth_it` applies that cost model; the
backend uses it unless told ``two_phase="always"``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

__all__ = ["TwoPhaseGroup", "find_two_phase_groups", "apply_two_phase", "two_phase_ops_available"]


def _ops():
    ns = torch.ops.depthrewrite
    return ns.depth_attn.default, ns.depth_attn_partial.default, ns.depth_attn_merge.default


def two_phase_ops_available() -> bool:
    """Whether the phase-1 / merge ops are registered (they live in ``depthrewrite.kernels.depth_attn``)."""
    import depthrewrite.kernels.depth_attn  # noqa: F401  - registers the ops

    try:
        _ops()
    except (AttributeError, RuntimeError):
        return False
    return True


@dataclass(frozen=True)
class TwoPhaseGroup:
    """Sites of one block: ``sites`` (depth_attn node names, graph order) share the sources ``prefix``.

    ``elem_bytes`` and ``hidden`` describe the sources (0 when the graph carries no fake values)."""

    prefix: tuple[str, ...]
    sites: tuple[str, ...]
    eps: float
    elem_bytes: int = 0
    hidden: int = 0

    @property
    def bytes_saved(self) -> int:
        """Forward bytes per token saved against S single passes (negative: two-phase moves more)."""
        n, S, e = len(self.prefix), len(self.sites), self.elem_bytes or 4
        return self.hidden * (n * e * (S - 1) - 8 * S)

    @property
    def extra_saved_for_backward(self) -> int:
        """Bytes per token the merges keep for backward beyond the single passes (the fp32 partial mix and LSE)."""
        return len(self.sites) * (4 * self.hidden + 4)

    @property
    def worth_it(self) -> bool:
        """Whether two-phase moves fewer forward bytes than S single passes (the backend's default cost model)."""
        return self.bytes_saved > 0

    def __str__(self) -> str:
        saved = self.bytes_saved
        verdict = f"saves {saved:,} B/token" if saved > 0 else f"would move {-saved:,} B/token more"
        return (
            f"{len(self.sites)} sites ({self.sites[0]} … {self.sites[-1]}) share {len(self.prefix)} completed "
            f"source(s): one phase-1 pass + {len(self.sites)} merges; forward {verdict}, keeps "
            f"{self.extra_saved_for_backward:,} B/token more for backward"
        )


def _depth_attn_args(node: fx.Node):
    sig = ("sources", "query", "gain", "eps", "scale")
    args = dict(zip(sig, node.args))
    args.update(node.kwargs)
    return args["sources"], args["query"], args["gain"], args["eps"], args["scale"]


def find_two_phase_groups(graph: fx.Graph, min_group: int = 2) -> list[TwoPhaseGroup]:
    """The groups of ``depth_attn`` nodes that share all sources but the last (and eps), at least ``min_group`` each."""
    if not two_phase_ops_available():
        return []
    depth_attn, _, _ = _ops()
    groups: dict[tuple, list[fx.Node]] = {}
    for n in graph.nodes:
        if n.op != "call_function" or n.target is not depth_attn:
            continue
        sources, _, _, eps, _ = _depth_attn_args(n)
        if len(sources) < 2 or not all(isinstance(s, fx.Node) for s in sources):
            continue
        groups.setdefault((tuple(sources[:-1]), eps), []).append(n)
    out = []
    for (prefix, eps), nodes in groups.items():
        if len(nodes) < min_group:
            continue
        v = _fake_val(prefix[0])
        e, d = (v.element_size(), v.shape[-1]) if isinstance(v, torch.Tensor) else (0, 0)
        out.append(TwoPhaseGroup(tuple(p.name for p in prefix), tuple(n.name for n in nodes), eps, e, int(d)))
    return out


def _fake_val(node: fx.Node):
    v = node.meta.get("val", node.meta.get("example_value"))
    return v


def _propagate(node: fx.Node) -> None:
    """Best-effort fake value for an inserted node (Dynamo graphs keep ``example_value``, export graphs ``val``)."""
    from torch._guards import detect_fake_mode

    args = fx.node.map_arg(node.args, _fake_val)
    flat = [a for a in fx.node.map_aggregate(args, lambda x: x) if isinstance(a, torch.Tensor)]
    mode = detect_fake_mode(flat) if flat else None
    if mode is None:
        return
    try:
        with mode:
            out = node.target(*args, **node.kwargs)
    except Exception:  # noqa: BLE001 - metadata only; AOT re-traces with its own fake tensors anyway
        return
    node.meta["val"] = out
    node.meta["example_value"] = out


def apply_two_phase(gm: fx.GraphModule, groups: list[TwoPhaseGroup]) -> int:
    """Rewrite each group into one ``depth_attn_partial`` + one ``depth_attn_merge`` per site; returns the number of
    sites rewritten. The graph is linted and recompiled."""
    if not groups:
        return 0
    _, partial, merge = _ops()
    g = gm.graph
    by_name = {n.name: n for n in g.nodes}
    rewritten = 0
    for grp in groups:
        sites = [by_name[s] for s in grp.sites]
        prefix = [by_name[p] for p in grp.prefix]
        qs = [_depth_attn_args(s)[1] for s in sites]
        gs = [_depth_attn_args(s)[2] for s in sites]
        with g.inserting_before(sites[0]):
            Q = g.call_function(torch.ops.aten.stack.default, (qs, 0))
            G = g.call_function(torch.ops.aten.stack.default, (gs, 0))
            part = g.call_function(partial, (prefix, Q, G, grp.eps))
            o = g.call_function(operator.getitem, (part, 0))
            lse = g.call_function(operator.getitem, (part, 1))
            for n in (Q, G, part, o, lse):
                _propagate(n)
        for i, site in enumerate(sites):
            sources, q, gain, eps, scale = _depth_attn_args(site)
            with g.inserting_before(site):
                oi = g.call_function(torch.ops.aten.select.int, (o, 0, i))
                li = g.call_function(torch.ops.aten.select.int, (lse, 0, i))
                new = g.call_function(merge, (oi, li, sources[-1], q, gain, eps, scale))
                for n in (oi, li, new):
                    _propagate(n)
            new.meta.update({k: v for k, v in site.meta.items() if k not in ("val", "example_value")})
            site.replace_all_uses_with(new)
            g.erase_node(site)
            rewritten += 1
    g.lint()
    gm.recompile()
    return rewritten
