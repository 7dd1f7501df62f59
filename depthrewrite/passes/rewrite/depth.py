"""What every depth-mixing rewrite shares: the chain's stream values and their readers, sublayer outputs as sources,
the K3 block ordering of sources (AttnRes, MSAR), and where new parameters live.

    sources  v_0 = h_0 (stream source), v_{k+1} = raw output of sublayer k (the residual add's addend)
    site j   a new node before sublayer j's pre-norm (and before the final norm) replaces the stream value h_j
    Block    sources at site j = completed block sums b_0 (= embedding) .. b_{n-1} + the open partial sum

Streams that change shape (OPT's [B·T, D] sublayers) are mixed in the stream source's shape: sources are reshaped to
it, and each mix is reshaped back to the shape of the value it replaces; reshapes and pooling the model applies to a
stream value (``Chain.paths``) are kept and read the mix.

Spec: shared/specs/attnres.md §4 (ordering), §6 (real graphs). The old residual adds become dead and are removed
(detection guarantees that nothing else, graph outputs included, reads a stream value).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import torch.fx as fx
import torch.nn as nn

from ...errors import ConfigError
from ..analyse.chain import Chain
from ..analyse.ops import shape_str, strip_alias, tensor_val
from ..meta import NodeRole, inherit_meta
from ..result import Change, PassResult
from .registry import SchemeConfig

__all__ = ["PARAM_PREFIX", "DepthMixConfig", "ChainEditor", "block_size_for", "sources_at", "rewrite_depth_mix"]

#: every new parameter of a converted model lives under this state-dict prefix
PARAM_PREFIX = "depthrewrite"


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


class ChainEditor:
    """Read-and-redirect helpers over one graph and its detected chain."""

    def __init__(self, gm: fx.GraphModule, chain: Chain, scheme: str):
        self.gm, self.chain, self.scheme = gm, chain, scheme
        self.graph = gm.graph
        self.nodes = {n.name: n for n in self.graph.nodes}
        self.order = {n: i for i, n in enumerate(self.graph.nodes)}
        self.L = len(chain.sublayers)
        ref = next((p for p in gm.parameters() if p.is_floating_point()), None)
        v0 = tensor_val(self.nodes[chain.source])
        self.dtype = ref.dtype if ref is not None else v0.dtype
        self.device = ref.device if ref is not None else v0.device
        if not hasattr(gm, PARAM_PREFIX):
            gm.add_submodule(PARAM_PREFIX, nn.Module())
        self.box: nn.Module = getattr(gm, PARAM_PREFIX)

    def readers_of(self, j: int) -> list[fx.Node]:
        """The nodes that read stream value h_j (its pre-norms, the branch body for a reordered norm, or the final
        norm for j = L), in graph order. Where the model reshapes h_j first (OPT) or pools it before the final norm
        (timm ``global_pool="avg"``), the reader is the first node of that path: the path is kept, fed the new value."""
        path = self.chain.path(j)
        if path:
            return [self.nodes[path[0]]]
        if j == self.L:
            names = set(self.chain.final_norm.readers)
        else:
            names = set()
            for b in self.chain.sublayers[j].branches:
                names |= set(b.pre_norm.readers) if b.pre_norm is not None else set(b.nodes)
        return sorted((self.nodes[n] for n in names), key=self.order.__getitem__)

    def stream(self, j: int) -> fx.Node:
        """h_j as the original graph computes it."""
        return self.nodes[self.chain.source] if j == 0 else self.nodes[self.chain.sublayers[j - 1].residual_add]

    def redirect(self, j: int, new: fx.Node) -> None:
        """Make every reader of h_j read ``new`` instead (through any alias of h_j). ``new`` has the canonical shape
        (the stream source's); it is reshaped to h_j's shape where the model's stream has another shape there."""
        old = self.stream(j)
        new = self.reshaped(new, old, current=self.nodes[self.chain.source])
        for r in self.readers_of(j):
            for a in list(r.all_input_nodes):
                if strip_alias(a) is old:
                    r.replace_input_with(a, new)

    def canonical(self, x: fx.Node) -> fx.Node:
        """``x`` (a stream-shaped value: same elements, same hidden size) in the stream source's shape: itself, or a
        new reshape right after it (OPT's flattened [B·T, D] sublayer outputs become [B, T, D])."""
        return self.reshaped(x, self.nodes[self.chain.source])

    def reshaped(self, x: fx.Node, like: fx.Node, current: fx.Node | None = None) -> fx.Node:
        """``x`` reshaped to ``like``'s shape (a new node right after ``x``), or ``x`` when the shapes already agree.
        ``current``: a node of ``x``'s shape, when ``x``'s own metadata may not say it. Symbolic sizes are read from
        the stream source at run time, so any batch and sequence length works."""
        vx, vl = tensor_val(current if current is not None else x), tensor_val(like)
        if vx is None or vl is None or shape_str(vx.shape) == shape_str(vl.shape):
            return x
        h0 = self.nodes[self.chain.source]
        ref = tensor_val(h0).shape
        with self.graph.inserting_after(x):
            new = self.graph.call_function(torch.ops.aten.reshape.default, (x, []))
        with self.graph.inserting_before(new):
            sizes: list = []
            for t in vl.shape:
                i = None if isinstance(t, int) else next((i for i, r in enumerate(ref) if str(r) == str(t)), None)
                if isinstance(t, int):
                    sizes.append(t)
                elif i is not None:
                    sizes.append(self.graph.call_function(torch.ops.aten.sym_size.int, (h0, i)))
                else:
                    sizes.append(-1)  # a product of the source's sizes (B·T): what remains
        if sizes.count(-1) > 1:
            raise ConfigError(f"cannot express the stream shape {tuple(vl.shape)} of `{like.name}` in the sizes of the "
                              f"stream source `{h0.name}` {tuple(ref)}")
        new.args = (x, sizes)
        inherit_meta(new, x)
        for key in ("val", "example_value"):
            if key in like.meta:
                new.meta[key] = like.meta[key]
        return new

    def output_of(self, k: int) -> fx.Node:
        """v_{k+1}: the raw output of sublayer k (a new sum of its branch outputs for a parallel block), in the
        canonical shape (see :meth:`canonical`)."""
        return self.canonical(self._output_of(k))

    def _output_of(self, k: int) -> fx.Node:
        s = self.chain.sublayers[k]
        outs = [self.nodes[b.output] for b in s.branches]
        if len(outs) == 1:
            return outs[0]
        last = max(outs, key=self.order.__getitem__)
        acc = outs[0]
        with self.graph.inserting_before(last.next):  # right after the last branch, in creation order
            for o in outs[1:]:
                new = self.graph.call_function(torch.ops.aten.add.Tensor, (acc, o))
                inherit_meta(new, self.nodes[s.residual_add], NodeRole("source_sum", k, self.scheme), val_from=o)
                acc = new
        return acc

    def site_module(self, name: str, make: Callable[[], nn.Module]) -> nn.Module:
        """The parameters of one site, created once (the eval-mode graph reuses the training graph's)."""
        if not hasattr(self.box, name):
            self.box.add_module(name, make())
        return getattr(self.box, name)

    def get_attr(self, path: str) -> fx.Node:
        return self.graph.get_attr(f"{PARAM_PREFIX}.{path}")

    def eps_at(self, config, j: int) -> float:
        """The key-norm ε at site j: the config's, else the model's own norm ε there (1e-6 if none)."""
        if getattr(config, "eps", None) is not None:
            return config.eps
        chain = self.chain
        norm = chain.final_norm if j == self.L else next(iter(chain.sublayers[j].pre_norms), chain.final_norm)
        return norm.eps if norm.eps else 1e-6

    def finish(self, changes: list[Change]) -> PassResult:
        self.graph.eliminate_dead_code()
        self.graph.lint()
        self.gm.recompile()
        return PassResult(self.gm, tuple(changes))


#: emit(editor, site_name, sources, eps, scale) -> the node computing the mix (inserted at the current point)
Emit = Callable[[ChainEditor, str, list[fx.Node], float, float], fx.Node]


def rewrite_depth_mix(gm: fx.GraphModule, chain: Chain, config: DepthMixConfig, emit: Emit) -> PassResult:
    """Replace every stream value h_j (j >= 1) by a mix of stored sources, K3 ordering, and h_L before the final norm.

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
    prefix: tuple[fx.Node, str] | None = (ed.nodes[chain.source], "emb")
    n_block = 0
    for j in range(L + 1):
        srcs = blocks + ([prefix] if prefix is not None else [])
        if len(srcs) > 1:  # a single source (sublayer 0) is read as it is: no mix, no parameters
            site = "output" if j == L else j
            scale = float(len(srcs)) if config.mix_scale == "count" else 1.0
            old = ed.stream(j)
            with graph.inserting_before(ed.readers_of(j)[0]):
                mixed = emit(ed, f"mix_{site}", [s for s, _ in srcs], ed.eps_at(config, j), scale)
            inherit_meta(mixed, old, NodeRole("mix", site, config.name), val_from=srcs[0][0])
            ed.redirect(j, mixed)
            changes.append(
                Change(site=site, module=chain.sublayers[j - 1].module if j else None, created=(mixed.name,),
                       replaced=old.name, sources=tuple(label for _, label in srcs), params=f"mix_{site}")
            )
        if j == L:
            break
        if j % S == 0:  # block boundary: snapshot the finished block after the mix (K3 ordering)
            # with S = 1 (Full) every "block" is one sublayer output and keeps its out{k} name
            blocks.append((prefix[0], "emb" if n_block == 0 else (prefix[1] if S == 1 else f"b{n_block}")))
            n_block += 1
            prefix = None
        out = ed.output_of(j)
        if prefix is None:
            prefix = (out, f"out{j}" if S == 1 else f"partial b{n_block}")
        else:
            with graph.inserting_after(out):
                acc = graph.call_function(torch.ops.aten.add.Tensor, (prefix[0], out))
            inherit_meta(acc, ed.nodes[chain.sublayers[j].residual_add], NodeRole("partial_sum", j, config.name), val_from=out)
            prefix = (acc, f"partial b{n_block}")
    return ed.finish(changes)
