"""MoDA: mixture-of-depths attention as a rewrite of each attention operator of the detected chain.

    slots    attention sublayer l writes its own (K, V) exactly as fed to attention (after RoPE / qk-norm, Hk heads);
             MLP sublayer l writes kv_proj(Norm(h)) (a new Linear D -> Hk·(d + dv), 2·Hk·d unless the value head dim
             differs (MLA); biased iff the k projection is), its keys
             replayed through the block attention's key path (k-norm, RoPE; read from the graph, ``ffn_keys``); the last
             writer nothing reads is skipped
    site l   every attention after the first: one joint softmax over its causal sequence keys and the same token's
             slots of all earlier sublayers (token-major [B, T, n, Hk, d]); one scale; GQA groups share slots
    init     preserve_init=True adds λ [Hq] = 0 per site inside the softmax: exactly the original model at init

Zhu et al., *Mixture-of-Depths Attention*, arXiv:2603.15619; spec: shared/specs/moda.md (§2, §8 Q1/Q8/Q9/Q10).
Recognised attention forms: ``aten.scaled_dot_product_attention`` (GQA as an unsqueeze/expand/reshape repeat of K/V,
litgpt's repeat_interleave, or ``enable_gqa=True``) and the eager form ``matmul(q, kᵀ) · s (+ mask | masked_fill(mask, -inf)) -> softmax -> (dropout)
-> matmul(·, v)`` (HF eager, minGPT / nanoGPT without flash, litgpt's soft-capped Gemma-2; kᵀ is any op that transposes
k's last two dims: transpose, mT, permute, t; a lower-triangular buffer mask is read as causal).
Why post-RoPE slots are right: a slot is only read at its own position t, and (R_t q)·(R_t k) = q·k.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re

import torch
import torch.fx as fx
import torch.nn as nn

from ...errors import AttentionPatternError, ConfigError
from ...kernels import moda as _kernels  # noqa: F401  (registers depthrewrite::moda_*, the ops this rewrite inserts)
from ..analyse.chain import Branch, Chain
from ..analyse.graph import describe_collective, first_collective, module_path_of
from ..analyse.ops import op_name, op_of, strip_alias, tensor_val
from ..meta import NodeRole, depth_op_name, inherit_meta, role_of, sizes_of, unsafe_view_of
from ..result import Change, PassResult
from .editor import ChainEditor
from .registry import DepthState, Scheme, SchemeConfig, SchemeVariant, register

__all__ = ["MoDAConfig", "AttentionOp", "find_attention"]

aten = torch.ops.aten
FFN_KEYS = ("block", "next", "raw")
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


@dataclasses.dataclass(frozen=True)
class MoDAConfig(SchemeConfig):
    """MoDA.

    Args:
        preserve_init (bool): add a learnable per-(site, head) depth weight λ ≥ 0 inside the joint softmax,
            initialised at 0, so the converted model equals the original at init. Default: False (λ ≡ 1, the paper).
        ffn_kv (bool): MLP sublayers write a slot through a new ``kv_proj`` (the paper's default variant). False:
            attention slots only. Default: True.
        ffn_keys (str): the key path FFN-slot keys go through, so that they live in the attention keys' space
            (moda.md §8 Q1/Q2): ``"block"`` (default, the spec's choice) replays the key pipeline of the same block's
            attention — every op between its k projection and the attention op's key input (k-norm, RoPE at the
            token's own position, layout) — on the ``kv_proj`` keys; ``"next"`` replays the pipeline of the next
            attention (the slot's first reader); ``"raw"`` stores the ``kv_proj`` keys as they are.
    """

    preserve_init: bool = False
    ffn_kv: bool = True
    ffn_keys: str = "block"

    name = "moda"

    def __post_init__(self):
        for f in ("preserve_init", "ffn_kv"):
            if not isinstance(getattr(self, f), bool):
                raise ConfigError(f"MoDAConfig.{f} must be True or False, got {getattr(self, f)!r}")
        if self.ffn_keys not in FFN_KEYS:
            raise ConfigError(f"MoDAConfig.ffn_keys must be one of {', '.join(map(repr, FFN_KEYS))}, got {self.ffn_keys!r}")

    def describe(self, block_size: int | None = None) -> str:
        slots = "attention + FFN kv_proj slots" if self.ffn_kv else "attention slots only"
        init = "preserve_init (λ = 0)" if self.preserve_init else "λ ≡ 1 (paper)"
        return f"MoDA, {slots}, {init}"


@dataclasses.dataclass(frozen=True)
class AttentionOp:
    """One attention operator recovered from the graph."""

    node: fx.Node  # the node whose output is the attention output [B, Hq, T, dv]
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
    d: int  # the query/key head dim
    form: str  # "sdpa" | "eager"
    fill: fx.Node | None = None  # a masked_fill mask (True = masked) to negate into the sequence mask
    dv: int = -1  # the value head dim (MLA: DeepSeek's v_head_dim differs from its q/k head dim); -1: d

    @property
    def dims(self) -> tuple[int, int]:
        """(query/key head dim, value head dim)."""
        return self.d, self.d if self.dv < 0 else self.dv


def _unrepeat(x: fx.Node) -> fx.Node:
    """K/V before a GQA repeat of the heads that maps query head h to KV head h // G, else ``x``: HF's repeat_kv
    (``k[:, :, None].expand(..).reshape(..)``: unsqueeze -> full slices -> expand -> reshape) or litgpt's
    ``k.repeat_interleave(G, dim=1)``. The head count is checked against the shapes."""
    if op_name(x) == "repeat_interleave" and len(x.args) >= 2 and isinstance(x.args[0], fx.Node) \
            and isinstance(x.args[1], int):
        dim = x.args[2] if len(x.args) > 2 else x.kwargs.get("dim")
        base, full = _shape(x.args[0]), _shape(x)
        if len(base) == len(full) == 4 and dim in (1, -3) and _static_int(base[1]) > 0 \
                and _static_int(full[1]) == _static_int(base[1]) * x.args[1]:
            return x.args[0]
    if op_name(x) in ("reshape", "view", "_unsafe_view"):
        e = x.args[0]
        if isinstance(e, fx.Node) and op_name(e) == "expand":
            u = e.args[0]
            while isinstance(u, fx.Node) and op_name(u) == "slice":
                u = u.args[0]
            if isinstance(u, fx.Node) and op_name(u) == "unsqueeze" and isinstance(u.args[0], fx.Node):
                base, full = _shape(u.args[0]), _shape(x)
                if len(base) == len(full) == 4 and _static_int(full[1]) % max(1, _static_int(base[1])) == 0:
                    return u.args[0]
    return x


def _this_call_tokens(x: fx.Node, q: fx.Node) -> fx.Node:
    """K or V of the tokens of this call: where the attention reads a KV cache (``cat([cached, new], dim=-2)``, as
    ``DynamicLayer.update`` builds it), the new part, so a depth slot holds the same token's K/V while decoding."""
    kq, kx = _shape(q), _shape(x)
    if len(kq) < 2 or len(kx) < 2 or kq[-2] is kx[-2] or str(kq[-2]) == str(kx[-2]):
        return x
    c = x
    while op_name(c) == "slice" and len(c.args) >= 4 and c.args[2] in (0, None) and isinstance(c.args[3], int) \
            and c.args[3] >= 2**62 and isinstance(c.args[0], fx.Node):  # full slices (x[:, :, ...])
        c = c.args[0]
    if op_name(c) == "cat" and isinstance(c.args[0], (list, tuple)) and len(c.args[0]) >= 2:
        dim = c.args[1] if len(c.args) > 1 else c.kwargs.get("dim", 0)
        last = c.args[0][-1]
        if dim in (-2, len(kx) - 2) and isinstance(last, fx.Node) and str(_shape(last)[-2:-1]) == str(kq[-2:-1]):
            return last
    if op_name(c) in ("index_copy_", "index_copy") and len(c.args) >= 4 and isinstance(c.args[3], fx.Node):
        # a cache the model keeps in a buffer, written in place at this call's positions (litgpt's KVCache):
        # buffer.index_copy_(seq_dim, input_pos, new); the new part is this call's own tokens
        dim, new = c.args[1], c.args[3]
        if dim in (-2, len(kx) - 2) and str(_shape(new)[-2:-1]) == str(kq[-2:-1]):
            return new
    raise ConfigError(
        f"MoDA: the keys/values `{x.name}` of the attention at `{q.name}`'s reader span {kx[-2]} positions where its "
        f"queries span {kq[-2]}, and they are not a KV cache's cat([cached, new], dim=-2): the depth slots need this "
        "call's own tokens. Call without the KV cache (HF: use_cache=False; a model-managed cache: clear it / don't "
        "set it)."
    )


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
        hk=hk, d=d, form="sdpa", dv=_static_int(_shape(v)[-1]),
    )


_EAGER_FORM = (
    "aten.scaled_dot_product_attention, or the eager form matmul(q, kᵀ) [· or / a constant] [c·tanh(·/c) soft-cap] "
    "[+ an additive mask | .masked_fill(mask, -inf)] -> softmax(dim=-1) [-> dropout] -> matmul(·, v)"
)


_ORDER = "from the softmax back [mask] -> [c·tanh(·/c) soft-cap] -> [scale] -> matmul(q, kᵀ)"


class _Mismatch(Exception):
    """The eager attention walk met ``node``, which does not fit; ``why`` says what was expected there."""

    def __init__(self, node: fx.Node, why: str):
        super().__init__(why)
        self.node, self.why = node, why


def _attr_value(gm: fx.GraphModule, n: fx.Node) -> torch.Tensor | None:
    if n.op != "get_attr":
        return None
    obj = gm
    for part in str(n.target).split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, torch.Tensor) else None


def _is_causal_buffer_mask(gm: fx.GraphModule, fill: fx.Node) -> bool:
    """``buf[..., :T, :T] == 0`` with ``buf`` a lower-triangular 0/1 buffer (minGPT / nanoGPT's registered ``bias``):
    True exactly above the diagonal, i.e. masked_fill(·, fill, -inf) is the causal mask."""
    if op_name(fill) != "eq" or fill.args[1] != 0 or not isinstance(fill.args[0], fx.Node):
        return False
    x = fill.args[0]
    while isinstance(x, fx.Node) and op_name(x) == "slice":
        start = x.args[2] if len(x.args) > 2 else 0
        if start not in (None, 0):
            return False
        x = x.args[0]
    buf = _attr_value(gm, x) if isinstance(x, fx.Node) else None
    if buf is None or buf.dim() < 2 or buf.shape[-1] != buf.shape[-2]:
        return False
    b = buf.reshape(-1, *buf.shape[-2:])
    return bool((b == torch.ones_like(b[0]).tril()).all())


#: ops that return their input unchanged as far as the scores are concerned (no data movement that matters)
_SAME = ("alias", "contiguous", "clone", "detach")


def _through_same(n):
    while isinstance(n, fx.Node) and op_name(n) in _SAME and n.args and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n


def _transpose_of_last_two(kt) -> fx.Node | None:
    """The tensor ``kt`` is a transpose of over its last two dims (read from the op and its arguments, not from how
    the model spelled it): ``transpose(x, a, b)`` / ``swapaxes`` / ``swapdims`` with {a, b} the last two dims,
    ``x.mT``, ``x.mH`` of a real tensor, ``permute(x, dims)`` that swaps only the last two, ``x.t()`` of a 2-D x;
    aliases, ``contiguous()`` and clones on either side are looked through. None otherwise."""
    kt = _through_same(kt)
    if not isinstance(kt, fx.Node) or not kt.args or not isinstance(kt.args[0], fx.Node):
        return None
    x, name = kt.args[0], op_name(kt) or (kt.target if kt.op == "call_method" else None)
    nd = len(_shape(kt)) or len(_shape(x))
    if nd < 2:
        return None
    last_two = {nd - 2, nd - 1}
    norm = lambda i: i % nd if isinstance(i, int) else None  # noqa: E731
    found = False
    if name in ("transpose", "swapaxes", "swapdims") and len(kt.args) >= 3:
        found = {norm(kt.args[1]), norm(kt.args[2])} == last_two
    elif name == "mT":
        found = True
    elif name in ("mH", "adjoint"):
        v = tensor_val(x)
        found = v is not None and not v.is_complex()
    elif name == "permute":
        dims = kt.args[1] if len(kt.args) > 1 else kt.kwargs.get("dims")
        if isinstance(dims, (list, tuple)) and len(dims) == nd and all(isinstance(i, int) for i in dims):
            found = [norm(i) for i in dims] == [*range(nd - 2), nd - 1, nd - 2]
    elif name in ("t", "numpy_T"):
        found = nd == 2
    return _through_same(x) if found else None


def _from_eager(sm: fx.Node, gm: fx.GraphModule) -> AttentionOp:
    """softmax(matmul(q, kᵀ) · s [soft-cap] [+ mask | masked_fill]) [-> cast -> dropout] -> matmul(·, v), or
    _Mismatch naming the first node that does not fit."""
    dim = sm.args[1] if len(sm.args) > 1 else sm.kwargs.get("dim")
    nd = len(_shape(sm))
    if dim not in (-1, nd - 1):
        raise _Mismatch(sm, f"a softmax over the last dimension (the keys); this one is over dim={dim}")
    # moda_attn computes softcap(s · scores) + mask, so from the softmax back the order must be
    # [mask] -> [soft-cap] -> [scale] -> matmul. A positive constant scale above a masked_fill(-inf) commutes with it
    # (-inf · s = -inf); an additive mask below a scale or a soft-cap, or a masked_fill below a soft-cap, does not.
    scale, mask, fill, softcap, cur = 1.0, None, None, 0.0, sm.args[0]
    scaled = False  # a scale was met (above the current node)
    while isinstance(cur, fx.Node) and op_of(cur) != "matmul":
        op, name = op_of(cur), op_name(cur)
        if op == "cast":
            cur = cur.args[0]
        elif op in ("mul", "div") and not isinstance(cur.args[1], fx.Node):
            scale = scale * float(cur.args[1]) if op == "mul" else scale / float(cur.args[1])
            scaled = scaled or float(cur.args[1]) != 1.0
            cur = cur.args[0]
        elif op == "add" and mask is None and fill is None:
            if softcap:
                raise _Mismatch(cur, f"the order {_ORDER}: an additive mask below the c·tanh(·/c) soft-cap is capped "
                                     "with the scores, which MoDA cannot reproduce")
            if scaled:
                raise _Mismatch(cur, f"the order {_ORDER}: an additive mask below the scale ({scale:g}) is scaled with "
                                     "the scores, which MoDA cannot reproduce (add the mask after scaling)")
            x, y = cur.args[0], cur.args[1]
            cur, mask = (x, y) if isinstance(x, fx.Node) and any(op_of(p) == "matmul" for p in _chain_up(x)) else (y, x)
        elif name == "masked_fill" and mask is None and fill is None:
            value = cur.args[2] if len(cur.args) > 2 else cur.kwargs.get("value")
            if isinstance(value, fx.Node) or not float(value) <= -1e4:
                raise _Mismatch(cur, f"masked_fill with -inf (a mask); this one fills {value}")
            mv = tensor_val(cur.args[1])
            if not isinstance(cur.args[1], fx.Node) or (mv is not None and mv.dtype != torch.bool):
                raise _Mismatch(cur, "masked_fill with a boolean mask tensor")
            if softcap:
                raise _Mismatch(cur, f"the order {_ORDER}: masked_fill below the c·tanh(·/c) soft-cap turns -inf into "
                                     "-c, which MoDA cannot reproduce (mask after soft-capping)")
            if scaled and not (scale > 0 and (math.isinf(float(value)) or float(value) * scale <= -1e4)):
                raise _Mismatch(cur, f"the order {_ORDER}: masked_fill below the scale {scale:g} commutes with it only "
                                     "for a positive scale that keeps the fill value a mask")
            fill, cur = cur.args[1], cur.args[0]
        elif name == "tanh" and softcap == 0.0:
            # c·tanh(x/c): the scale collected so far is c; the division below it is 1/c
            inner = cur.args[0]
            if op_of(inner) != "div" or isinstance(inner.args[1], fx.Node):
                raise _Mismatch(cur, "soft-capping as c·tanh(scores / c) with a constant c")
            softcap = float(inner.args[1])
            if abs(scale - softcap) > 1e-6 * softcap:
                raise _Mismatch(cur, "soft-capping as c·tanh(scores / c) with the same constant c on both sides")
            scale, scaled, cur = 1.0, False, inner.args[0]
        elif op in ("add",) or name == "masked_fill":
            raise _Mismatch(cur, "at most one mask (an additive mask or one masked_fill) between the scores and the softmax")
        else:
            x = cur  # name a score op hidden behind layout ops (BLOOM: view(baddbmm(alibi, q, kᵀ, beta, alpha)))
            while isinstance(x, fx.Node) and _is_layout(x) and x.args and isinstance(x.args[0], fx.Node):
                x = x.args[0]
            if isinstance(x, fx.Node) and op_name(x) in ("baddbmm", "addbmm", "bmm"):
                raise _Mismatch(x, f"the scores as matmul(q, kᵀ); `{op_name(x)}` computes them"
                                   + (" with an added bias (ALiBi as baddbmm(alibi, q, kᵀ), BLOOM), which is not a "
                                      "recognised form" if op_name(x) != "bmm" else ", which is not a recognised form"))
            raise _Mismatch(cur, "only a constant scale, tanh soft-capping, an additive mask or masked_fill(mask, -inf) "
                                 "between the scores matmul(q, kᵀ) and the softmax")
    if not isinstance(cur, fx.Node):
        raise _Mismatch(sm, "scores computed as matmul(q, kᵀ) before the softmax")
    m1 = cur
    if op_name(m1) != "matmul" or len(m1.args) < 2:
        raise _Mismatch(m1, "the scores as matmul(q, kᵀ) (torch.matmul / @)")
    q, kt = m1.args[0], m1.args[1]
    k = _transpose_of_last_two(kt) if isinstance(kt, fx.Node) else None
    if k is None:
        got = f"`{kt.name}` ({kt.target})" if isinstance(kt, fx.Node) else repr(kt)
        raise _Mismatch(m1, "the scores as q @ kᵀ with kᵀ a transpose of k's last two dims (k.transpose(-2, -1), k.mT, "
                            f"k.permute(..., -1, -2)): the second operand {got} is not one")
    if len(_shape(q)) != 4 or len(_shape(k)) != 4:
        raise _Mismatch(m1, f"q and k as [B, H, T, d] (4-d) tensors; here q is {tuple(_shape(q))} and k "
                            f"{tuple(_shape(k))}")
    k = _unrepeat(k)
    p, dropout = sm, 0.0
    while True:
        users = [u for u in p.users if tensor_val(u) is not None or op_of(u) in ("dropout", "matmul", "cast")]
        if len(users) != 1:
            raise _Mismatch(p, f"one reader of the attention probabilities; `{p.name}` has {len(users)}")
        u = users[0]
        if op_of(u) == "cast":
            p = u
        elif op_of(u) == "dropout":
            dropout = float(u.args[1]) if len(u.args) > 2 and u.args[2] else 0.0
            p = u
        elif op_name(u) == "matmul" and u.args[0] is p:
            m2 = u
            break
        else:
            raise _Mismatch(u, "dropout or matmul(probabilities, v) after the softmax")
    v = _unrepeat(m2.args[1])
    causal = fill is not None and _is_causal_buffer_mask(gm, fill)
    hq, d, hk = _static_int(_shape(q)[1]), _static_int(_shape(q)[-1]), _static_int(_shape(k)[1])
    return AttentionOp(node=m2, q=q, k=k, v=v, mask=mask if isinstance(mask, fx.Node) else None, scale=scale,
                       is_causal=causal, dropout_p=dropout, softcap=softcap, hq=hq, hk=hk, d=d, form="eager",
                       fill=None if causal else fill, dv=_static_int(_shape(v)[-1]))


def _chain_up(n: fx.Node, limit: int = 6):
    out = []
    for _ in range(limit):
        out.append(n)
        if not n.args or not isinstance(n.args[0], fx.Node):
            break
        n = n.args[0]
    return out


def _hf_module_hint(nodes) -> bool:
    """Whether the branch comes from a Hugging Face transformers module (its nn_module_stack names the classes)."""
    for n in nodes:
        for entry in (n.meta.get("nn_module_stack") or {}).values():
            t = entry[1] if isinstance(entry, tuple) and len(entry) > 1 else entry
            name = f"{getattr(t, '__module__', '')}.{getattr(t, '__qualname__', '')}" if isinstance(t, type) else str(t)
            if name.startswith("transformers.") or ".transformers." in name:
                return True
    return False


def find_attention(ed: ChainEditor, branch: Branch) -> AttentionOp:
    """The one attention operator of an attention branch, or AttentionPatternError naming the node that does not fit
    and the form expected."""
    body = sorted((ed.nodes[n] for n in branch.nodes), key=ed.order.__getitem__)
    sdpa = [n for n in body if op_of(n) == "sdpa"]
    softmaxes = [n for n in body if op_of(n) == "softmax"]
    bad, why = None, ""
    flex = [n for n in body if op_of(n) == "flex_attention"]
    if flex:
        where = f" in {branch.module}" if branch.module else ""
        raise AttentionPatternError(
            f"the attention branch{where} cannot be rewritten by MoDA: `{flex[0].name}` is FlexAttention "
            "(torch.ops.higher_order.flex_attention, a block mask over the sequence), where MoDA adds its depth slots "
            f"to one softmax over sequence and depth. MoDA recognises {_EAGER_FORM}. Build the attention with "
            "scaled_dot_product_attention (torchtitan: each layer's attention.inner_attention = "
            "ScaledDotProductAttention.Config(); docs/frameworks/torchtitan.md), or use another scheme.",
            node=flex[0].name,
        )
    if len(sdpa) == 1 and sdpa[0].target is aten.scaled_dot_product_attention.default:
        found = _from_sdpa(sdpa[0])
    elif sdpa:
        bad = sdpa[0] if len(sdpa) == 1 or sdpa[0].target is not aten.scaled_dot_product_attention.default else sdpa[1]
        why = (f"found {len(sdpa)} attention operators; expected exactly one" if len(sdpa) > 1
               else "a backend-specific attention kernel; expected the generic one")
    elif len(softmaxes) == 1:
        try:
            found = _from_eager(softmaxes[0], ed.gm)
        except _Mismatch as e:
            bad, why = e.node, f"expected {e.why}"
    elif softmaxes:
        bad, why = softmaxes[1], f"{len(softmaxes)} softmax nodes ({', '.join(f'`{n.name}`' for n in softmaxes)}); expected one"
    if bad is not None:
        detail = f"`{bad.name}` ({bad.target}) does not fit: {why}"
    elif not sdpa and not softmaxes:
        bad = ed.nodes[branch.output]
        detail = f"it has no softmax and no scaled_dot_product_attention (its output is `{bad.name}` ({bad.target}))"
    if bad is not None:
        hint = ("Loading the model with attn_implementation='sdpa' (or 'eager') may give one of these forms."
                if _hf_module_hint(body) else
                "Write the attention with torch.nn.functional.scaled_dot_product_attention or in the eager form above.")
        where = f" in {branch.module}" if branch.module else ""
        raise AttentionPatternError(
            f"the attention branch{where} cannot be rewritten by MoDA: {detail}. MoDA recognises {_EAGER_FORM}. {hint}",
            node=bad.name,
        )
    if min(found.hq, found.hk, *found.dims) <= 0 or found.hq % found.hk:
        raise AttentionPatternError(
            f"attention `{found.node.name}` in {branch.module}: cannot read static head counts from q {_shape(found.q)}, "
            f"k {_shape(found.k)} and v {_shape(found.v)} (need [B, H, T, d] with Hq a multiple of Hk)",
            node=found.node.name,
        )
    return found


# ops that only move or select elements: the key projection's output reaches the first real op of the key path
# (k-norm or RoPE) through these
_LAYOUT = {
    "view", "reshape", "_unsafe_view", "transpose", "permute", "unsqueeze", "squeeze", "select", "slice", "split",
    "split_with_sizes", "chunk", "tensor_split", "unbind", "alias", "contiguous", "clone", "t", "unflatten", "flatten",
    "expand",
}


def _is_layout(n: fx.Node) -> bool:
    return op_of(n) == "getitem" or op_name(n) in _LAYOUT or (n.op == "call_method" and n.target in _LAYOUT)


@dataclasses.dataclass(frozen=True)
class KeyPath:
    """The ops an attention applies to its keys after the k projection, to be replayed on FFN-slot keys.

    ``start`` is the first tensor that holds the keys alone, just before the first non-layout op; ``layout`` its
    layout: ``"flat"`` [B, T, Hk·d], ``"bthd"`` [B, T, Hk, d] or ``"bhtd"`` [B, Hk, T, d]. ``nodes`` (graph order) map
    ``start`` to the attention op's key input; their other inputs (k-norm weights, RoPE cos/sin, sizes) are reused.
    """

    proj: fx.Node  # the k projection (aten.linear / addmm / mm)
    start: fx.Node
    layout: str
    nodes: tuple[fx.Node, ...]
    end: fx.Node  # the attention op's key input (before any GQA repeat)
    externals: tuple[fx.Node, ...]

    def describe(self) -> str:
        kinds = sorted({op_name(n) or str(n.target) for n in self.nodes if not _is_layout(n)} - {"_to_copy", "to"})
        return f"{len(self.nodes)} ops: {', '.join(kinds)}"


def _has_bias(proj: fx.Node) -> bool:
    name = op_name(proj) or getattr(proj.target, "__name__", "")
    if name == "addmm":
        return True
    if name == "linear":
        b = proj.args[2] if len(proj.args) > 2 else proj.kwargs.get("bias")
        return b is not None
    return False


def _reads_hidden_states(ed: ChainEditor, n: fx.Node, limit: int = 2000) -> bool:
    """Whether ``n`` depends on the hidden states, i.e. on the chain's stream source (every hidden state descends from
    it). Walks ``n``'s inputs; past ``limit`` nodes it answers True (a RoPE table or a norm weight is a short walk)."""
    source = ed.nodes[ed.chain.source]
    return _any_ancestor(n, lambda x: x is source, limit)


def _reached_within(root: fx.Node, allowed: set[fx.Node]) -> set[fx.Node]:
    """``root`` and every node of ``allowed`` reached from it along user edges that stay inside ``allowed``."""
    reached, stack = {root}, [root]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in allowed and u not in reached:
                reached.add(u)
                stack.append(u)
    return reached


def _any_ancestor(n: fx.Node, hit, limit: int) -> bool:
    """Whether ``hit(x)`` holds for ``n`` or one of its ancestors; past ``limit`` visited nodes the answer is True
    (the callers ask conservative questions: "may this depend on ...")."""
    stack, seen = [n], {n}
    while stack:
        x = stack.pop()
        if hit(x):
            return True
        for i in x.all_input_nodes:
            if i not in seen:
                seen.add(i)
                stack.append(i)
        if len(seen) > limit:
            return True
    return False


def key_path(ed: ChainEditor, a: AttentionOp) -> tuple[KeyPath | None, str]:
    """The key pipeline of attention ``a`` read from the graph's dataflow (k projection -> [layout] -> k-norm /
    RoPE / ... -> attention key input), or (None, why). A path of layout ops only is returned with no ``nodes``.
    Where the attention reads a KV cache, the path ends at this call's new keys (before the cache concat)."""
    end = _this_call_tokens(a.k, a.q)
    # 1. the ancestors of the key input down to the projections (linear layers end the walk)
    seen, stack, projs = {end}, [end], []
    while stack:
        n = stack.pop()
        for i in n.all_input_nodes:
            if i in seen:
                continue
            seen.add(i)
            if i.op != "call_function":
                continue
            op = op_of(i)
            if op == "linear":
                projs.append(i)
            elif op not in ("matmul", "sdpa", "softmax", "embedding"):
                stack.append(i)
    projs = [p for p in projs if len(_shape(p)) in (2, 3)]
    width = a.hk * a.d  # a k projection (or a fused qkv one) has a multiple of Hk·d outputs
    wide = [p for p in projs if _static_int(_shape(p)[-1]) > 0 and _static_int(_shape(p)[-1]) % width == 0]
    if not wide:
        return None, "no k projection (a linear layer with a multiple of Hk·d outputs) before the attention's key input"
    proj = max(wide, key=ed.order.__getitem__)
    # 2. the nodes on a path proj -> end
    path = _reached_within(proj, seen)
    if end not in path:
        return None, f"the key input `{end.name}` does not come from the k projection `{proj.name}`"
    # 3. skip the projection's own remaining ops, then the layout prefix (split of a fused qkv, head reshape,
    # transpose) up to the first real op
    start = _module_output(proj, path, a.node)
    while start is not end:
        nxt = [u for u in start.users if u in path]
        if len(nxt) == 1 and _is_layout(nxt[0]):
            start = nxt[0]
        else:
            break
    if start is end:
        return KeyPath(proj, end, "bhtd", (), end, ()), ""
    below = _reached_within(start, path)
    nodes = tuple(sorted(below - {start}, key=ed.order.__getitem__))
    # 4. where the keys are alone at ``start``: flat, token-major or head-major
    B, hk, T, d = (str(x) for x in _shape(end))
    sh = tuple(str(x) for x in _shape(start))
    flat = (B, T, str(_static_int(hk) * _static_int(d))) if _static_int(hk) > 0 and _static_int(d) > 0 else None
    turns = any(op_name(n) in ("transpose", "permute") for n in nodes)
    if sh == flat:
        layout = "flat"
    elif sh == (B, T, hk, d) and (turns or sh != (B, hk, T, d)):
        layout = "bthd"
    elif sh == (B, hk, T, d):
        layout = "bhtd"
    else:
        return None, (f"the key path starts at `{start.name}` of shape {tuple(_shape(start))}, not the keys alone as "
                      f"[B, T, Hk·d], [B, T, Hk, d] or [B, Hk, T, d]")
    # 5. the other inputs must not carry hidden-state data (e.g. a norm over concatenated q and k)
    externals = []
    for n in nodes:
        for i in n.all_input_nodes:
            if i in below or i in externals:
                continue
            if tensor_val(i) is None and not isinstance(i.meta.get("val", i.meta.get("example_value")), torch.Tensor):
                externals.append(i)  # sizes and other non-tensors (SymInts): the FFN keys have the same B, T
                continue
            if i in path or _reads_hidden_states(ed, i):
                return None, f"`{n.name}` in the key path also reads `{i.name}`, which depends on the hidden states"
            externals.append(i)
    return KeyPath(proj, start, layout, nodes, end, tuple(externals)), ""


def _scope(n: fx.Node) -> str | None:
    """The key of the innermost module call ``n`` was traced in (its ``nn_module_stack``'s last entry)."""
    stack = n.meta.get("nn_module_stack") or {}
    return next(reversed(stack), None) if stack else None


def _module_output(proj: fx.Node, path: set[fx.Node], attention: fx.Node) -> fx.Node:
    """The k projection's result as its module returns it. A linear traced through a tensor-subclass weight (torchao's
    int8 weight-only ``Int8Tensor``: ``mm`` of the int8 data, then ``mul`` by the scale) is several ops inside the
    projection module's call; those belong to the projection, not to the key path the FFN slots' keys replay. When
    ``proj`` runs in a module of its own (not in the attention's own code), the one node of that call that ``path``
    reads from outside it; ``proj`` itself otherwise."""
    scope = _scope(proj)
    if scope is None or scope == _scope(attention):
        return proj
    inside = [n for n in path if _scope(n) == scope]
    outs = [n for n in inside if any(u in path and _scope(u) != scope for u in n.users)]
    return outs[0] if len(outs) == 1 else proj


def _is_param(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op != "get_attr":
        return False
    obj = gm
    for part in str(n.target).split("."):
        obj = getattr(obj, part, None)
    return isinstance(obj, nn.Parameter)


def _root(n: fx.Node) -> fx.Node:
    """``n`` before layout ops and casts (HF's per-layer ``cos.unsqueeze(1)`` is the model's one ``cos``)."""
    while (_is_layout(n) or op_of(n) == "cast") and n.args and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n


def _positional(gm: fx.GraphModule, n: fx.Node, limit: int = 500) -> bool:
    """Whether ``n`` (an input of a key path) depends on anything but parameters and constants: a RoPE cos/sin table
    (buffers, position ids, aranges) does; a k-norm weight (or 1 + weight) does not."""

    def hit(x: fx.Node) -> bool:
        if x.op == "placeholder" or (x.op == "get_attr" and not _is_param(gm, x)):
            return True
        return x.op == "call_function" and not x.all_input_nodes and tensor_val(x) is not None  # arange, ones, ...

    return _any_ancestor(n, hit, limit)


def _structure(gm: fx.GraphModule, n: fx.Node, memo: dict, depth: int = 0):
    """A hashable description of how ``n`` is computed (ops, constants, buffer values): two per-layer copies of the
    same cos/sin table describe equal, Gemma3's local and global tables (different inv_freq) do not."""
    if n in memo:
        return memo[n]
    if n.op == "get_attr":
        t = _attr_value(gm, n)
        d = ("attr", tuple(t.shape), str(t.dtype), hash(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())) if t is not None \
            else ("attr", str(n.target))
    elif n.op == "placeholder" or depth > 40:
        d = (n.op, n.name)
    else:
        def arg(a):
            if isinstance(a, fx.Node):
                return _structure(gm, a, memo, depth + 1)
            if isinstance(a, (list, tuple)):
                return tuple(arg(x) for x in a)
            return repr(a)
        d = (str(n.target), tuple(arg(a) for a in n.args), tuple(sorted((k, arg(v)) for k, v in n.kwargs.items())))
    memo[n] = d
    return d


def _rotation(gm: fx.GraphModule, kp: KeyPath | None, memo: dict):
    """What a key path does to keys by position: frozenset of the structures of its positional inputs (RoPE cos/sin),
    empty for no positional key ops (NoPE, raw keys)."""
    if kp is None:
        return frozenset()
    ext = [_root(e) for e in kp.externals if tensor_val(e) is not None and _positional(gm, e)]
    return frozenset(_structure(gm, e, memo) for e in ext)


class _KVProj(nn.Module):
    """The FFN depth-KV projection D -> Hk·d (keys) + Hk·dv (values), keys first (2·Hk·d when dv = d), with a bias
    iff the model's k projection has one."""

    def __init__(self, D: int, hk: int, d: int, bias: bool, dtype, device, dv: int | None = None):
        super().__init__()
        width = hk * (d + (d if dv is None else dv))
        self.weight = nn.Parameter(torch.empty(width, D, dtype=dtype, device=device))
        if bias:
            self.bias = nn.Parameter(torch.empty(width, dtype=dtype, device=device))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The init, in place (also what ``to_empty`` + ``reset_parameters`` recipes call: OLMo-core's
        ``init_weights``, meta-device initialisation): weight ~ N(0, 1/D), bias 0."""
        nn.init.normal_(self.weight, std=self.weight.shape[1] ** -0.5)
        if hasattr(self, "bias"):
            self.bias.zero_()


def _key_site(k: int, attn_sites: list[int], mode: str) -> int:
    """The attention whose key path the FFN slot of sublayer k replays: the same block's (the nearest attention at or
    before k; the next one if there is none) or, with ``"next"``, the first attention after k (the first reader)."""
    before = [j for j in attn_sites if j <= k]
    after = [j for j in attn_sites if j > k]
    if mode == "next" or not before:
        return after[0]
    return before[-1]


class _Lambda(nn.Module):
    def __init__(self, hq: int, dtype, device):
        super().__init__()
        self.depth_weight = nn.Parameter(torch.empty(hq, dtype=dtype, device=device))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The init, λ = 0, in place (also what ``to_empty`` + ``reset_parameters`` recipes call)."""
        self.depth_weight.zero_()


def _viewed(n: fx.Node) -> fx.Node | None:
    """The tensor ``n`` is a view of (the input its op's schema says the output aliases, read-only: view, reshape,
    transpose, slice, select, unflatten, expand, ..., or an element of split / chunk / unbind), else None."""
    if n.op != "call_function" or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    if n.target is operator.getitem:
        parent = n.args[0]
        return parent if _aliasing_schema(parent, list_return=True) else None
    return n.args[0] if _aliasing_schema(n, list_return=False) or _aliasing_schema(n, list_return=True) else None


def _aliasing_schema(n: fx.Node, list_return: bool) -> bool:
    schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
    if schema is None or not schema.arguments or len(schema.returns) != 1:
        return False
    arg, ret = schema.arguments[0].alias_info, schema.returns[0]
    if arg is None or arg.is_write or ret.alias_info is None or ret.alias_info.is_write:
        return False
    is_list = isinstance(ret.type, torch.ListType)
    return is_list if list_return else (not is_list and bool(ret.alias_info.before_set & arg.before_set))


_MODULE_KEYS = ("nn_module_stack", "source_fn_stack")
#: ops without an alias annotation whose result can still be a view at run time: ``linear`` of a 3-d contiguous input
#: with a bias is ``addmm(b, x.view(B·T, D), wᵀ).view(B, T, N)`` (GPT-2 / nanoGPT's c_attn, Qwen2's biased k/v
#: projections, the biased kv_proj), ``matmul`` / ``einsum`` may return a reshaped or permuted product
_MAY_VIEW = {"linear", "matmul", "einsum", "tensordot", "bilinear"}


def _own_alias(graph: fx.Graph, x: fx.Node, made: dict[fx.Node, fx.Node]) -> fx.Node:
    """``x``, or where ``x`` may be a view at run time (:data:`_MAY_VIEW`), :func:`unsafe_view_of` ``x`` right after
    it in its block: a tensor of its own on the same storage. Made once per ``x`` (``made``)."""
    if x in made:
        return made[x]
    if op_name(x) not in _MAY_VIEW or tensor_val(x) is None:
        return x
    with graph.inserting_before(x.next):  # right after x, in this order
        own = unsafe_view_of(graph, x)
    made[x] = own
    return own


def _slot_args(n: fx.Node) -> list[fx.Node]:
    """The depth slots a ``moda_attn_slots`` call reads: its key slots, then its value slots."""
    return [*n.args[4], *n.args[5]]


def _slots_leave_as_their_own(graph: fx.Graph) -> None:
    """Make every depth slot cross out of its block as a tensor of its own, not a view.

    A slot is typically a view of what its block computed (the attention's V is ``v_proj(x).view(..).transpose(1,
    2)``, an FFN slot a slice of ``kv_proj``'s output), and a block module returning a view makes FSDP2 warn (an
    in-place op on it would skip the pre-backward all-gather). No copy is made: the layout ops between the slot and
    the tensor it views (its base) are given to the readers of the slot (the ``moda_attn_slots`` of later sublayers):
    ops only the slot's readers use lose their module stack, so the block split places them outside the block; ops
    the block itself also reads (its own attention reads its K and V) are copied for the readers. The block then
    returns the base (a tensor of its own), and the readers see the same strided views as before, so values and
    gradients are unchanged (up to the order in which a base's two gradient contributions are summed)."""
    stacks = [n for n in graph.nodes if depth_op_name(n) == "moda_attn_slots"]
    slots = dict.fromkeys(x for n in stacks for x in _slot_args(n))
    made: dict[fx.Node, fx.Node] = {}
    for slot in slots:
        chain, x = [], slot  # the slot, then each tensor the one before views, up to the base (excluded)
        while (p := _viewed(x)) is not None:
            chain.append(x)
            x = p
        base = _own_alias(graph, x, made)
        if not chain:
            if base is not x:
                for n in stacks:
                    if slot in _slot_args(n):
                        n.replace_input_with(slot, base)
            continue
        readers, keep = {n for n in stacks if slot in _slot_args(n)}, 0
        for c in chain:  # the top of the chain that only the slot's readers use moves out as it is
            if not set(c.users) <= readers:
                break
            readers, keep = {c}, keep + 1
        for c in chain[:keep]:
            for k in _MODULE_KEYS:
                c.meta.pop(k, None)
        shared = chain[keep:]
        if not shared:
            if base is not x:
                chain[-1].replace_input_with(x, base)
            continue
        env: dict[fx.Node, fx.Node] = {x: base}
        with graph.inserting_before(shared[0].next):
            for c in reversed(shared):
                env[c] = graph.node_copy(c, lambda a: env.get(a, a))
                for k in _MODULE_KEYS:
                    env[c].meta.pop(k, None)
        if keep:
            chain[keep - 1].replace_input_with(shared[0], env[shared[0]])
        else:
            for n in stacks:
                if slot in _slot_args(n):
                    n.replace_input_with(slot, env[slot])


def _erase_dead(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` (no readers left) and what only it read. ``eliminate_dead_code`` keeps an op tagged
    nondeterministic_seeded (SDPA, dropout: they may draw random numbers), so the replaced attention of every site
    (and, in the eager form, its scores, softmax and dropout) would still run, unread."""
    stack, erased = [node], set()
    while stack:
        n = stack.pop()
        if n in erased or n.users or n.op != "call_function" or _writes(n):
            continue
        stack.extend(n.all_input_nodes)
        graph.erase_node(n)
        erased.add(n)


def _writes(n: fx.Node) -> bool:
    schema = getattr(n.target, "_schema", None)
    return schema is None and n.target is not operator.getitem or bool(schema is not None and schema.is_mutable)


def _refuse_collectives(gm: fx.GraphModule) -> None:
    """MoDA rewrites each attention with whole heads and adds replicated parameters per head (λ, the FFN slots' K/V
    projections): under tensor parallelism with local tensors (torchtitan's ``spmd_types`` backend: the weights are
    plain local shards and the redistributions are traced as collectives) a rank's heads would be paired with other
    heads' slots, silently. A graph holding collective communication is refused, naming where it came from."""
    n = first_collective([gm.graph])
    if n is not None:
        raise ConfigError(
            f"MoDA cannot convert a tensor-parallel model: the captured graph communicates across ranks "
            f"({describe_collective(n)}), and MoDA rewrites each attention with whole "
            "heads and per-head parameters of its own. Train MoDA without tensor parallelism (data parallelism "
            "and FSDP2 work), or use AttnRes, MSAR or mHC, which keep the attention a module of its own and run "
            "under tensor parallelism (docs/training.md#tensor-parallelism)."
        )


def _rewrite_moda(gm: fx.GraphModule, chain: Chain, config: MoDAConfig) -> PassResult:
    _refuse_collectives(gm)
    ed = ChainEditor(gm, chain, config.name)
    graph = ed.graph
    attn = {k: find_attention(ed, b) for k, s in enumerate(chain.sublayers) for b in s.branches if b.kind == "attention"}
    if len(attn) < 2:
        raise ConfigError(f"MoDA needs at least two attention sublayers to add depth slots; this model has {len(attn)}")
    shapes = {(a.hq, a.hk, *a.dims) for a in attn.values()}
    if len(shapes) != 1:
        raise ConfigError(f"MoDA needs one attention shape (Hq, Hk, d, dv) across layers; found {sorted(shapes)}")
    hq, hk, d, dv = shapes.pop()  # dv: the value head dim (MLA's differs from the query/key head dim d)
    kv_width = hk * (d + dv)  # one slot's K and V values per token
    stream = tensor_val(ed.nodes[chain.source])
    if config.ffn_kv and (stream is None or stream.dim() != 3):
        shape = tuple(stream.shape) if stream is not None else "unknown"
        raise ConfigError(
            f"MoDA's FFN slots need a [batch, sequence, hidden] stream to line the kv_proj keys up with the attention's "
            f"tokens; the stream source `{ed.nodes[chain.source].name}` has shape {shape} (flattened from the "
            f"embedding on). Use ffn_kv=False (attention slots only, which read the attention's own [B, H, T, d] K/V)"
        )
    last_reader = max(attn)
    D = chain.hidden_size
    ops = torch.ops.depthrewrite
    slots_k: list[fx.Node] = []
    slots_v: list[fx.Node] = []
    labels: list[str] = []
    changes: list[Change] = []
    raw_sites: list[str] = []
    # the key pipelines, read before anything is rewritten (moda.md §8 Q1: FFN keys go through one of them)
    key_paths: dict[int, tuple[KeyPath | None, str]] = {}
    kps_proj: dict[int, fx.Node] = {}
    # what each attention does to its keys by position (RoPE tables; None: unknown), to compare writer and reader
    memo: dict = {}
    rot_of: dict[str, frozenset | None] = {}
    rot_name: dict[frozenset, str] = {frozenset(): "no positional key ops"}
    for j, a in attn.items():
        kp, why = key_path(ed, a)
        rot_of[f"attn{j}"] = _rotation(gm, kp, memo) if kp is not None else None
        if kp is not None:
            kps_proj[j] = kp.proj
            r = rot_of[f"attn{j}"]
            if r not in rot_name:
                roots = sorted({_root(e).name for e in kp.externals if tensor_val(e) is not None and _positional(gm, e)})
                rot_name[r] = "rotation by " + "/".join(f"`{x}`" for x in roots)
        if config.ffn_keys != "raw":
            key_paths[j] = (kp, why)
    for k, s in enumerate(chain.sublayers):
        a = attn.get(k)
        if a is not None and slots_k:
            name = f"moda_{k}"
            with graph.inserting_before(a.node):
                lam = None
                if config.preserve_init:
                    ed.site_module(name, lambda: _Lambda(hq, ed.dtype, ed.device))
                    lam = ed.get_attr(f"{name}.depth_weight")
                mask = a.mask
                if a.fill is not None:  # masked_fill(scores, m, -inf): keep where m is False
                    mask = graph.call_function(aten.logical_not.default, (a.fill,))
                seed = None
                if a.dropout_p > 0:
                    seed = graph.call_function(aten.randint.low, (0, 2**31 - 1, [1]), {"device": ed.device})
                new = graph.call_function(  # the slots as their writers made them: each kept once for backward
                    ops.moda_attn_slots.default,
                    (a.q, a.k, a.v, mask, list(slots_k), list(slots_v), lam, a.scale, a.is_causal, a.dropout_p, seed,
                     a.softcap),
                )
            inherit_meta(new, a.node, NodeRole("moda_attn", k, config.name))
            a.node.replace_all_uses_with(new)
            _erase_dead(graph, a.node)
            n = len(slots_k)
            flops = 2 * hq * (d + dv) * n  # depth QKᵀ and PV
            changes.append(Change(
                site=k, module=s.module, created=(new.name,), replaced=a.node.name,
                sources=tuple(labels), params=name if config.preserve_init else None,
                detail=f"{a.form}; +{flops:,} FLOPs/token; depth KV {n * kv_width:,} values/token",
                state_elements=n * kv_width,
            ))
        if k >= last_reader:
            continue  # nothing after this sublayer reads a slot
        if a is not None:
            slots_k.append(_this_call_tokens(a.k, a.q))
            slots_v.append(_this_call_tokens(a.v, a.q))
            labels.append(f"attn{k}")
        mlp = [b for b in s.branches if b.kind != "attention"]
        if config.ffn_kv and mlp:
            b = mlp[0]
            src = ed.nodes[b.pre_norm.output] if b.pre_norm is not None else strip_alias(ed.stream(k))
            raw_src = src
            src = ed.canonical(src)  # [B, T, D] where the model flattens the stream (OPT); a new node right after raw_src
            j = _key_site(k, sorted(attn), config.ffn_keys)
            kp, why = key_paths.get(j, (None, "ffn_keys='raw'"))
            anchor = raw_src
            if kp is not None and kp.nodes:
                if any(e not in ed.order for e in kp.externals):
                    kp, why = None, "an input of the key path was created by this rewrite"
                else:
                    anchor = max([raw_src, *kp.externals], key=ed.order.__getitem__)
            if kp is not None and not kp.nodes:
                kp, why = None, "the key path has layout ops only"
                keypath_note = None
            else:
                keypath_note = why
            bias = _has_bias(kps_proj[j]) if j in kps_proj else False
            if anchor is raw_src:
                anchor = src
            name = f"kv_proj_{k}"
            ed.site_module(name, lambda: _KVProj(D, hk, d, bias, ed.dtype, ed.device, dv=dv))
            with graph.inserting_before(anchor.next):  # after the normed input (and the key path's inputs)
                # keys and values as two products with the weight's two row blocks (keys first: one parameter, as
                # saved): each is a tensor of its own, so once the key path has made the keys, the values slot keeps
                # only the values alive (a slice of one [.., Hk·(d + dv)] product would keep the raw keys too)
                w = ed.get_attr(f"{name}.weight")
                bias_w = ed.get_attr(f"{name}.bias") if bias else None
                made, outs = [], []
                for lo, hi, hd in ((0, hk * d, d), (hk * d, kv_width, dv)):
                    wx = graph.call_function(aten.slice.Tensor, (w, 0, lo, hi))
                    bx = graph.call_function(aten.slice.Tensor, (bias_w, 0, lo, hi)) if bias else None
                    part = graph.call_function(aten.linear.default, (src, wx, bx) if bias else (src, wx))
                    made += [wx, *([bx] if bias else []), part]
                    if bias:  # linear of a 3-d input with a bias returns a view of addmm's [B·T, N] product at run
                        # time: alias it as a tensor of its own (no copy), so the slot's base crosses the block as one
                        sizes = sizes_of(graph, src, 2)
                        made += [x for x in sizes if isinstance(x, fx.Node)]
                        part = graph.call_function(aten._unsafe_view.default, (part, [*sizes, hi - lo]))
                        made.append(part)
                    tok = graph.call_function(aten.unflatten.int, (part, -1, [hk, hd]))  # [B, T, Hk, d | dv]
                    made.append(tok)
                    outs.append((part, tok))
                (k_flat, k_tok), (_, v_tok) = outs
                kv = k_flat  # the report names the keys' product
                vf = graph.call_function(aten.transpose.int, (v_tok, 1, 2))
                made.append(vf)
                if kp is None:
                    kf = graph.call_function(aten.transpose.int, (k_tok, 1, 2))
                    made.append(kf)
                else:
                    if kp.layout == "flat":
                        k0 = k_flat
                    elif kp.layout == "bhtd":
                        k0 = graph.call_function(aten.transpose.int, (k_tok, 1, 2))
                    else:
                        k0 = k_tok
                    made.append(k0)
                    env = {kp.start: k0}
                    for n in kp.nodes:  # the attention's own key ops (k-norm, RoPE, ...) on the FFN keys
                        c = graph.node_copy(n, lambda x: env.get(x, x))
                        inherit_meta(c, src, NodeRole("kv_proj", k, config.name), val_from=n)
                        env[n] = c
                    kf = env[kp.end]
            for node in made:  # no value metadata: the normed input's ([B, T, D]) would misstate a slot's shape
                inherit_meta(node, src, NodeRole("kv_proj", k, config.name), copy_val=False)
            slots_k.append(kf)
            slots_v.append(vf)
            labels.append(f"ffn{k}")
            rot_of[f"ffn{k}"] = _rotation(gm, kp, memo)
            if kp is not None:
                keys = f"keys through attn{j}'s key path ({kp.describe()})"
            else:
                keys = f"raw keys ({keypath_note})" if keypath_note else "keys need no key ops (the attention applies none)"
                if keypath_note and config.ffn_keys != "raw":
                    raw_sites.append(f"ffn{k}: {keypath_note}")
            changes.append(Change(
                site=k, module=b.module or module_path_of(src), created=(kv.name, kf.name, vf.name), replaced=None,
                sources=(), params=name,
                detail=f"writes slot ffn{k}: kv_proj {D} -> {f'2·{hk}·{d}' if dv == d else f'{hk}·({d} + {dv})'}"
                f"{' + bias' if bias else ''}; {keys}; +{2 * D * kv_width:,} FLOPs/token",
            ))
    mixed = _rotation_mismatches(changes, rot_of, rot_name)
    graph.eliminate_dead_code()  # the slot readers below are then the only readers left of what only they read
    _slots_leave_as_their_own(graph)
    result = ed.finish(changes)
    n_max = len(slots_k)
    extra = (sum(2 * hq * (d + dv) * len(c.sources) for c in changes if c.sources)
             + sum(2 * D * kv_width for c in changes if not c.sources))
    base = 2 * sum(p.numel() for n, p in gm.named_parameters() if not n.startswith("depthrewrite."))
    notes = (
        f"extra FLOPs per token: {extra:,} (+{100 * extra / max(1, base):.2f}% of the original's ~2·params = {base:,}, "
        "attention scores excluded)",
        (f"depth slots are token-major [B, T, n, Hk={hk}, d={d}]" if dv == d else
         f"depth slots are token-major [B, T, n, Hk={hk}, d={d}] (keys) and [B, T, n, Hk={hk}, dv={dv}] (values: the "
         "attention's value head dim differs from its query/key head dim, as in MLA)")
        + " and transient (same-token only): the persistent KV cache is unchanged",
    )
    if raw_sites:
        notes += ("FFN-slot keys stored raw (no k-norm/RoPE: depth scores of these slots depend on position): "
                  + "; ".join(raw_sites),)
    if mixed:
        notes += (mixed,)
    if config.ffn_kv and not any(lab.startswith("ffn") for lab in labels):
        notes += ("no FFN slots were written although ffn_kv=True: the chain has no MLP sublayer or MLP branch before the "
                  "last attention (an MLP inside the attention branch, as in Falcon's parallel attention + MLP read as "
                  "one branch, is not a separate writer); only attention slots are mixed",)
    return PassResult(result.graph_module, result.changes, notes, state=(n_max * kv_width, "transient depth KV"))


def _rotation_mismatches(changes: list[Change], rot_of: dict, rot_name: dict, limit: int = 12) -> str | None:
    """The report note for slots whose keys are rotated differently from their readers' queries (spec §8 Q1 caveat:
    Gemma3 local/global RoPE bases, interleaved NoPE layers): the relative rotation stays in the depth logit."""
    pairs: dict[str, list[str]] = {}
    for c in changes:
        reader = f"attn{c.site}"
        rr = rot_of.get(reader)
        for src in c.sources:
            rs = rot_of.get(src)
            if rr is not None and rs is not None and rr != rs:
                pairs.setdefault(src, []).append(reader)
    if not pairs:
        return None
    def name(label):
        return rot_name.get(rot_of[label], "another rotation")
    items = [f"{src} ({name(src)}) -> " + ", ".join(f"{r} ({name(r)})" for r in readers) for src, readers in pairs.items()]
    more = f"; ... ({len(items) - limit} more slots)" if len(items) > limit else ""
    return ("depth scores depend on position where a slot's keys and its reader's queries are rotated differently "
            "(layers with different RoPE tables or no RoPE; spec §8 Q1 caveat): the relative rotation between writer and "
            "reader stays in the depth logit, so a slot does not score as position-free content. Slots are kept as fed "
            "to attention (post-RoPE); no depth_rope='unrotated' variant is implemented. Slot -> readers: "
            + "; ".join(items[:limit]) + more)



# ---------------------------------------------------------------------------------------------------------------------
# stage hooks (Scheme record): MoDA keeps the residual stream; a cut crosses h and the depth slots still to be read


def _stage_anchor(graph: fx.Graph, report, j: int) -> fx.Node | None:
    """A stage beginning with sublayer j begins at that sublayer's first pre-norm reader of h_j."""
    nodes = {n.name: n for n in graph.nodes}
    names: set[str] = set()
    for b in report.chain.sublayers[j].branches:
        names |= set(b.pre_norm.readers) if b.pre_norm is not None else set(b.nodes)
    found = [nodes[x] for x in names if x in nodes]
    if not found:
        return None
    order = {n: i for i, n in enumerate(graph.nodes)}
    return min(found, key=order.__getitem__)


def _boundary_labels(graph: fx.Graph, report, j: int) -> dict[fx.Node, str]:
    """The depth slots (named by the sublayer that wrote them) and the residual stream."""
    sites = {s.site: s for s in report.sites}
    labels: dict[fx.Node, str] = {}
    for n in graph.nodes:
        if depth_op_name(n) != "moda_attn_slots":
            continue
        r = role_of(n)
        site = sites.get(r.site) if r is not None else None
        names = site.sources if site is not None else ()
        for kv, slots in (("K", n.args[4]), ("V", n.args[5])):
            for i, src in enumerate(slots):
                labels.setdefault(src, f"slot {kv} {names[i] if i < len(names) else i}")
    chain = report.chain
    stream = {chain.source} | {s.residual_add for s in chain.sublayers}
    for n in graph.nodes:
        base = n
        while base.op == "call_function" and base.args and op_name(base) in ("to", "_to_copy", "clone", "alias"):
            base = base.args[0]
        if base.name in stream:
            labels.setdefault(n, "h (residual stream)")
    return labels


def _state_at(report, j: int) -> DepthState:
    """h plus every slot written before sublayer j that an attention at or after j reads."""
    d = report.chain.hidden_size
    site = next((x for x in report.sites if x.sources and isinstance(x.site, int) and x.site >= j and x.state_elements), None)
    if site is None:
        return DepthState(d, f"d = {d}")
    per_slot = site.state_elements // len(site.sources)
    n_slots = sum(1 for lab in site.sources if int(re.sub(r"\D", "", lab) or 0) < j)
    return DepthState(d + n_slots * per_slot, f"d + slots·2·Hk·dh = {d} + {n_slots}·{per_slot}")


SCHEME = register(Scheme(
    name=MoDAConfig.name,
    title="MoDA",
    config=MoDAConfig,
    handler=_rewrite_moda,
    ops=("moda_attn_slots",),
    state_args={"moda_attn_slots": (4, 5)},
    doc="docs/moda.md",
    exact={"preserve_init": True},
    # as in the paper (lambda = 1): depth logits compete in the softmax from step 0 (docs/moda.md)
    variants=(
        SchemeVariant("moda", "MoDA (paper, λ≡1)", init_tol=None, note="the paper's λ≡1; preserve_init=True is exact"),
        # the function-preserving mode (a learned λ per site and head, 0 at init): bench.quality trains both
        SchemeVariant("moda-exact", "MoDA (preserve_init, λ=0 at init)", {"preserve_init": True}, demo=False),
    ),
    stage_anchor=_stage_anchor,
    boundary_labels=_boundary_labels,
    state_at=_state_at,
))
