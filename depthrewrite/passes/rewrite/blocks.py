"""The K3 block ordering of stored depth sources shared by AttnRes and MSAR (spec: shared/specs/attnres.md §4, §6).

    sources  v_0 = h_0 (stream source), v_{k+1} = raw output of sublayer k
    Block    sources at site j = completed block sums b_0 (= embedding) .. b_{n-1} + the open partial sum

:func:`rewrite_depth_mix` walks the chain with a :class:`~.editor.ChainEditor` and asks the scheme's ``emit`` for the
node that mixes the sources at each site.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import torch.fx as fx

from ...errors import ConfigError
from ..analyse.chain import Chain
from ..meta import NodeRole, inherit_meta, role_of
from ..result import Change, PassResult
from .editor import ChainEditor, Emit
from .registry import DepthState, SchemeConfig

#: store(editor, node, k) -> the node to store as a source in place of ``node`` (k: the sublayer whose output it is,
#: None for the stream source), inserted right after ``node`` (in creation order). MSAR's padding mask zeroes pad
#: positions here.
Store = Callable[[ChainEditor, fx.Node, "int | None"], fx.Node]

__all__ = ["DepthMixConfig", "block_size_for", "sources_at", "rewrite_depth_mix", "mix_site_anchor", "mix_site_labels",
           "stored_sources_state"]


@dataclasses.dataclass(frozen=True)
class DepthMixConfig(SchemeConfig):
    """Options shared by the schemes that mix stored depth sources (AttnRes, MSAR). See each scheme's docstring."""

    blocks: int | None = None
    block_size: int | None = None
    mix_scale: str = "count"
    eps: float | None = None

    def __post_init__(self):
        cls = type(self).__name__
        for field in ("blocks", "block_size"):
            v = getattr(self, field)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConfigError(f"{cls}.{field} must be an integer >= 1, got {v!r}")
        if self.mix_scale not in ("count", "mean"):
            raise ConfigError(f"{cls}.mix_scale must be 'count' or 'mean', got {self.mix_scale!r}")
        if self.eps is not None and (not isinstance(self.eps, (int, float)) or isinstance(self.eps, bool) or not self.eps > 0):
            raise ConfigError(f"{cls}.eps must be > 0, got {self.eps!r}")

    @property
    def full(self) -> bool:
        return self.blocks is None and self.block_size is None


def block_size_for(config: SchemeConfig, num_sublayers: int) -> int:
    """S for this config and L sublayers (S = 1 is the Full scheme). Raises ConfigError past L."""
    L = num_sublayers
    block_size, blocks = getattr(config, "block_size", None), getattr(config, "blocks", None)
    if block_size is not None:
        if block_size > L:
            raise ConfigError(f"block_size={block_size} is larger than the model's {L} sublayers; use 1..{L}")
        return block_size
    if blocks is not None:
        if blocks > L:
            raise ConfigError(f"blocks={blocks} is larger than the model's {L} sublayers; use 1..{L}")
        return math.ceil(L / blocks)
    return 1


def sources_at(j: int, S: int) -> int:
    """Number of sources at the site before sublayer j (j = L: the output site), K3 ordering (spec §4)."""
    return 1 if j == 0 else (j - 1) // S + 2



