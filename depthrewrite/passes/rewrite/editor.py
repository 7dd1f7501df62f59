"""The chain editor every scheme's rewrite uses: the chain's stream values and their readers, sublayer outputs as
sources, where new parameters live, and redirecting a stream value to its replacement.

    sources  v_0 = h_0 (stream source), v_{k+1} = raw output of sublayer k (the residual add's addend)
    site j   a new node before sublayer j's pre-norm (and before the final norm) replaces the stream value h_j

Streams that change shape (OPT's [B·T, D] sublayers) are mixed in the stream source's shape: sources are reshaped to
it, and each mix is reshaped back to the shape of the value it replaces; reshapes and pooling the model applies to a
stream value (``Chain.paths``) are kept and read the mix. The old residual adds become dead and are removed
(detection guarantees that nothing else, graph outputs included, reads a stream value).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx
import torch.nn as nn

from ...errors import ConfigError
from ..analyse.chain import Chain
from ..analyse.ops import shape_str, strip_alias, tensor_val
from ..meta import NodeRole, inherit_meta
from ..result import Change, PassResult

__all__ = ["PARAM_PREFIX", "ChainEditor", "Emit"]

#: every new parameter of a converted model lives under this state-dict prefix
PARAM_PREFIX = "depthrewrite"


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

