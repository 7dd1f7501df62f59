"""AttnRes and Block AttnRes as a rewrite of the detected PreNorm chain.

    sources  v_0 = h_0 (stream source), v_{k+1} = raw output of sublayer k (the residual add's addend)
    site j   h_j = c · Σ_i softmax_i(w_j · RMSNorm_{γ_j}(v_i)) v_i   before sublayer j's pre-norm, and before the final norm
    Block    sources at site j = completed block sums b_0 (= embedding) .. b_{n-1} + the open partial sum (K3 ordering)
    c        K_j (mix_scale="count", default: exact at init) or 1 ("mean", paper-literal)

Kimi Team, *Attention Residuals*, arXiv:2603.15031; spec: shared/specs/attnres.md §2-§6. Each site is one
``depthrewrite::depth_attn`` node; a site with one source (sublayer 0) has no mix and no parameters. The model's own
pre-norms stay; the old residual adds become dead and are removed.

Before (one step)::                         After (site j, Full)::

    h_j ──┬─────────────── add ── h_{j+1}       v_0 .. v_j ── depth_attn(w_j, γ_j) ── Norm_j ── f_j ── v_{j+1}
          └─ Norm_j ── f_j ──┘
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx as fx
import torch.nn as nn

from ...errors import ConfigError
from ..analyse.chain import Chain
from ..analyse.ops import strip_alias, tensor_val
from ..meta import NodeRole, inherit_meta
from ..result import Change, PassResult
from .registry import SchemeConfig, register_scheme

__all__ = ["AttnResConfig", "PARAM_PREFIX", "block_size_for", "sources_at"]

#: every new parameter of a converted model lives under this state-dict prefix
PARAM_PREFIX = "depthrewrite"


@dataclasses.dataclass(frozen=True)
class AttnResConfig(SchemeConfig):
    """Full AttnRes (``blocks=None``) or Block AttnRes.

    Args:
        blocks (int, optional): number of blocks N; the block size is S = ceil(L / N) sublayers, and the realised block
            count ceil(L / S) is reported. Default: None (Full AttnRes).
        block_size (int, optional): sublayers per block S. **Wins over** ``blocks`` when both are given.
        mix_scale (str): ``"count"`` (default; the mix times its source count, exact at init) or ``"mean"``
            (paper-literal average, for loading Kimi K3 weights).
        eps (float, optional): key RMSNorm epsilon. Default: the model's own norm epsilon (1e-6 if it has none).
    """

    blocks: int | None = None
    block_size: int | None = None
    mix_scale: str = "count"
    eps: float | None = None

    name = "attnres"

    def __post_init__(self):
        for field in ("blocks", "block_size"):
            v = getattr(self, field)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConfigError(f"AttnResConfig.{field} must be an integer >= 1, got {v!r}")
        if self.mix_scale not in ("count", "mean"):
            raise ConfigError(f"AttnResConfig.mix_scale must be 'count' or 'mean', got {self.mix_scale!r}")
        if self.eps is not None and not self.eps > 0:
            raise ConfigError(f"AttnResConfig.eps must be > 0, got {self.eps!r}")

    @property
    def full(self) -> bool:
        return self.blocks is None and self.block_size is None


def block_size_for(config: AttnResConfig, num_sublayers: int) -> int:
    """S for this config and L sublayers (S = 1 is Full AttnRes). Raises ConfigError past L."""
    L = num_sublayers
    if config.block_size is not None:
        if config.block_size > L:
            raise ConfigError(f"block_size={config.block_size} is larger than the model's {L} sublayers; use 1..{L}")
        return config.block_size
    if config.blocks is not None:
        if config.blocks > L:
            raise ConfigError(f"blocks={config.blocks} is larger than the model's {L} sublayers; use 1..{L}")
        return math.ceil(L / config.blocks)
    return 1


def sources_at(j: int, S: int) -> int:
    """Number of sources at the site before sublayer j (j = L: the output site), K3 ordering (spec §4)."""
    return 1 if j == 0 else (j - 1) // S + 2


def _site_eps(config: AttnResConfig, chain: Chain, j: int) -> float:
    if config.eps is not None:
        return config.eps
    norm = chain.final_norm if j == len(chain.sublayers) else next(iter(chain.sublayers[j].pre_norms), chain.final_norm)
    return norm.eps if norm.eps else 1e-6


class _Site(nn.Module):
    """The parameters of one mixing site: pseudo-query w (init 0) and key-norm gain γ (init 1)."""

    def __init__(self, d: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(d, dtype=dtype, device=device))
        self.gain = nn.Parameter(torch.ones(d, dtype=dtype, device=device))


def _container(gm: fx.GraphModule) -> nn.Module:
    """The module that holds every new parameter (state-dict prefix ``depthrewrite.``)."""
    if not hasattr(gm, PARAM_PREFIX):
        gm.add_submodule(PARAM_PREFIX, nn.Module())
    return getattr(gm, PARAM_PREFIX)


@register_scheme(AttnResConfig)
def _rewrite_attnres(gm: fx.GraphModule, chain: Chain, config: AttnResConfig) -> PassResult:
    graph = gm.graph
    nodes = {n.name: n for n in graph.nodes}
    order = {n: i for i, n in enumerate(graph.nodes)}
    L = len(chain.sublayers)
    S = block_size_for(config, L)
    h0 = nodes[chain.source]
    v0 = tensor_val(h0)
    ref_param = next((p for p in gm.parameters() if p.is_floating_point()), None)
    pdtype = ref_param.dtype if ref_param is not None else v0.dtype
    device = ref_param.device if ref_param is not None else v0.device
    box = _container(gm)
    mix_op = torch.ops.depthrewrite.depth_attn.default
    changes: list[Change] = []

    def readers_of(j: int) -> list[fx.Node]:
        """The nodes that read stream value h_j (its pre-norms, or the branch body for a reordered norm)."""
        if j == L:
            names = set(chain.final_norm.readers)
        else:
            names = set()
            for b in chain.sublayers[j].branches:
                names |= set(b.pre_norm.readers) if b.pre_norm is not None else set(b.nodes)
        return sorted((nodes[n] for n in names), key=order.__getitem__)

    def stream(j: int) -> fx.Node:
        return nodes[chain.source] if j == 0 else nodes[chain.sublayers[j - 1].residual_add]

    def output_of(k: int) -> fx.Node:
        """v_{k+1}: the raw output of sublayer k (the sum of its branch outputs for a parallel block)."""
        s = chain.sublayers[k]
        outs = [nodes[b.output] for b in s.branches]
        if len(outs) == 1:
            return outs[0]
        last = max(outs, key=order.__getitem__)
        acc = outs[0]
        with graph.inserting_after(last):
            for o in outs[1:]:
                new = graph.call_function(torch.ops.aten.add.Tensor, (acc, o))
                inherit_meta(new, nodes[s.residual_add], NodeRole("source_sum", k, "attnres"), val_from=o)
                acc = new
        return acc

    blocks: list[tuple[fx.Node, str]] = []
    prefix: tuple[fx.Node, str] | None = (h0, "emb")
    n_block = 0
    for j in range(L + 1):
        srcs = blocks + ([prefix] if prefix is not None else [])
        readers = readers_of(j)
        old = stream(j)
        if len(srcs) > 1:
            site = "output" if j == L else j
            name = f"mix_{site}"
            if not hasattr(box, name):  # the eval-mode graph reuses the training graph's parameters
                box.add_module(name, _Site(chain.hidden_size, pdtype, device))
            scale = float(len(srcs)) if config.mix_scale == "count" else 1.0
            with graph.inserting_before(readers[0]):
                q = graph.get_attr(f"{PARAM_PREFIX}.{name}.query")
                g = graph.get_attr(f"{PARAM_PREFIX}.{name}.gain")
                mixed = graph.call_function(mix_op, ([s for s, _ in srcs], q, g, _site_eps(config, chain, j), scale))
            inherit_meta(mixed, old, NodeRole("mix", site, "attnres"), val_from=srcs[0][0])
            for r in readers:
                for a in list(r.all_input_nodes):
                    if strip_alias(a) is old:
                        r.replace_input_with(a, mixed)
            changes.append(
                Change(site=site, module=chain.sublayers[j - 1].module if j else None, created=(q.name, g.name, mixed.name),
                       replaced=old.name, sources=tuple(label for _, label in srcs))
            )
        if j == L:
            break
        if j % S == 0:  # block boundary: snapshot the finished block after the mix (K3 ordering)
            blocks.append((prefix[0], "emb" if n_block == 0 else f"b{n_block}"))
            n_block += 1
            prefix = None
        out = output_of(j)
        if prefix is None:
            prefix = (out, f"out{j}" if S == 1 else f"partial b{n_block}")
        else:
            with graph.inserting_after(out):
                acc = graph.call_function(torch.ops.aten.add.Tensor, (prefix[0], out))
            inherit_meta(acc, nodes[chain.sublayers[j].residual_add], NodeRole("partial_sum", j, "attnres"), val_from=out)
            prefix = (acc, f"partial b{n_block}")

    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return PassResult(gm, tuple(changes))