def rewrite_depth_mix(gm: fx.GraphModule, chain: Chain, config: DepthMixConfig, emit: Emit,
                      store: Store | None = None) -> PassResult:
    """Replace every stream value h_j (j >= 1) by a mix of stored sources, K3 ordering, and h_L before the final norm.

    ``store`` (optional) maps each new source (the stream source, each sublayer output in the canonical shape) to the
    value stored and mixed in its place; partial sums then add the stored values. Sublayer 0 still reads h_0 itself.

    Before (one step)::                         After (site j, Full)::

        h_j ──┬─────────────── add ── h_{j+1}       v_0 .. v_j ── mix_j ── Norm_j ── f_j ── v_{j+1}
              └─ Norm_j ── f_j ──┘
    """
    ed = ChainEditor(gm, chain, config.name)
    L = ed.L
    S = block_size_for(config, L)
    graph = ed.graph
    changes: list[Change] = []
    blocks: list[tuple[fx.Node, str]] = []
    v0 = ed.nodes[chain.source]
    if store is not None:
        with graph.inserting_before(v0.next):  # (inserting_before keeps several new nodes in creation order)
            v0 = store(ed, v0, None)
    prefix: tuple[fx.Node, str] | None = (v0, "emb")
    n_block = 0
    for j in range(L + 1):
        srcs = blocks + ([prefix] if prefix is not None else [])
        if len(srcs) > 1:  # a single source (sublayer 0) is read as it is: no mix, no parameters
            site = "output" if j == L else j
            scale = float(len(srcs)) if config.mix_scale == "count" else 1.0
            old = ed.stream(j)
            reader = ed.readers_of(j)[0]
            before = reader.prev
            with graph.inserting_before(reader):
                mixed = emit(ed, f"mix_{site}", [s for s, _ in srcs], ed.eps_at(config, j), scale)
            inherit_meta(mixed, old, NodeRole("mix", site, config.name), val_from=srcs[0][0])
            # an emit of several ops (a scheme written in aten ops): the others are the site's too, so the site's stage
            # anchor is its first op and the boundary hooks find the op that reads the sources
            n = before.next
            while n is not reader:
                if n is not mixed and n.op == "call_function":
                    inherit_meta(n, old, NodeRole("mix", site, config.name), copy_val=False)
                n = n.next
            ed.redirect(j, mixed)
            changes.append(
                Change(site=site, module=chain.sublayers[j - 1].module if j else None, created=(mixed.name,),
                       replaced=old.name, sources=tuple(label for _, label in srcs),
                       # a scheme whose mix has no parameters (emit made no site module) names none
                       params=f"mix_{site}" if hasattr(ed.box, f"mix_{site}") else None)
            )
        if j == L:
            break
        if j % S == 0:  # block boundary: snapshot the finished block after the mix (K3 ordering)
            # with S = 1 (Full) every "block" is one sublayer output and keeps its out{k} name
            blocks.append((prefix[0], "emb" if n_block == 0 else (prefix[1] if S == 1 else f"b{n_block}")))
            n_block += 1
            prefix = None
        out = ed.output_of(j)
        if store is not None:
            with graph.inserting_before(out.next):
                out = store(ed, out, j)
        if prefix is None:
            prefix = (out, f"out{j}" if S == 1 else f"partial b{n_block}")
        else:
            with graph.inserting_after(out):
                acc = graph.call_function(torch.ops.aten.add.Tensor, (prefix[0], out))
            inherit_meta(acc, ed.nodes[chain.sublayers[j].residual_add], NodeRole("partial_sum", j, config.name), val_from=out)
            prefix = (acc, f"partial b{n_block}")
    return ed.finish(changes)


# ---------------------------------------------------------------------------------------------------------------------
# stage hooks (Scheme record): a cut before sublayer j crosses the sources of site j


def mix_site_anchor(graph: fx.Graph, report, j: int) -> fx.Node | None:
    """A stage beginning with sublayer j begins at its mixing site (the first ``mix`` node of site j)."""
    return next((n for n in graph.nodes if (r := role_of(n)) is not None and r.role == "mix" and r.site == j), None)


def mix_site_labels(graph: fx.Graph, report, j: int) -> dict[fx.Node, str]:
    """The sources read by site j, named as the report names them (``emb``, ``b1``, ``partial b2``): the list
    argument of the site's ``mix`` op that takes the sources (``emit``'s first argument, in source order)."""
    sites = {s.site: s for s in report.sites}
    labels: dict[fx.Node, str] = {}
    for n in graph.nodes:
        r = role_of(n)
        if r is None or r.role != "mix" or r.site != j or j not in sites:
            continue
        if n.args and isinstance(n.args[0], (list, tuple)):
            labels.update(zip(n.args[0], sites[j].sources))
    return labels


def stored_sources_state(report, j: int) -> DepthState:
    """Full: every source so far, (j+1)·d; Block: the completed block sums plus the open partial sum, (N_done+1)·d."""
    S, d = report.block_size or 1, report.chain.hidden_size
    k = sources_at(j, S)
    return DepthState(k * d, f"(j+1)·d = {k}·{d}" if S == 1 else f"(N_done+1)·d = {k}·{d}")
