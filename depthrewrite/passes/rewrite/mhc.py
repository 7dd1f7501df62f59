"""mHC: manifold-constrained hyper-connections as a rewrite of the detected PreNorm chain.

    X_0    = n copies of the stream source h_0                                          [B, T, n, d]
    site k H_pre, H_post, H_res = coeffs(RMS(vec X_k) φ_k, b_k, α_k)  (σ, 2σ, Sinkhorn)
           u_k = Σ_i H_pre[i] X_k,i  -> sublayer k's own pre-norm and branch -> y_k
           X_{k+1} = H_res X_k + H_postᵀ y_k
    out    h = mean_i X_L,i (or sum) -> the model's final norm

Xie et al., *mHC*, arXiv:2512.24880; spec: shared/specs/mhc.md (§5 collapse, §6 init, §7 real graphs). One site per
residual add (a parallel block is one site whose y is the sum of its branches). Parameters per site:
``depthrewrite.hc_{k}.{phi,bias,alpha}``. Init (spec §6): φ ~ N(0, 1e-4), α = 0.01, b_pre = logit(1/n - ε)
(the spec's -log(n-1) with V4's +ε floor taken out: Σ H_pre = 1), b_post = 0, b_res = -5·(1 - I): close to the original at init, exact with ``alpha_init=0``.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
import torch.fx as fx
import torch.nn as nn

from ...errors import ConfigError
from ...kernels import mhc as _kernels  # noqa: F401  (registers depthrewrite::mhc_*, the ops this rewrite inserts)
from ..analyse.chain import Chain
from ..analyse.ops import tensor_val
from ..meta import NodeRole, inherit_meta, role_of
from ..result import Change, PassResult
from .editor import ChainEditor
from .registry import DepthState, Scheme, SchemeConfig, SchemeVariant, register

__all__ = ["MHCConfig"]


@dataclasses.dataclass(frozen=True)
class MHCConfig(SchemeConfig):
    """mHC with n residual streams.

    Args:
        streams (int): n, >= 2. Default: 4.
        sinkhorn_iters (int): Sinkhorn-Knopp iterations. Default: 20.
        collapse (str): how the n streams become one before the final norm: ``"mean"`` (default) or ``"sum"``.
        alpha_init (float): initial gating scalars α. Default: 0.01 (0 makes the converted model exact).
        phi_std (float): std of φ's random init (breaks the stream symmetry). Default: 1e-4.
        eps (float): RMS / H_pre / Sinkhorn epsilon. Default: 1e-6.
        exact_rows (bool): the last Sinkhorn row normalisation divides by the plain row sum, so every row of H_res
            sums to 1 up to rounding and identical streams stay the original's residual stream (what makes
            ``alpha_init=0`` exact). ``False``: DeepSeek-V4's numerics, ε in every division (rows 1 − O(ε)).
            Default: True.
    """

    streams: int = 4
    sinkhorn_iters: int = 20
    collapse: str = "mean"
    alpha_init: float = 0.01
    phi_std: float = 1e-4
    eps: float = 1e-6
    exact_rows: bool = True

    name = "mhc"

    def __post_init__(self):
        if not isinstance(self.streams, int) or self.streams < 2:
            raise ConfigError(f"MHCConfig.streams must be an integer >= 2, got {self.streams!r}")
        if not isinstance(self.sinkhorn_iters, int) or self.sinkhorn_iters < 1:
            raise ConfigError(f"MHCConfig.sinkhorn_iters must be an integer >= 1, got {self.sinkhorn_iters!r}")
        if self.collapse not in ("mean", "sum"):
            raise ConfigError(f"MHCConfig.collapse must be 'mean' or 'sum', got {self.collapse!r}")
        for f in ("alpha_init", "phi_std", "eps"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise ConfigError(f"MHCConfig.{f} must be a number, got {v!r}")
        if not isinstance(self.exact_rows, bool):
            raise ConfigError(f"MHCConfig.exact_rows must be True or False, got {self.exact_rows!r}")
        if not self.eps > 0 or self.phi_std < 0:
            raise ConfigError(f"MHCConfig.eps must be > 0 and phi_std >= 0, got eps={self.eps!r}, phi_std={self.phi_std!r}")

    def describe(self, block_size: int | None = None) -> str:
        return f"mHC, n={self.streams} streams, {self.sinkhorn_iters} Sinkhorn iterations, {self.collapse} collapse"


class _HCSite(nn.Module):
    """One mHC site: φ [n·d, n²+2n], b [n²+2n], α [3] (kept in fp32, as the spec recommends)."""

    def __init__(self, d: int, config: MHCConfig, device: torch.device):
        super().__init__()
        n = config.streams
        kw = dict(dtype=torch.float32, device=device)
        self._init = (n, config.phi_std, config.eps, float(config.alpha_init))
        self.phi = nn.Parameter(torch.empty(n * d, n * n + 2 * n, **kw))
        self.bias = nn.Parameter(torch.empty(n * n + 2 * n, **kw))
        self.alpha = nn.Parameter(torch.empty(3, **kw))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The init, in place (also what ``to_empty`` + ``reset_parameters`` recipes call: OLMo-core's
        ``init_weights``, meta-device initialisation): φ ~ N(0, phi_std²) drawn from the global generator."""
        n, phi_std, eps, alpha_init = self._init
        kw = dict(dtype=torch.float32, device=self.phi.device)
        self.phi.copy_(torch.randn(self.phi.shape, **kw) * phi_std)
        b_res = -5.0 * (1.0 - torch.eye(n, **kw))
        # b_pre: σ(b_pre) + ε = 1/n, so H_pre sums to 1 with the +ε floor (the spec's −log(n−1), corrected for ε): the
        # sublayer then reads the stream itself, not (1 + nε) times it (a norm with its own ε is not quite scale-free)
        q = 1.0 / n - eps
        b_pre = math.log(q / (1.0 - q)) if q > 0 else -math.log(n - 1)
        self.bias.copy_(torch.cat([torch.full((n,), b_pre, **kw), torch.zeros(n, **kw), b_res.flatten()]))
        self.alpha.fill_(alpha_init)


