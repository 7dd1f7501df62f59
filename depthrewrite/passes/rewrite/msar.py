"""MSAR and Block MSAR: multi-stream attention residuals as a rewrite of the detected PreNorm chain.

    sources  as AttnRes (stream source + raw sublayer outputs; Block: single-stream summaries, K3 ordering)
    views    V^(0) = v_i, V^(r) = causal depthwise conv_r(v_i) along the sequence, kernel sizes (4, 8, 12)
    site j   Z^(r) = Σ_i softmax_i(w_r · RMSNorm_{γ_r}(V_i^(r))) V_i^(r);  g = σ(α·(RMS(Z) φ) + b);  h = c·Σ_r g_r Z^(r)

Qin et al., *Multi-Stream Attention Residuals* (2026); spec: shared/specs/msar.md. Each site is one
``depthrewrite::msar_mix`` node. Blocks store single-stream summaries only: the views are expanded at the site
(exact, the convs are linear), so the stored state per token is (N+1)·d, as for Block AttnRes.

Decoding state (msar.md §4.9): a graph captured for a call that keeps a KV cache returns every source's last k−1
positions (its conv history). With history coming in (a call after the first), :func:`.msar_decode.add_decode_state`
gives the convs their left context; the first call (prefill, and every training call of a model whose config turns
the cache on) has none, so its mixes read the sources as an uncached graph does (the convs' own zero padding is that
left context) and only the history is added (:func:`_prefill_history`): the same graph, the same block state.

Padding (msar.md §4.4): with a 2-D padding mask among the graph's inputs (``padding_mask="auto"``: the input named
``attention_mask``), every source is stored with its pad positions zeroed (``where(mask != 0, v, 0)``, once per source
as it is created; partial sums add zeroed values), which equals masking the stacked sources before the convs.
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
from ..meta import NodeRole, inherit_meta
from ..result import PassResult
from .blocks import DepthMixConfig, mix_site_anchor, mix_site_labels, rewrite_depth_mix, stored_sources_state
from .editor import ChainEditor
from .msar_decode import DECODE_META, HISTORY_META, return_history, add_decode_state, cut_mask_to_new_tokens
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
        padding_mask (str, optional): the graph input holding the 2-D [batch, sequence] padding mask (0 = pad): the
            sources are zeroed at pad positions before the convs (msar.md §4.4). ``"auto"`` (default): the input named
            ``attention_mask`` when it is such a mask, else none (the rewrite is then unchanged); ``None``: off; any
            other string: that input, which must exist and be [batch, sequence] (else :class:`ConfigError`).
        blocks, block_size, mix_scale, eps: as :class:`AttnResConfig` (``block_size`` wins over ``blocks``).
    """

    streams: int = 4
    kernel_sizes: tuple[int, ...] | None = None
    conv_on: str = "kv"
    mixer: str = "sigmoid"
    eps_mix: float = 1e-6
    padding_mask: str | None = "auto"

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
        if self.padding_mask is not None and (not isinstance(self.padding_mask, str) or not self.padding_mask):
            raise ConfigError(
                f"MSARConfig.padding_mask must be None, 'auto' or an input's name, got {self.padding_mask!r}"
            )

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
        self.query = nn.Parameter(torch.empty(m, d, **kw))
        self.gain = nn.Parameter(torch.empty(m, d, **kw))
        self.conv = nn.ParameterList([nn.Parameter(torch.empty(d, k, **kw)) for k in kernels])
        if mixer:  # the "mean" mixer has no parameters (an unused one would break DDP)
            self.phi = nn.Parameter(torch.empty(m * d, m, **kw))
            self.bias = nn.Parameter(torch.empty(m, **kw))
            self.alpha = nn.Parameter(torch.empty(1, **kw))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The init, in place (also what ``to_empty`` + ``reset_parameters`` recipes call: OLMo-core's
        ``init_weights``, meta-device initialisation)."""
        self.query.zero_()
        self.gain.fill_(1.0)
        for w in self.conv:
            w.zero_()
            w[:, -1] = 1.0  # the current token is the last tap
        if hasattr(self, "phi"):
            self.phi.zero_()
            self.bias.fill_(-math.log(self.query.shape[0] - 1))
            self.alpha.fill_(0.01)


AUTO_MASK = "attention_mask"


def _hint(size) -> int | None:
    """A size's example value (a SymInt's hint), or None when it has none."""
    if isinstance(size, int):
        return size
    try:
        return int(size.node.hint) if size.node.hint is not None else int(size.node.shape_env.size_hint(size.node.expr))
    except Exception:  # no hint, no shape env
        return None


def _mask_problem(gm: fx.GraphModule, node: fx.Node, stream: torch.Tensor) -> str | None:
    """Why input ``node`` is not a [batch, sequence] 0/1 padding mask for a stream of ``stream``'s shape (None: it is).
    The batch and sequence sizes are compared by their example values (export gives an input's batch its own symbol)."""
    v = tensor_val(node)
    if v is None:
        return "has no example tensor value"
    shape = tuple(_hint(s) for s in v.shape)
    want = tuple(_hint(s) for s in stream.shape[:2])
    if v.dim() != 2 or shape != want or None in shape:
        return f"has shape {list(shape)}, not the stream's [batch, sequence] = {list(want)}"
    if v.dtype.is_complex:
        return f"has dtype {v.dtype}"
    _, kwargs = gm.meta.get("depthrewrite_inputs", ((), {}))
    ex = kwargs.get(node.target, kwargs.get(node.name)) if isinstance(kwargs, dict) else None
    if isinstance(ex, torch.Tensor) and not bool(((ex == 0) | (ex == 1)).all()):
        return "holds values other than 0 and 1 in the example inputs (an additive mask?)"
    return None


def _padding_mask(gm: fx.GraphModule, config: MSARConfig, stream: torch.Tensor) -> tuple[fx.Node | None, str | None]:
    """The graph input to mask the sources with, and a report note (msar.md §4.4)."""
    if config.padding_mask is None:
        return None, None
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    want = AUTO_MASK if config.padding_mask == "auto" else config.padding_mask
    node = next((n for n in inputs if n.name == want or n.target == want), None)
    names = ", ".join(str(n.target) for n in inputs) or "none"
    if node is None:
        if config.padding_mask == "auto":
            return None, None
        raise ConfigError(f"MSARConfig.padding_mask={want!r}: the captured graph has no input of that name; its "
                          f"inputs: {names}. Pass padding_mask=None to mask nothing.")
    problem = _mask_problem(gm, node, stream)
    if problem is not None:
        if config.padding_mask == "auto":
            return None, (f"MSAR: padding is not masked: the input `{want}` {problem} (padding_mask='auto' wants a "
                          "[batch, sequence] 0/1 mask); pad positions feed the convs")
        raise ConfigError(f"MSARConfig.padding_mask={want!r}: the input `{want}` {problem}; it must be the [batch, "
                          f"sequence] padding mask (0 = pad). The graph's inputs: {names}.")
    return node, (f"MSAR: sources are zeroed at pad positions (input `{want}` == 0) before the convs, so a left-padded "
                  "row behaves as if it began at its first real token (msar.md §4.4); the mix is 0 at pad positions")


def _masked_store(mask: fx.Node, scheme: str, decoding: bool = False):
    """store() for :func:`rewrite_depth_mix`: each source becomes ``where(mask != 0, v, 0)`` (dtype-preserving; equal
    to v·mask for a 0/1 mask), the [B, T, 1] keep mask computed once, with the first (stream) source. While decoding
    the mask covers the cached tokens too: its last T positions are used."""
    keep: list[fx.Node] = []

    def store(ed: ChainEditor, node: fx.Node, k: int | None) -> fx.Node:
        role = NodeRole("source_mask", "emb" if k is None else k, scheme)
        graph = ed.graph
        if not keep:
            ne = graph.call_function(torch.ops.aten.ne.Scalar, (mask, 0))
            if decoding:
                ne = cut_mask_to_new_tokens(graph, ne, node, scheme)
            keep.append(graph.call_function(torch.ops.aten.unsqueeze.default, (ne, -1)))
            mv = tensor_val(mask) if not decoding else None
            for n in (ne, keep[0]):
                inherit_meta(n, node, role, copy_val=False)
            if mv is not None:
                try:  # fake values for the passes that read shapes
                    ne.meta["val"] = torch.ops.aten.ne.Scalar(mv, 0)
                    keep[0].meta["val"] = torch.ops.aten.unsqueeze.default(ne.meta["val"], -1)
                except Exception:  # pragma: no cover - a mask value fake mode cannot run ops on
                    pass
        new = graph.call_function(torch.ops.aten.where.ScalarOther, (keep[0], node, 0.0))
        inherit_meta(new, node, role, val_from=node)
        return new

    return store


def _prefill_history(gm: fx.GraphModule, k1: int, scheme: str) -> int:
    """A cached call without history (the first, prefill, call; a training call of a model whose config turns the
    cache on): the history every source leaves for the next call, ``pad(v, k1 zeros before)[-k1:]`` (its last k1
    positions, zeros before the start), returned as :func:`.msar_decode.add_decode_state` returns it, in the same
    order (distinct sources in the order the ``msar_mix`` ops read them). The mixes are left as they are: with no
    history their left context is the convs' own zero padding, so they read the sources, not padded copies, and the
    block split is that of an uncached graph (no padded copy of every source crossing into later blocks, and the mix
    that feeds a block's first sublayer still runs inside that block). Each history is a copy of its k1 positions,
    not a view: a view would keep the whole padded source alive in the returned cache. Returns their number."""
    graph = gm.graph
    sources: list[fx.Node] = []
    for n in graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.depthrewrite.msar_mix.default:
            sources.extend(s for s in n.args[0] if s not in sources)
    if not sources or k1 <= 0:
        return 0
    hist = []
    for s in sources:
        at = s
        for target, args in ((torch.ops.aten.constant_pad_nd.default, lambda x: (x, [0, 0, k1, 0])),
                             (torch.ops.aten.slice.Tensor, lambda x: (x, -2, -k1, 2**63 - 1)),
                             (torch.ops.aten.clone.default, lambda x: (x,)),
                             (torch.ops.aten.unsqueeze.default, lambda x: (x, 1))):
            with graph.inserting_after(at):
                new = graph.call_function(target, args(at))
            inherit_meta(new, s, NodeRole("msar_history", None, scheme), copy_val=False)
            at = new
        hist.append(at)
    return_history(gm, hist)
    gm.meta[HISTORY_META] = len(hist)
    return len(hist)


def _rewrite_msar(gm: fx.GraphModule, chain: Chain, config: MSARConfig) -> PassResult:
    stream = tensor_val(_node(gm, chain.source))
    if stream is None or stream.dim() != 3:
        raise ConfigError(
            f"MSAR convolves along the sequence and needs a [batch, sequence, hidden] stream; the stream source "
            f"`{chain.source}` has shape {tuple(stream.shape) if stream is not None else '?'}"
        )
    mask, note = _padding_mask(gm, config, stream)
    def emit(ed: ChainEditor, name: str, sources: list[fx.Node], eps: float, scale: float) -> fx.Node:
        sigmoid = config.mixer == "sigmoid"
        site = ed.site_module(name, lambda: _MSARSite(chain.hidden_size, config.kernels, sigmoid, ed.dtype, ed.device))
        get = ed.get_attr
        conv = [get(f"{name}.conv.{r}") for r in range(len(site.conv))]
        mixer = [get(f"{name}.{p}") for p in ("phi", "bias", "alpha")] if sigmoid else [None, None, None]
        args = (sources, get(f"{name}.query"), get(f"{name}.gain"), conv, *mixer, eps, scale, config.conv_on == "kv", sigmoid,
                float(config.eps_mix))
        return ed.graph.call_function(torch.ops.depthrewrite.msar_mix.default, args)

    decoding = DECODE_META in gm.meta
    store = _masked_store(mask, config.name, decoding) if mask is not None else None
    result = rewrite_depth_mix(gm, chain, config, emit, store)
    if decoding:
        k1 = max(config.kernels, default=1) - 1
        if gm.meta[DECODE_META]:  # history comes in: the convs read it as their left context
            add_decode_state(gm, k1, config.name)
        else:
            _prefill_history(gm, k1, config.name)
        gm.recompile()
    return dataclasses.replace(result, notes=result.notes + (note,)) if note else result


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
    mixes_tokens="its causal depthwise convs read the k−1 positions before every token of every source",
))
