"""AttnRes and Block AttnRes as a rewrite of the detected PreNorm chain.

    sources  v_0 = h_0 (stream source), v_{k+1} = raw output of sublayer k (the residual add's addend)
    site j   h_j = c · Σ_i softmax_i(w_j · RMSNorm_{γ_j}(v_i)) v_i   before sublayer j's pre-norm, and before the final norm
    Block    sources at site j = completed block sums b_0 (= embedding) .. b_{n-1} + the open partial sum (K3 ordering)
    c        K_j (mix_scale="count", default: exact at init) or 1 ("mean", paper-literal)

Kimi Team, *Attention Residuals*, arXiv:2603.15031; spec: shared/specs/attnres.md §2-§6. Each site is one
``depthrewrite::depth_attn`` node with parameters ``depthrewrite.mix_{site}.{query,gain}``; the model's own pre-norms
stay. The source bookkeeping is shared with MSAR (``depth.py``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
import torch.nn as nn

from ...kernels import depth_attn as _kernels  # noqa: F401  (registers depthrewrite::depth_attn*, the ops this rewrite inserts)
from ..analyse.chain import Chain
from ..result import PassResult
from .blocks import (
    DepthMixConfig,
    block_size_for,
    mix_site_anchor,
    mix_site_labels,
    rewrite_depth_mix,
    sources_at,
    stored_sources_state,
)
from .editor import PARAM_PREFIX, ChainEditor
from .registry import DEFAULT_BLOCKS, Scheme, SchemeVariant, register

__all__ = ["AttnResConfig", "PARAM_PREFIX", "block_size_for", "sources_at"]


@dataclasses.dataclass(frozen=True)
class AttnResConfig(DepthMixConfig):
    """Full AttnRes (``blocks=None``) or Block AttnRes.

    Args:
        blocks (int, optional): number of blocks N; the block size is S = ceil(L / N) sublayers, and the realised block
            count ceil(L / S) is reported. Default: None (Full AttnRes).
        block_size (int, optional): sublayers per block S. **Wins over** ``blocks`` when both are given.
        mix_scale (str): ``"count"`` (default; the mix times its source count, exact at init) or ``"mean"``
            (paper-literal average, for loading Kimi K3 weights).
        eps (float, optional): key RMSNorm epsilon. Default: the model's own norm epsilon (1e-6 if it has none).
    """

    name = "attnres"

    def describe(self, block_size: int | None = None) -> str:
        kind = "Full AttnRes" if self.full or block_size == 1 else f"Block AttnRes (S={block_size} sublayers per block)"
        return f"{kind}, mix_scale={self.mix_scale!r}"


class _Site(nn.Module):
    """The parameters of one mixing site: pseudo-query w (init 0) and key-norm gain γ (init 1)."""

    def __init__(self, d: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.query = nn.Parameter(torch.empty(d, dtype=dtype, device=device))
        self.gain = nn.Parameter(torch.empty(d, dtype=dtype, device=device))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The init, in place (also what ``to_empty`` + ``reset_parameters`` recipes call: OLMo-core's
        ``init_weights``, meta-device initialisation)."""
        self.query.zero_()
        self.gain.fill_(1.0)


def _emit(ed: ChainEditor, name: str, sources: list[fx.Node], eps: float, scale: float) -> fx.Node:
    ed.site_module(name, lambda: _Site(ed.chain.hidden_size, ed.dtype, ed.device))
    q, g = ed.get_attr(f"{name}.query"), ed.get_attr(f"{name}.gain")
    return ed.graph.call_function(torch.ops.depthrewrite.depth_attn.default, (sources, q, g, eps, scale))


def _rewrite_attnres(gm: fx.GraphModule, chain: Chain, config: AttnResConfig) -> PassResult:
    return rewrite_depth_mix(gm, chain, config, _emit)


SCHEME = register(Scheme(
    name=AttnResConfig.name,
    title="AttnRes",
    config=AttnResConfig,
    handler=_rewrite_attnres,
    ops=("depth_attn",),
    block_form=True,
    doc="docs/attnres.md",
    variants=(
        SchemeVariant("attnres", "Full AttnRes"),
        SchemeVariant("block-attnres", f"Block AttnRes ({DEFAULT_BLOCKS} blocks)", {"blocks": DEFAULT_BLOCKS}),
    ),
    stage_anchor=mix_site_anchor,
    boundary_labels=mix_site_labels,
    state_at=stored_sources_state,
))
