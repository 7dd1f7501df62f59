"""MSAR and Block MSAR: multi-stream attention residuals as a rewrite of the detected PreNorm chain.

    sources  as AttnRes (stream source + raw sublayer outputs; Block: single-stream summaries, K3 ordering)
    views    V^(0) = v_i, V^(r) = causal depthwise conv_r(v_i) along the sequence, kernel sizes (4, 8, 12)
    site j   Z^(r) = Σ_i softmax_i(w_r · RMSNorm_{γ_r}(V_i^(r))) V_i^(r);  g = σ(α·(RMS(Z) φ) + b);  h = c·Σ_r g_r Z^(r)

Qin et al., *Multi-Stream Attention Residuals* (2026); spec: shared/specs/msar.md. Each site is one
``depthrewrite::msar_mix`` node. Blocks store single-stream summaries only: the views are expanded at the site
(exact, the convs are linear), so the stored state per token is (N+1)·d, as for Block AttnRes.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx as fx
import torch.nn as nn

from ...errors import ConfigError
from ...kernels import msar as _kernels  # noqa: F401  (registers depthrewrite::msar_mix, the ops this rewrite inserts)
from ..analyse.chain import Chain
from ..analyse.ops import tensor_val
from ..result import PassResult
from .blocks import DepthMixConfig, mix_site_anchor, mix_site_labels, rewrite_depth_mix, stored_sources_state
from .editor import ChainEditor
from .registry import DEFAULT_BLOCKS, Scheme, SchemeVariant, register

__all__ = ["MSARConfig"]


def _node(gm: fx.GraphModule, name: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


@dataclasses.dataclass(frozen=True)
class MSARConfig(DepthMixConfig):
    """Full MSAR (``blocks=None``) or Block MSAR.

    Args:
        streams (int): m views per source, >= 2 (stream 0 is the identity). Default: 4.
        kernel_sizes (tuple[int, ...], optional): the m-1 causal conv widths. Default: (4, 8, 12) for m = 4, else
            k_r = 4r.
        conv_on (str): ``"kv"`` (default: keys and values come from the conv views) or ``"k"`` (keys only).
        mixer (str): ``"sigmoid"`` (default, the input-dependent mixer) or ``"mean"`` (g_r = 1/m).
        eps_mix (float): the sigmoid mixer's RMS ε, > 0. Default: 1e-6, fixed by msar.md §5 (mHC's mixer form),
            independent of the model's norm ε (which ``eps`` and the per-stream key norms use).
        blocks, block_size, mix_scale, eps: as :class:`AttnResConfig` (``block_size`` wins over ``blocks``).
    """

    streams: int = 4
    kernel_sizes: tuple[int, ...] | None = None
    conv_on: str = "kv"
    mixer: str = "sigmoid"
    eps_mix: float = 1e-6

    name = "msar"

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.streams, int) or self.streams < 2:
            raise ConfigError(f"MSARConfig.streams must be an integer >= 2, got {self.streams!r}")
        if self.kernel_sizes is not None and not isinstance(self.kernel_sizes, (tuple, list)):
            raise ConfigError(f"MSARConfig.kernel_sizes must be a tuple of integers, got {self.kernel_sizes!r}")
        ks = self.kernels
        if len(ks) != self.streams - 1 or any(not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in ks):
            raise ConfigError(
                f"MSARConfig.kernel_sizes must be {self.streams - 1} positive integers (one per conv stream), "
                f"got {self.kernel_sizes!r}"
            )
        if self.conv_on not in ("kv", "k"):
            raise ConfigError(f"MSARConfig.conv_on must be 'kv' or 'k', got {self.conv_on!r}")
        if self.mixer not in ("sigmoid", "mean"):
            raise ConfigError(f"MSARConfig.mixer must be 'sigmoid' or 'mean', got {self.mixer!r}")
        e = self.eps_mix
        if not isinstance(e, (int, float)) or isinstance(e, bool) or not (0 < e < float("inf")):
            raise ConfigError(f"MSARConfig.eps_mix must be a finite number > 0, got {e!r}")

    def describe(self, block_size: int | None = None) -> str:
        kind = "Full MSAR" if self.full or block_size == 1 else f"Block MSAR (S={block_size} sublayers per block)"
        ks = "/".join(map(str, self.kernels))
        return f"{kind}, m={self.streams} streams (kernels {ks}, conv on {self.conv_on}, {self.mixer} mixer), mix_scale={self.mix_scale!r}"

    @property
    def kernels(self) -> tuple[int, ...]:
        if self.kernel_sizes is not None:
            return tuple(self.kernel_sizes)
        return (4, 8, 12) if self.streams == 4 else tuple(4 * r for r in range(1, self.streams))


class _MSARSite(nn.Module):
    """One MSAR site: per-stream queries (0) and key gains (1), identity-initialised causal convs (last tap 1),
    and the mixer (φ = 0, b = -log(m-1), α = 0.01), so the site is AttnRes's uniform mix at init."""

    def __init__(self, d: int, kernels: tuple[int, ...], mixer: bool, dtype: torch.dtype, device: torch.device):
        super().__init__()
        m = len(kernels) + 1
        kw = dict(dtype=dtype, device=device)
        self.query = nn.Parameter(torch.zeros(m, d, **kw))
        self.gain = nn.Parameter(torch.ones(m, d, **kw))
        self.conv = nn.ParameterList()
        for k in kernels:
            w = torch.zeros(d, k, **kw)
            w[:, k - 1] = 1.0  # the current token is the last tap
            self.conv.append(nn.Parameter(w))
        if mixer:  # the "mean" mixer has no parameters (an unused one would break DDP)
            self.phi = nn.Parameter(torch.zeros(m * d, m, **kw))
            self.bias = nn.Parameter(torch.full((m,), -math.log(m - 1), **kw))
            self.alpha = nn.Parameter(torch.full((1,), 0.01, **kw))