def _rewrite_mhc(gm: fx.GraphModule, chain: Chain, config: MHCConfig) -> PassResult:
    ed = ChainEditor(gm, chain, config.name)
    graph, L, n = ed.graph, ed.L, config.streams
    ops = torch.ops.depthrewrite
    changes: list[Change] = []
    streams = tuple(f"x{i}" for i in range(n))
    h0 = ed.stream(0)
    rank = tensor_val(h0).dim()
    with graph.inserting_before(ed.readers_of(0)[0]):
        X = graph.call_function(torch.ops.aten.repeat.default, (graph.call_function(torch.ops.aten.unsqueeze.default, (h0, -2)), [1] * (rank - 1) + [n, 1]))
    inherit_meta(X, h0, NodeRole("expand", 0, config.name))
    X.meta.pop("val", None)
    for k in range(L):
        name = f"hc_{k}"
        site = ed.site_module(name, lambda: _HCSite(chain.hidden_size, config, ed.device))
        old = ed.stream(k)
        with graph.inserting_before(ed.readers_of(k)[0]):
            coeffs = graph.call_function(
                ops.mhc_coeffs.default,
                (X, ed.get_attr(f"{name}.phi"), ed.get_attr(f"{name}.bias"), ed.get_attr(f"{name}.alpha"), config.sinkhorn_iters, config.eps,
                 config.exact_rows),
            )
            pre, post, res = (graph.call_function(operator.getitem, (coeffs, i)) for i in range(3))
            u = graph.call_function(ops.mhc_pre.default, (X, pre))
        inherit_meta(u, old, NodeRole("mhc_pre", k, config.name), val_from=h0)  # h0's shape: the stream may be reshaped
        ed.redirect(k, u)
        y = ed.output_of(k)
        with graph.inserting_after(y):
            X = graph.call_function(ops.mhc_post.default, (X, res, post, y))
        inherit_meta(X, ed.nodes[chain.sublayers[k].residual_add], NodeRole("mhc_state", k, config.name))
        X.meta.pop("val", None)
        shapes = f"φ {list(site.phi.shape)}, b [{site.bias.numel()}], α [3] -> H_pre [{n}], H_post [{n}], H_res [{n}x{n}]"
        changes.append(Change(site=k, module=chain.sublayers[k - 1].module if k else None, created=(coeffs.name, u.name, X.name),
                              replaced=old.name, sources=streams, params=name, detail=shapes))
    old = ed.stream(L)
    with graph.inserting_before(ed.readers_of(L)[0]):
        h = graph.call_function(ops.mhc_collapse.default, (X, config.collapse))
    inherit_meta(h, old, NodeRole("collapse", "output", config.name), val_from=h0)
    ed.redirect(L, h)
    changes.append(Change(site="output", module=chain.sublayers[-1].module, created=(h.name,), replaced=old.name, sources=streams,
                          detail=f"{config.collapse} of the {n} streams"))
    d = chain.hidden_size
    result = ed.finish(changes)
    S8 = math.ceil(L / min(L, 8))
    n8 = math.ceil(L / S8) + 1  # Block AttnRes with 8 blocks: N_eff + 1 stored vectors
    notes = (
        f"the n-stream state is {n}·d = {n * d} values per token at every site (Full AttnRes stores up to "
        f"{L + 1}·d = {(L + 1) * d}, Block AttnRes with 8 blocks {n8}·d = {n8 * d})",
    )
    return PassResult(result.graph_module, result.changes, notes)



# ---------------------------------------------------------------------------------------------------------------------
# stage hooks (Scheme record): a cut before sublayer j crosses the n streams


def _stage_anchor(graph: fx.Graph, report, j: int) -> fx.Node | None:
    """Site j starts at its coefficients: ``u = mhc_pre(X, getitem(mhc_coeffs(X, ...), 0))``."""
    pre = next((n for n in graph.nodes if (r := role_of(n)) is not None and r.role == "mhc_pre" and r.site == j), None)
    return pre.args[1].args[0] if pre is not None else None


def _boundary_labels(graph: fx.Graph, report, j: int) -> dict[fx.Node, str]:
    n = report.config.streams
    labels: dict[fx.Node, str] = {}
    for x in graph.nodes:
        r = role_of(x)
        if r is not None and r.role == "mhc_state":
            labels[x] = f"X ({n} streams) after sublayer {r.site}"
        elif r is not None and r.role == "expand":
            labels[x] = f"X ({n} streams) = {n} copies of emb"
    return labels


def _state_at(report, j: int) -> DepthState:
    n, d = report.config.streams, report.chain.hidden_size
    return DepthState(n * d, f"n·d = {n}·{d}")


SCHEME = register(Scheme(
    name=MHCConfig.name,
    title="mHC",
    config=MHCConfig,
    handler=_rewrite_mhc,
    ops=("mhc_coeffs", "mhc_pre", "mhc_post", "mhc_collapse"),
    doc="docs/mhc.md",
    exact={"alpha_init": 0.0},
    # the default init (alpha = 0.01, phi ~ N(0, 1e-4)) is close to the original, not exact (docs/mhc.md)
    variants=(SchemeVariant("mhc", "mHC (n=4)", init_tol=1e-4, note="default init: close, exact only with alpha_init=0"),),
    stage_anchor=_stage_anchor,
    boundary_labels=_boundary_labels,
    state_at=_state_at,
))
