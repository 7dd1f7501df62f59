"""MoDA: mixture-of-depths attention as a rewrite of each attention operator of the detected chain.

    slots    attention sublayer l writes its own (K, V) exactly as fed to attention (after RoPE / qk-norm, Hk heads);
             MLP sublayer l writes kv_proj(Norm(h)) (a new Linear D -> 2·Hk·d); the last writer nothing reads is skipped
    site l   every attention after the first: one joint softmax over its causal sequence keys and the same token's
             slots of all earlier sublayers (token-major [B, T, n, Hk, d]); one scale; GQA groups share slots
    init     preserve_init=True adds λ [Hq] = 0 per site inside the softmax: exactly the original model at init

Zhu et al., *Mixture-of-Depths Attention*, arXiv:2603.15619; spec: shared/specs/moda.md (§2, §8 Q1/Q8/Q9/Q10).
Recognised attention forms: ``aten.scaled_dot_product_attention`` (GQA as an unsqueeze/expand/reshape repeat of K/V,
or ``enable_gqa=True``) and the eager form ``matmul(q, kᵀ) · s (+ mask) -> softmax -> (dropout) -> matmul(·, v)``.
Why post-RoPE slots are right: a slot is only read at its own position t, and (R_t q)·(R_t k) = q·k.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx as fx
import torch.nn as nn

from ...errors import AttentionPatternError, ConfigError
from ..analyse.chain import Branch, Chain
from ..analyse.graph import module_path_of
from ..analyse.ops import op_of, strip_alias, tensor_val
from ..meta import NodeRole, inherit_meta
from ..result import Change, PassResult
from .depth import ChainEditor
from .registry import SchemeConfig, register_scheme

__all__ = ["MoDAConfig", "AttentionOp", "find_attention"]

aten = torch.ops.aten
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


@dataclasses.dataclass(frozen=True)
class MoDAConfig(SchemeConfig):
    """MoDA.

    Args:
        preserve_init (bool): add a learnable per-(site, head) depth weight λ ≥ 0 inside the joint softmax,
            initialised at 0, so the converted model equals the original at init. Default: False (λ ≡ 1, the paper).
        ffn_kv (bool): MLP sublayers write a slot through a new ``kv_proj`` (the paper's default variant). False:
            attention slots only. Default: True.
    """

    preserve_init: bool = False
    ffn_kv: bool = True

    name = "moda"

    def __post_init__(self):
        for f in ("preserve_init", "ffn_kv"):
            if not isinstance(getattr(self, f), bool):
                raise ConfigError(f"MoDAConfig.{f} must be True or False, got {getattr(self, f)!r}")

    def describe(self, block_size: int | None = None) -> str:
        slots = "attention + FFN kv_proj slots" if self.ffn_kv else "attention slots only"
        init = "preserve_init (λ = 0)" if self.preserve_init else "λ ≡ 1 (paper)"
        return f"MoDA, {slots}, {init}"


@dataclasses.dataclass(frozen=True)
class AttentionOp:
    """One attention operator recovered from the graph."""

    node: fx.Node  # the node whose output is the attention output [B, Hq, T, d]
    q: fx.Node
    k: fx.Node  # before any GQA repeat: [B, Hk, S, d]
    v: fx.Node
    mask: fx.Node | None
    scale: float
    is_causal: bool
    dropout_p: float
    softcap: float
    hq: int
    hk: int
    d: int
    form: str  # "sdpa" | "eager"


def _unrepeat(x: fx.Node) -> fx.Node:
    """K/V before HF's repeat_kv (``k[:, :, None].expand(..).reshape(..)``: unsqueeze -> full slices -> expand ->
    reshape), else ``x``. The head count is checked against the shapes."""
    if _aten_name(x) in ("reshape", "view", "_unsafe_view"):
        e = x.args[0]
        if isinstance(e, fx.Node) and _aten_name(e) == "expand":
            u = e.args[0]
            while isinstance(u, fx.Node) and _aten_name(u) == "slice":
                u = u.args[0]
            if isinstance(u, fx.Node) and _aten_name(u) == "unsqueeze" and isinstance(u.args[0], fx.Node):
                base, full = _shape(u.args[0]), _shape(x)
                if len(base) == len(full) == 4 and _static_int(full[1]) % max(1, _static_int(base[1])) == 0:
                    return u.args[0]
    return x


def _aten_name(n: fx.Node) -> str | None:
    packet = getattr(n.target, "overloadpacket", None)
    return getattr(packet, "__name__", None) if packet is not None else None


def _shape(n: fx.Node) -> tuple[int, ...]:
    v = tensor_val(n)
    return tuple(v.shape) if v is not None else ()


def _static_int(x) -> int:
    try:
        return int(x)
    except (TypeError, ValueError):
        return -1


def _from_sdpa(n: fx.Node) -> AttentionOp:
    a = dict(zip(_SDPA_ARGS, n.args))
    a.update(n.kwargs)
    q, k, v = a["query"], _unrepeat(a["key"]), _unrepeat(a["value"])
    hq, d = _static_int(_shape(q)[1]), _static_int(_shape(q)[-1])
    hk = _static_int(_shape(k)[1])
    scale = a.get("scale")
    return AttentionOp(
        node=n, q=q, k=k, v=v, mask=a.get("attn_mask"), scale=float(scale) if scale is not None else 1.0 / math.sqrt(d),
        is_causal=bool(a.get("is_causal", False)), dropout_p=float(a.get("dropout_p", 0.0) or 0.0), softcap=0.0, hq=hq,
        hk=hk, d=d, form="sdpa",
    )


def _from_eager(sm: fx.Node) -> AttentionOp | None:
    """softmax(matmul(q, kᵀ) · s [soft-cap] [+ mask]) [-> cast -> dropout] -> matmul(·, v)."""
    scale, mask, softcap, cur = 1.0, None, 0.0, sm.args[0]
    while isinstance(cur, fx.Node) and op_of(cur) != "matmul":
        op = op_of(cur)
        if op == "cast":
            cur = cur.args[0]
        elif op in ("mul", "div") and not isinstance(cur.args[1], fx.Node):
            scale = scale * float(cur.args[1]) if op == "mul" else scale / float(cur.args[1])
            cur = cur.args[0]
        elif op == "add" and mask is None:
            x, y = cur.args[0], cur.args[1]
            cur, mask = (x, y) if isinstance(x, fx.Node) and any(op_of(p) == "matmul" for p in _chain_up(x)) else (y, x)
        elif _aten_name(cur) == "tanh" and softcap == 0.0:
            # c·tanh(x/c): the scale collected so far is c; the division below it is 1/c
            inner = cur.args[0]
            if op_of(inner) != "div" or isinstance(inner.args[1], fx.Node):
                return None
            softcap = float(inner.args[1])
            if abs(scale - softcap) > 1e-6 * softcap:
                return None
            scale, cur = 1.0, inner.args[0]
        else:
            return None
    if not isinstance(cur, fx.Node):
        return None
    m1 = cur
    q, kt = m1.args[0], m1.args[1]
    if _aten_name(kt) != "transpose":
        return None
    k = _unrepeat(kt.args[0])
    p, dropout = sm, 0.0
    while True:
        users = [u for u in p.users if tensor_val(u) is not None]
        if len(users) != 1:
            return None
        u = users[0]
        if op_of(u) == "cast":
            p = u
        elif op_of(u) == "dropout":
            dropout = float(u.args[1]) if len(u.args) > 2 and u.args[2] else 0.0
            p = u
        elif op_of(u) == "matmul" and u.args[0] is p:
            m2 = u
            break
        else:
            return None
    v = _unrepeat(m2.args[1])
    hq, d, hk = _static_int(_shape(q)[1]), _static_int(_shape(q)[-1]), _static_int(_shape(k)[1])
    return AttentionOp(node=m2, q=q, k=k, v=v, mask=mask if isinstance(mask, fx.Node) else None, scale=scale,
                       is_causal=False, dropout_p=dropout, softcap=softcap, hq=hq, hk=hk, d=d, form="eager")


def _chain_up(n: fx.Node, limit: int = 6):
    out = []
    for _ in range(limit):
        out.append(n)
        if not n.args or not isinstance(n.args[0], fx.Node):
            break
        n = n.args[0]
    return out


def find_attention(ed: ChainEditor, branch: Branch) -> AttentionOp:
    """The one attention operator of an attention branch, or AttentionPatternError naming what was found."""
    body = {ed.nodes[n] for n in branch.nodes}
    sdpa = [n for n in body if op_of(n) == "sdpa"]
    if len(sdpa) == 1 and sdpa[0].target is aten.scaled_dot_product_attention.default:
        found = _from_sdpa(sdpa[0])
    else:
        softmaxes = sorted((n for n in body if op_of(n) == "softmax"), key=ed.order.__getitem__)
        found = _from_eager(softmaxes[0]) if len(softmaxes) == 1 and not sdpa else None
        if found is None:
            what = sdpa or softmaxes or [ed.nodes[branch.output]]
            where = f"`{what[0].name}` ({what[0].target})" if (sdpa or softmaxes) else f"no softmax or SDPA before `{what[0].name}`"
            raise AttentionPatternError(
                f"the attention branch in {branch.module} cannot be rewritten by MoDA: found {where}; expected one "
                "aten.scaled_dot_product_attention or the eager form matmul(q, kᵀ)·scale (+ mask) -> softmax -> "
                "matmul(·, v) (optionally with tanh soft-capping). Try attn_implementation='sdpa' or 'eager'.",
                node=what[0].name,
            )
    if min(found.hq, found.hk, found.d) <= 0 or found.hq % found.hk:
        raise AttentionPatternError(
            f"attention `{found.node.name}` in {branch.module}: cannot read static head counts from q {_shape(found.q)} "
            f"and k {_shape(found.k)} (need [B, H, T, d] with Hq a multiple of Hk)",
            node=found.node.name,
        )
    return found


class _KVProj(nn.Module):
    """The FFN depth-KV projection D -> 2·Hk·d (no bias)."""

    def __init__(self, D: int, hk: int, d: int, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(2 * hk * d, D, dtype=dtype, device=device))
        nn.init.normal_(self.weight, std=D ** -0.5)


class _Lambda(nn.Module):
    def __init__(self, hq: int, dtype, device):
        super().__init__()
        self.depth_weight = nn.Parameter(torch.zeros(hq, dtype=dtype, device=device))


@register_scheme(MoDAConfig)
def _rewrite_moda(gm: fx.GraphModule, chain: Chain, config: MoDAConfig) -> PassResult:
    ed = ChainEditor(gm, chain, config.name)
    graph = ed.graph
    attn = {k: find_attention(ed, b) for k, s in enumerate(chain.sublayers) for b in s.branches if b.kind == "attention"}
    if len(attn) < 2:
        raise ConfigError(f"MoDA needs at least two attention sublayers to add depth slots; this model has {len(attn)}")
    shapes = {(a.hq, a.hk, a.d) for a in attn.values()}
    if len(shapes) != 1:
        raise ConfigError(f"MoDA needs one attention shape (Hq, Hk, d) across layers; found {sorted(shapes)}")
    hq, hk, d = shapes.pop()
    last_reader = max(attn)
    D = chain.hidden_size
    ops = torch.ops.depthrewrite
    slots_k: list[fx.Node] = []
    slots_v: list[fx.Node] = []
    labels: list[str] = []
    changes: list[Change] = []
    for k, s in enumerate(chain.sublayers):
        a = attn.get(k)
        if a is not None and slots_k:
            name = f"moda_{k}"
            with graph.inserting_before(a.node):
                Kd = graph.call_function(ops.moda_slots.default, (list(slots_k),))
                Vd = graph.call_function(ops.moda_slots.default, (list(slots_v),))
                lam = None
                if config.preserve_init:
                    ed.site_module(name, lambda: _Lambda(hq, ed.dtype, ed.device))
                    lam = ed.get_attr(f"{name}.depth_weight")
                seed = None
                if a.dropout_p > 0:
                    seed = graph.call_function(aten.randint.low, (0, 2**31 - 1, [1]), {"device": ed.device})
                new = graph.call_function(
                    ops.moda_attn.default,
                    (a.q, a.k, a.v, a.mask, Kd, Vd, lam, a.scale, a.is_causal, a.dropout_p, seed, a.softcap),
                )
            inherit_meta(new, a.node, NodeRole("moda_attn", k, config.name))
            a.node.replace_all_uses_with(new)
            n = len(slots_k)
            flops = 4 * hq * d * n
            changes.append(Change(
                site=k, module=s.module, created=(Kd.name, Vd.name, new.name), replaced=a.node.name,
                sources=tuple(labels), params=name if config.preserve_init else None,
                detail=f"{a.form}; +{flops:,} FLOPs/token; depth KV {n * 2 * hk * d:,} values/token",
            ))
        if k >= last_reader:
            continue  # nothing after this sublayer reads a slot
        if a is not None:
            slots_k.append(a.k)
            slots_v.append(a.v)
            labels.append(f"attn{k}")
        mlp = [b for b in s.branches if b.kind != "attention"]
        if config.ffn_kv and mlp:
            b = mlp[0]
            src = ed.nodes[b.pre_norm.output] if b.pre_norm is not None else strip_alias(ed.stream(k))
            src = ed.canonical(src)  # [B, T, D] where the model flattens the stream (OPT)
            name = f"kv_proj_{k}"
            ed.site_module(name, lambda: _KVProj(D, hk, d, ed.dtype, ed.device))
            with graph.inserting_before(src.next):  # right after the normed input, in creation order
                w = ed.get_attr(f"{name}.weight")
                kv = graph.call_function(aten.linear.default, (src, w))
                kv5 = graph.call_function(aten.unflatten.int, (kv, -1, [2, hk, d]))  # [B, T, 2, Hk, d]
                kf = graph.call_function(aten.transpose.int, (graph.call_function(aten.select.int, (kv5, -3, 0)), 1, 2))
                vf = graph.call_function(aten.transpose.int, (graph.call_function(aten.select.int, (kv5, -3, 1)), 1, 2))
            for node in (kv, kf, vf):
                inherit_meta(node, src, NodeRole("kv_proj", k, config.name))
                node.meta.pop("val", None)
            slots_k.append(kf)
            slots_v.append(vf)
            labels.append(f"ffn{k}")
            changes.append(Change(
                site=k, module=b.module or module_path_of(src), created=(kv.name, kf.name, vf.name), replaced=None,
                sources=(), params=name, detail=f"writes slot ffn{k}: kv_proj {D} -> 2·{hk}·{d}; +{2 * D * 2 * hk * d:,} FLOPs/token",
            ))
    result = ed.finish(changes)
    n_max = len(slots_k)
    extra = sum(4 * hq * d * len(c.sources) for c in changes if c.sources) + sum(4 * D * hk * d for c in changes if not c.sources)
    base = 2 * sum(p.numel() for n, p in gm.named_parameters() if not n.startswith("depthrewrite."))
    notes = (
        f"extra FLOPs per token: {extra:,} (+{100 * extra / max(1, base):.2f}% of the original's ~2·params = {base:,}, "
        "attention scores excluded)",
        f"depth slots are token-major [B, T, n, Hk={hk}, d={d}] and transient (same-token only): the persistent KV "
        "cache is unchanged",
    )
    return PassResult(result.graph_module, result.changes, notes, state=(n_max * 2 * hk * d, "transient depth KV"))