def _rewrite_msar(gm: fx.GraphModule, chain: Chain, config: MSARConfig) -> PassResult:
    stream = tensor_val(_node(gm, chain.source))
    if stream is None or stream.dim() != 3:
        raise ConfigError(
            f"MSAR convolves along the sequence and needs a [batch, sequence, hidden] stream; the stream source "
            f"`{chain.source}` has shape {tuple(stream.shape) if stream is not None else '?'}"
        )
    def emit(ed: ChainEditor, name: str, sources: list[fx.Node], eps: float, scale: float) -> fx.Node:
        sigmoid = config.mixer == "sigmoid"
        site = ed.site_module(name, lambda: _MSARSite(chain.hidden_size, config.kernels, sigmoid, ed.dtype, ed.device))
        get = ed.get_attr
        conv = [get(f"{name}.conv.{r}") for r in range(len(site.conv))]
        mixer = [get(f"{name}.{p}") for p in ("phi", "bias", "alpha")] if sigmoid else [None, None, None]
        args = (sources, get(f"{name}.query"), get(f"{name}.gain"), conv, *mixer, eps, scale, config.conv_on == "kv", sigmoid,
                float(config.eps_mix))
        return ed.graph.call_function(torch.ops.depthrewrite.msar_mix.default, args)

    return rewrite_depth_mix(gm, chain, config, emit)


SCHEME = register(Scheme(
    name=MSARConfig.name,
    title="MSAR",
    config=MSARConfig,
    handler=_rewrite_msar,
    ops=("msar_mix",),
    block_form=True,
    doc="docs/msar.md",
    variants=(
        # the demo trains Block MSAR only by default: the cheaper of the two on CPU (all of them: --schemes all)
        SchemeVariant("msar", "Full MSAR", demo=False),
        SchemeVariant("block-msar", f"Block MSAR ({DEFAULT_BLOCKS} blocks)", {"blocks": DEFAULT_BLOCKS}),
    ),
    stage_anchor=mix_site_anchor,
    boundary_labels=mix_site_labels,
    state_at=stored_sources_state,
))
