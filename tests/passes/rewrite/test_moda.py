"""MoDA specifics: the op against a naive joint softmax, RoPE cancellation, preserve_init and λ's gradient, the
independent reference, attention forms (SDPA with and without GQA, eager, soft-capped eager, ViT), causality."""

from __future__ import annotations

import math

import pytest
import torch

import depthrewrite as dr
from depthrewrite import AttentionPatternError, ConfigError
from depthrewrite.kernels.moda import moda_attn, moda_attn_slots, moda_attn_slots_stack, moda_slots_ref

from ...conftest import build_zoo_model
from .helpers import INIT_RTOL, assert_matches_reference, inputs_for, logits, rel_err
from .reference_models import Decoder, MoDADecoder


def naive_joint(q, k, v, mask, Kd, Vd, lam, scale, causal, softcap=0.0):
    """Concatenated logits, one softmax (moda.md §2), query head h -> KV head h // G, written with loops."""
    B, Hq, T, d = q.shape
    G = Hq // k.shape[1]
    out = torch.empty(B, Hq, T, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            g = h // G
            for t in range(T):
                s_seq = (k[b, g] @ q[b, h, t]) * scale
                if softcap:
                    s_seq = softcap * torch.tanh(s_seq / softcap)
                if causal:
                    s_seq = s_seq.masked_fill(torch.arange(T) > t, -math.inf)
                if mask is not None:
                    s_seq = s_seq.masked_fill(~mask[t], -math.inf)
                s_dep = (Kd[b, t, :, g] @ q[b, h, t]) * scale
                if softcap:
                    s_dep = softcap * torch.tanh(s_dep / softcap)
                # λ >= 0 with a straight-through clamp (moda.md §8 Q8): a negative λ still gets its gradient
                w = 1.0 if lam is None else lam[h] + (lam[h].clamp_min(0) - lam[h]).detach()
                e = torch.cat([torch.exp(s_seq), w * torch.exp(s_dep)])
                p = e / e.sum()
                out[b, h, t] = p[:T] @ v[b, g] + p[T:] @ Vd[b, t, :, g]
    return out


@pytest.mark.parametrize(
    "Hq, Hk, T, n, causal, with_mask, lam, softcap, dv",
    [
        pytest.param(2, 2, 5, 1, True, False, False, 0.0, 3, id="mha-one-slot"),  # G=1, n=1
        pytest.param(4, 2, 7, 3, True, False, True, 0.0, 3, id="gqa2-lambda"),  # odd T, λ
        pytest.param(8, 2, 3, 4, False, True, False, 0.0, 3, id="gqa4-noncausal-mask"),  # ViT-like + padding mask
        pytest.param(8, 1, 4, 2, True, False, False, 5.0, 3, id="mqa-softcap"),  # G=8, Gemma2 soft-capping
        pytest.param(4, 2, 5, 2, True, True, True, 0.0, 2, id="mla-value-dim"),  # MLA: value head dim 2 != 3
    ],
)
def test_op_matches_naive_joint_softmax(Hq, Hk, T, n, causal, with_mask, lam, softcap, dv):
    g = torch.Generator().manual_seed(T)
    d, B = 3, 2
    r = lambda *s: torch.randn(*s, dtype=torch.float64, generator=g, requires_grad=True)  # noqa: E731
    q, k, v = r(B, Hq, T, d), r(B, Hk, T, d), r(B, Hk, T, dv)
    Kd, Vd = r(B, T, n, Hk, d), r(B, T, n, Hk, dv)
    lam_t = (torch.rand(Hq, dtype=torch.float64, generator=g) * 2 - 0.5).requires_grad_() if lam else None
    mask = torch.rand(T, T, generator=g) > 0.3 if with_mask else None
    if mask is not None:
        mask[:, 0] = True  # no fully masked row
    out = moda_attn(q, k, v, mask, Kd, Vd, lam_t, 0.7, causal, 0.0, None, softcap)
    ref = naive_joint(q, k, v, mask, Kd, Vd, lam_t, 0.7, causal, softcap)
    torch.testing.assert_close(out, ref)
    leaves = [t for t in (q, k, v, Kd, Vd, lam_t) if t is not None]
    g1 = torch.autograd.grad(out.square().sum(), leaves)
    g2 = torch.autograd.grad(ref.square().sum(), leaves)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)
    torch.library.opcheck(moda_attn, (q, k, v, mask, Kd, Vd, lam_t, 0.7, causal, 0.0, None, softcap))


def test_slots_are_token_major():
    ks = [torch.randn(2, 3, 5, 4) for _ in range(3)]  # [B, Hk, T, d]
    s = moda_slots_ref(ks)
    assert s.shape == (2, 5, 3, 3, 4) and s.is_contiguous()
    assert torch.equal(s[1, 4, 2], ks[2][1, :, 4])  # token 4's slot 2 is contiguous in memory


@pytest.mark.parametrize("lam", [False, True])
def test_attn_over_slot_tensors_equals_attn_over_their_stack(lam):
    """moda_attn_slots (what the rewrite inserts: the slot tensors as written, any strides) computes moda_attn of
    their token-major stack, forward and backward, and keeps the slot tensors themselves for backward, not a stack."""
    g = torch.Generator().manual_seed(3)
    B, Hq, Hk, T, d, n = 2, 4, 2, 5, 8, 3
    r = lambda *s: torch.randn(*s, dtype=torch.float64, generator=g, requires_grad=True)  # noqa: E731
    q, k, v = r(B, Hq, T, d), r(B, Hk, T, d), r(B, Hk, T, d)
    ks = [r(B, Hk, T, d) for _ in range(n - 1)] + [r(B, T, Hk, d)]  # the last one transposed, as a V view is
    vs = [r(B, Hk, T, d) for _ in range(n)]
    slots_k = [*ks[:-1], ks[-1].transpose(1, 2)]
    lam_t = (torch.rand(Hq, dtype=torch.float64, generator=g) + 0.5).requires_grad_() if lam else None
    stacked = []

    def pack(t):
        stacked.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = moda_attn_slots(q, k, v, None, slots_k, vs, lam_t, 0.6, True, 0.0, None, 0.0)
    assert (B, T, n, Hk, d) not in stacked  # no stacked copy is kept for backward
    ref = moda_attn(q, k, v, None, moda_slots_ref(slots_k), moda_slots_ref(vs), lam_t, 0.6, True, 0.0, None, 0.0)
    torch.testing.assert_close(out, ref)
    leaves = [t for t in (q, k, v, *ks, *vs, lam_t) if t is not None]
    g1 = torch.autograd.grad(out.square().sum(), leaves)
    g2 = torch.autograd.grad(ref.square().sum(), leaves)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)
    torch.library.opcheck(moda_attn_slots, (q, k, v, None, slots_k, vs, lam_t, 0.6, True, 0.0, None, 0.0))


@pytest.mark.parametrize("extra", [0, 2])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_attn_over_stacked_slots_is_attn_over_its_rows(extra, backend):
    """moda_attn_slots_stack (what a block program reads: the earlier slots as rows of the converted model's buffer,
    keys and values rows of one [n, 2, ...] tensor, then the block's own slots) is moda_attn_slots of the rows and
    extra slots: the same output bits, the same gradients (each row's gradient the gradient of that slot)."""
    from depthrewrite.kernels.dispatch import kernel_backend

    g = torch.Generator().manual_seed(5)
    B, Hq, Hk, T, d, n = 1, 4, 2, 5, 8, 3
    r = lambda *s: torch.randn(*s, generator=g, requires_grad=True)  # noqa: E731
    q, k, v = r(B, Hq, T, d), r(B, Hk, T, d), r(B, Hk, T, d)
    buf = r(n, 2, B, Hk, T, d)  # the buffer's layout: per row a key slot and a value slot
    ek, ev = [r(B, Hk, T, d) for _ in range(extra)], [r(B, T, Hk, d).transpose(1, 2) for _ in range(extra)]
    lam = (torch.rand(Hq, generator=g) + 0.5).requires_grad_()
    args = (0.6, True, 0.0, None, 0.0)
    with kernel_backend(backend):
        out = moda_attn_slots_stack(q, k, v, None, buf[:, 0], buf[:, 1], ek, ev, lam, *args)
        ref = moda_attn_slots(q, k, v, None, [*buf[:, 0].unbind(0), *ek], [*buf[:, 1].unbind(0), *ev], lam, *args)
        assert torch.equal(out, ref)
        leaves = [q, k, v, buf, *ek, *ev, lam]
        go = torch.randn(out.shape, generator=g)
        for a, b in zip(torch.autograd.grad(out, leaves, go), torch.autograd.grad(ref, leaves, go)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.library.opcheck(moda_attn_slots_stack, (q, k, v, None, buf[:, 0], buf[:, 1], ek, ev, lam, *args))


def test_rope_cancels_for_same_position_slots():
    """(R_t q)·(R_t k) = q·k: slots taken after RoPE give position-free depth logits (moda.md §8 Q1)."""
    d, t = 8, 13
    q, k = torch.randn(d, dtype=torch.float64), torch.randn(d, dtype=torch.float64)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.cat([t * inv, t * inv])
    rot = lambda x: x * torch.cos(ang) + torch.cat([-x[d // 2 :], x[: d // 2]]) * torch.sin(ang)  # noqa: E731
    torch.testing.assert_close(rot(q) @ rot(k), q @ k)


FORMS = [
    pytest.param("hf:llama", {}, "sdpa", id="sdpa-gqa"),
    pytest.param("hf:gpt2", {}, "sdpa", id="sdpa-mha-dropout"),
    pytest.param("hf:llama", {"attn_implementation": "eager"}, "eager", id="eager-gqa"),
    pytest.param("hf:gemma2", {}, "eager", id="eager-softcap"),
    pytest.param("timm:vit_tiny_patch16_224", {}, "sdpa", id="vit-noncausal"),
    pytest.param("nanogpt", {}, "sdpa", id="nanogpt-is_causal"),
]


def _build(name, extra):
    if extra:
        from depthrewrite.demo.zoo import hf_model

        from ...conftest import LAYERS

        return hf_model(name.split(":")[1], layers=LAYERS, **extra)
    return build_zoo_model(name)


@pytest.mark.parametrize("name, extra, form", FORMS)
def test_attention_forms_convert(name, extra, form):
    model = _build(name, extra).eval()
    x = inputs_for(name, model)
    exact = dr.convert(model, "moda", preserve_init=True, inplace=False).eval()
    paper = dr.convert(model, "moda", inplace=False).eval()
    with torch.no_grad():
        ref = logits(model(*x))
        assert rel_err(logits(exact(*x)), ref) <= INIT_RTOL  # λ = 0: the original model
        out = logits(paper(*x))
    assert torch.isfinite(out).all() and rel_err(out, ref) > 1e-3  # λ ≡ 1: MoDA changes the function (spec §8 Q8)
    rep = paper.report()
    readers = [s for s in rep.sites if s.sources]
    assert readers and all(form in s.detail for s in readers)
    assert [len(s.sources) for s in readers] == sorted(len(s.sources) for s in readers)


def test_lambda_gets_a_gradient_at_init():
    conv = dr.convert(build_zoo_model("hf:llama"), "moda", preserve_init=True)
    ids = torch.randint(0, 256, (2, 8))
    conv(ids).logits.square().mean().backward()
    lam = [p for n, p in conv.named_parameters() if n.endswith("depth_weight")]
    assert lam and all(p.grad is not None and p.grad.abs().sum() > 0 for p in lam)
    assert all(torch.equal(p, torch.zeros_like(p)) for p in lam)


def _reference_pair(attn="plain", kv_heads=None, preserve_init=True, layers=3, seed=0):
    """A vanilla reference decoder converted by depthrewrite, and its hand-written MoDA twin with the same weights
    (random kv_proj weights/biases and λ copied into both)."""
    torch.manual_seed(seed)
    vanilla = Decoder(layers=layers, attn=attn, kv_heads=kv_heads)
    ref = MoDADecoder(layers=layers, attn=attn, kv_heads=kv_heads, lam=preserve_init)
    ref.load_state_dict(vanilla.state_dict(), strict=False)
    idx = torch.randint(0, 64, (2, 7))
    conv = dr.convert(vanilla, "moda", preserve_init=preserve_init, example_inputs=(idx,), inplace=False)
    g = torch.Generator().manual_seed(1)
    box = conv.depthrewrite
    for j, p in ref.kv_proj.items():
        v = torch.randn(p.shape, generator=g) * 0.2
        p.data.copy_(v)
        getattr(box, f"kv_proj_{j}").weight.data.copy_(v)
    for j, p in (ref.kv_bias or {}).items():
        v = torch.randn(p.shape, generator=g) * 0.2
        p.data.copy_(v)
        getattr(box, f"kv_proj_{j}").bias.data.copy_(v)
    for j, p in (ref.lam or {}).items():
        v = torch.rand(p.shape, generator=g) + 0.5
        p.data.copy_(v)
        getattr(box, f"moda_{j}").depth_weight.data.copy_(v)
    return vanilla, ref, conv, idx


def _conv_name(name: str) -> str:
    if name.startswith("kv_proj."):
        return f"depthrewrite.kv_proj_{name.split('.')[1]}.weight"
    if name.startswith("kv_bias."):
        return f"depthrewrite.kv_proj_{name.split('.')[1]}.bias"
    if name.startswith("lam."):
        return f"depthrewrite.moda_{name.split('.')[1]}.depth_weight"
    return name


def test_independent_reference():
    _, ref, conv, idx = _reference_pair()
    box = conv.depthrewrite
    assert sorted(n for n, _ in box.named_children()) == ["kv_proj_1", "kv_proj_3", "moda_2", "moda_4"]
    assert_matches_reference(ref, conv, idx, _conv_name)


@pytest.mark.parametrize("preserve_init", [False, True], ids=["lambda1", "lambda-random"])
@pytest.mark.parametrize("attn, kv_heads", [("llama", 2), ("qwen3", 2), ("qwen2", 2), ("llama", 4)],
                         ids=["llama-gqa", "qwen3-knorm", "qwen2-bias", "llama-mha"])
def test_independent_reference_ffn_keys_rotated(attn, kv_heads, preserve_init):
    """moda.md §2, §8 Q1/Q2: FFN-slot keys go through the block attention's k-norm and RoPE; with λ ≡ 1 (the paper)
    and with random λ, outputs and every gradient match the hand-written reference."""
    _, ref, conv, idx = _reference_pair(attn, kv_heads, preserve_init)
    assert_matches_reference(ref, conv, idx, _conv_name)
    writers = [s for s in conv.report().sites if not s.sources]
    assert writers and all("keys through attn" in s.detail for s in writers)


@pytest.mark.parametrize("preserve_init", [False, True], ids=["lambda1", "lambda-random"])
def test_independent_reference_textbook_attention(preserve_init):
    """minGPT's eager attention (masked_fill with a causal buffer) is rewritten and matches the reference."""
    _, ref, conv, idx = _reference_pair("mingpt", preserve_init=preserve_init)
    assert_matches_reference(ref, conv, idx, _conv_name)
    readers = [s for s in conv.report().sites if s.sources]
    assert readers and all("eager" in s.detail for s in readers)


def test_mingpt_textbook_attention():
    """nanogpt(flash=False): preserve_init is the original model; λ ≡ 1 equals the SDPA (flash) twin converted with
    the same weights, so masked_fill with the causal buffer is read as the causal mask."""
    eager = dr.testing.nanogpt(n_layer=3, flash=False).eval()
    flash = dr.testing.nanogpt(n_layer=3).eval()
    flash.load_state_dict(eager.state_dict(), strict=False)
    ids = torch.randint(0, 256, (2, 11))
    exact = dr.convert(eager, "moda", preserve_init=True, inplace=False).eval()
    a, b = dr.convert(eager, "moda", inplace=False).eval(), dr.convert(flash, "moda", inplace=False).eval()
    b.depthrewrite.load_state_dict(a.depthrewrite.state_dict())
    with torch.no_grad():
        ref = eager(ids)
        assert rel_err(exact(ids), ref) <= INIT_RTOL
        out = a(ids)
        assert rel_err(out, ref) > 1e-3
        torch.testing.assert_close(out, b(ids), rtol=1e-5, atol=1e-5)
    attn = [n for n in a.graph.nodes if n.target is torch.ops.depthrewrite.moda_attn_slots.default]
    assert attn and all(n.args[3] is None and n.args[8] is True for n in attn)  # no mask tensor: is_causal


def test_preserve_init_with_rotated_ffn_keys():
    vanilla, _, conv, idx = _reference_pair("qwen3", 2, preserve_init=True)
    for p in conv.depthrewrite.parameters():  # λ back to 0, random kv_proj stays
        if p.dim() == 1 and p.shape[0] == 4:
            p.data.zero_()
    with torch.no_grad():
        assert rel_err(conv(idx), vanilla(idx)) <= INIT_RTOL


def _moda_inputs(conv, *args):
    """(q, Kd) of every MoDA attention of a converted model, recorded while it runs (Kd: its key slots stacked
    token-major, [B, T, n, Hk, d])."""
    seen = []

    class Rec(torch.fx.Interpreter):
        def call_function(self, target, a, kw):
            if target is torch.ops.depthrewrite.moda_attn_slots.default:
                seen.append((a[0], moda_slots_ref(a[4])))
            return super().call_function(target, a, kw)

    gm = conv.graph_module()
    with torch.no_grad():
        Rec(gm).run(*args)
    return seen


@pytest.mark.parametrize("name", ["hf:llama", "hf:qwen3", "hf:qwen2", "hf:olmo2", "hf:gpt_neox", "hf:phi"])
def test_ffn_slot_depth_scores_are_position_free(name):
    """With one token repeated, everything before the first MoDA site is the same at every position up to RoPE, so
    q·k of a slot written with the reading attention's rotation (moda.md §8 Q1) is the same at every position.
    Raw FFN keys (no RoPE, no k-norm) give (R_t q)·k, which varies with t."""
    model = build_zoo_model(name).eval()
    conv = dr.convert(model, "moda", inplace=False).eval()
    ids = torch.full((1, 12), 5, dtype=torch.long)
    q, Kd = _moda_inputs(conv, ids)[0]  # the first reading site: slots attn0, ffn1
    G = q.shape[1] // Kd.shape[3]
    s = torch.einsum("bhtd,bthd->bht", q, Kd[:, :, 1].repeat_interleave(G, 2))  # the FFN slot's depth score
    s_attn = torch.einsum("bhtd,bthd->bht", q, Kd[:, :, 0].repeat_interleave(G, 2))
    torch.testing.assert_close(s_attn, s_attn[..., :1].expand_as(s_attn), rtol=1e-4, atol=1e-5)  # the control
    assert s.abs().max() > 1e-3
    torch.testing.assert_close(s, s[..., :1].expand_as(s), rtol=1e-4, atol=1e-5)


def test_ffn_key_rotation_equals_the_attention_key_rotation():
    """Feed the attention's own raw keys through kv_proj (kv_proj := [k_proj; v_proj]): the FFN slot then equals the
    attention slot of the same block exactly — same k-norm, same rotation at the same position."""
    model = build_zoo_model("hf:qwen3").eval()
    conv = dr.convert(model, "moda", preserve_init=True, inplace=False).eval()
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        conv.depthrewrite.kv_proj_1.weight.copy_(torch.cat([attn.k_proj.weight, attn.v_proj.weight]))
    # the FFN slot reads the MLP's normed input, the attention slot the attention's: make both norms read the same
    # stream by zeroing the attention output (o_proj = 0) and giving both norms the same weight
    lay = model.model.layers[0]
    with torch.no_grad():
        conv.get_parameter("model.layers.0.self_attn.o_proj.weight").zero_()
        conv.get_parameter("model.layers.0.post_attention_layernorm.weight").copy_(lay.input_layernorm.weight)
    ids = torch.randint(0, 64, (2, 9))
    _, Kd = _moda_inputs(conv, ids)[0]
    torch.testing.assert_close(Kd[:, :, 1], Kd[:, :, 0], rtol=1e-5, atol=1e-6)


def test_ffn_keys_option():
    m = build_zoo_model("hf:qwen3")
    raw = dr.convert(m, "moda", ffn_keys="raw", inplace=False).report()
    w = next(s for s in raw.sites if not s.sources)
    assert "raw keys (ffn_keys='raw')" in w.detail
    nxt = dr.convert(m, "moda", ffn_keys="next", inplace=False).report()
    assert "keys through attn2's key path" in next(s for s in nxt.sites if not s.sources).detail
    with pytest.raises(ConfigError, match="ffn_keys"):
        dr.MoDAConfig(ffn_keys="rope")


@pytest.mark.parametrize("name", ["hf:llama", "hf:qwen3"])
def test_ffn_slot_nodes_carry_no_borrowed_value_metadata(name):
    """The nodes that make the FFN slots (kv_proj's slices, unflatten, transposes) have no traced value of their own;
    they once kept the normed input's ``tensor_meta`` ([B, T, D] on a [B, Hk, T, d] slot) after ``val`` was dropped.
    Where a kv_proj node carries value metadata, it is its own: ``tensor_meta`` and ``val`` agree."""
    from depthrewrite.passes.meta import role_of

    g = dr.convert(build_zoo_model(name), "moda").graph_module().graph
    nodes = [n for n in g.nodes if (r := role_of(n)) is not None and r.role == "kv_proj"]
    assert nodes
    for n in nodes:
        tm, v = n.meta.get("tensor_meta"), n.meta.get("val", n.meta.get("example_value"))
        assert (tm is None) == (v is None), n.name
        if tm is not None:
            assert tuple(tm.shape) == tuple(v.shape), n.name


def test_kv_proj_bias_follows_the_qkv_projections():
    assert dr.convert(build_zoo_model("hf:qwen2"), "moda").depthrewrite.kv_proj_1.bias.shape == (2 * 2 * 16,)
    assert not hasattr(dr.convert(build_zoo_model("hf:llama"), "moda").depthrewrite.kv_proj_1, "bias")


@pytest.mark.parametrize("name", ["hf:llama", "hf:qwen3", "hf:gpt2", "hf:phi", "hf:mixtral", "hf:olmo2", "nanogpt"])
def test_causality(name):
    model = build_zoo_model(name).eval()
    conv = dr.convert(model, "moda", inplace=False).eval()
    (ids,) = inputs_for(name, model, seq=10)
    ids2 = ids.clone()
    ids2[:, 6] = (ids2[:, 6] + 1) % 64
    with torch.no_grad():
        a, b = logits(conv(ids)), logits(conv(ids2))
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=1e-5)


def test_report_per_site():
    rep = dr.convert(build_zoo_model("hf:llama"), "moda").report()  # 2 blocks: attn0, mlp1, attn2, mlp3
    text = str(rep)
    assert "MoDA, attention + FFN kv_proj slots" in text and "transient depth KV per token" in text
    assert "extra FLOPs per token: " in text and "% of the original" in text
    reader = next(s for s in rep.sites if s.sources)
    assert reader.sources == ("attn0", "ffn1") and "+512 FLOPs/token" in reader.detail  # 4·Hq·d·n = 4·4·16·2
    writer = next(s for s in rep.sites if not s.sources)
    hk, d = 2, 16  # the zoo Llama: 4 query heads, 2 KV heads of dim 16
    assert writer.params == 2 * hk * d * 64 and f"kv_proj 64 -> 2·{hk}·{d}" in writer.detail
    assert rep.state_elements == 2 * 2 * hk * d and rep.new_params == writer.params


def test_attention_only_variant():
    rep = dr.convert(build_zoo_model("hf:llama"), "moda", ffn_kv=False).report()
    assert rep.new_params == 0 and [s.sources for s in rep.sites] == [("attn0",)]


class SigmoidAttention(torch.nn.Module):
    """Attention without softmax or SDPA: MoDA cannot join its softmax."""

    def __init__(self, vocab=32, d=16, layers=2):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.n1 = torch.nn.ModuleList([torch.nn.LayerNorm(d) for _ in range(layers)])
        self.qk = torch.nn.ModuleList([torch.nn.Linear(d, 2 * d) for _ in range(layers)])
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, idx):
        x = self.emb(idx)
        for n1, qk in zip(self.n1, self.qk):
            q, k = qk(n1(x)).chunk(2, -1)
            x = x + torch.sigmoid(q @ k.transpose(-1, -2)) @ k
        return self.norm(x)


def test_unrecognised_attention_is_a_clear_error():
    with pytest.raises(AttentionPatternError, match="cannot be rewritten by MoDA") as ei:
        dr.convert(SigmoidAttention(), "moda", example_inputs=(torch.randint(0, 32, (2, 5)),))
    assert ei.value.node and f"`{ei.value.node}`" in str(ei.value)


class TemperatureAttention(torch.nn.Module):
    """Textbook attention with a learned temperature between the scores and the softmax: not a form MoDA knows."""

    def __init__(self, vocab=32, d=16, layers=2, heads=2):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.n1 = torch.nn.ModuleList([torch.nn.LayerNorm(d) for _ in range(layers)])
        self.qkv = torch.nn.ModuleList([torch.nn.Linear(d, 3 * d) for _ in range(layers)])
        self.temperature = torch.nn.Parameter(torch.ones(()))
        self.norm = torch.nn.LayerNorm(d)
        self.heads = heads

    def forward(self, idx):
        x = self.emb(idx)
        B, T, D = x.shape
        for n1, qkv in zip(self.n1, self.qkv):
            q, k, v = qkv(n1(x)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
            att = (q @ k.transpose(-2, -1)) * self.temperature
            att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
            y = torch.softmax(att, dim=-1) @ v
            x = x + y.transpose(1, 2).reshape(B, T, D)
        return self.norm(x)


def test_refusal_names_the_node_and_the_expected_form():
    with pytest.raises(AttentionPatternError) as ei:
        dr.convert(TemperatureAttention(), "moda", example_inputs=(torch.randint(0, 32, (2, 5)),))
    msg = str(ei.value)
    assert ei.value.node.startswith("mul") and f"`{ei.value.node}` (aten.mul.Tensor) does not fit" in msg
    assert "only a constant scale" in msg and "masked_fill(mask, -inf)" in msg and "softmax(dim=-1)" in msg
    assert "attn_implementation" not in msg and "scaled_dot_product_attention" in msg  # not an HF model


def test_refusal_of_an_hf_model_suggests_attn_implementation():
    from depthrewrite.demo.zoo import hf_model

    from ...conftest import LAYERS

    model = hf_model("llama", layers=LAYERS, attn_implementation="eager")
    import transformers.models.llama.modeling_llama as ml

    orig = ml.eager_attention_forward

    def odd(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        w = torch.matmul(query, ml.repeat_kv(key, module.num_key_value_groups).transpose(2, 3)) * scaling
        w = torch.softmax(w, dim=-2)  # over the queries: not attention MoDA can join
        return torch.matmul(w, ml.repeat_kv(value, module.num_key_value_groups)).transpose(1, 2).contiguous(), w

    ml.eager_attention_forward = odd
    try:
        with pytest.raises(AttentionPatternError, match="softmax over the last dimension") as ei:
            dr.convert(model, "moda", example_inputs=(torch.randint(0, 64, (2, 5)),), inplace=False)
    finally:
        ml.eager_attention_forward = orig
    assert "attn_implementation='sdpa' (or 'eager')" in str(ei.value)


def test_masked_fill_with_a_data_mask_is_a_sequence_mask():
    """A masked_fill whose mask is not a causal buffer (here computed from the input) becomes the op's boolean
    sequence mask: preserve_init still reproduces the model exactly."""

    class PadMasked(TemperatureAttention):
        def forward(self, idx):
            x = self.emb(idx)
            B, T, D = x.shape
            pad = (idx == 0)[:, None, None, :] | torch.ones(T, T, dtype=torch.bool).triu(1)
            for n1, qkv in zip(self.n1, self.qkv):
                q, k, v = qkv(n1(x)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
                att = (q @ k.transpose(-2, -1)) / 3.0
                att = att.masked_fill(pad, float("-inf"))
                y = torch.softmax(att, dim=-1) @ v
                x = x + y.transpose(1, 2).reshape(B, T, D)
            return self.norm(x)

    torch.manual_seed(0)
    model = PadMasked().eval()
    idx = torch.randint(1, 32, (2, 6))
    idx[0, 2] = 0
    conv = dr.convert(model, "moda", preserve_init=True, example_inputs=(idx,), inplace=False).eval()
    with torch.no_grad():
        assert rel_err(conv(idx), model(idx)) <= INIT_RTOL
    attn = [n for n in conv.graph.nodes if n.target is torch.ops.depthrewrite.moda_attn_slots.default]
    assert attn and all(n.args[3] is not None and n.args[8] is False for n in attn)


def test_needs_two_attention_sublayers():
    with pytest.raises(ConfigError, match="at least two attention"):
        dr.convert(dr.testing.nanogpt(n_layer=1), "moda")


def test_a_learned_additive_mask_gets_its_gradient():
    """Relative position biases arrive as an additive attention mask; they must keep training."""
    q, k, v = torch.randn(1, 2, 4, 3), torch.randn(1, 2, 4, 3), torch.randn(1, 2, 4, 3)
    bias = torch.zeros(4, 4, requires_grad=True)
    Kd, Vd = torch.randn(1, 4, 1, 2, 3), torch.randn(1, 4, 1, 2, 3)
    moda_attn(q, k, v, bias, Kd, Vd, None, 0.5, False, 0.0, None, 0.0).sum().backward()
    assert bias.grad is not None and bias.grad.abs().sum() > 0


class GQAEnable(torch.nn.Module):
    """A decoder whose attention passes Hk-head K/V to SDPA with enable_gqa=True (no repeat_kv in the graph)."""

    def __init__(self, vocab=64, d=32, layers=2, hq=4, hk=2):
        super().__init__()
        self.hq, self.hk, self.hd = hq, hk, d // hq
        self.emb = torch.nn.Embedding(vocab, d)
        self.n1 = torch.nn.ModuleList([torch.nn.RMSNorm(d) for _ in range(layers)])
        self.n2 = torch.nn.ModuleList([torch.nn.RMSNorm(d) for _ in range(layers)])
        self.q = torch.nn.ModuleList([torch.nn.Linear(d, d, bias=False) for _ in range(layers)])
        self.kv = torch.nn.ModuleList([torch.nn.Linear(d, 2 * hk * self.hd, bias=False) for _ in range(layers)])
        self.o = torch.nn.ModuleList([torch.nn.Linear(d, d, bias=False) for _ in range(layers)])
        self.mlp = torch.nn.ModuleList([torch.nn.Linear(d, d) for _ in range(layers)])
        self.norm = torch.nn.RMSNorm(d)

    def forward(self, idx):
        x = self.emb(idx)
        B, T, D = x.shape
        for i in range(len(self.q)):
            u = self.n1[i](x)
            q = self.q[i](u).view(B, T, self.hq, self.hd).transpose(1, 2)
            k, v = self.kv[i](u).view(B, T, 2, self.hk, self.hd).permute(2, 0, 3, 1, 4)
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self.o[i](y.transpose(1, 2).reshape(B, T, D))
            x = x + self.mlp[i](self.n2[i](x))
        return self.norm(x)


def test_sdpa_with_enable_gqa():
    torch.manual_seed(0)
    model = GQAEnable().eval()
    idx = torch.randint(0, 64, (2, 6))
    conv = dr.convert(model, "moda", preserve_init=True, example_inputs=(idx,), inplace=False).eval()
    with torch.no_grad():
        assert rel_err(conv(idx), model(idx)) <= INIT_RTOL
    assert conv.depthrewrite.kv_proj_1.weight.shape == (2 * 2 * 8, 32)  # 2·Hk·d with Hk = 2, not Hq = 4


class GatedKeys(GQAEnable):
    """Keys gated by the hidden states (k · σ(x·w)): a key path that cannot be replayed on FFN keys alone."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.ModuleList([torch.nn.Linear(32, 1) for _ in range(len(self.q))])

    def forward(self, idx):
        x = self.emb(idx)
        B, T, D = x.shape
        for i in range(len(self.q)):
            u = self.n1[i](x)
            q = self.q[i](u).view(B, T, self.hq, self.hd).transpose(1, 2)
            k, v = self.kv[i](u).view(B, T, 2, self.hk, self.hd).permute(2, 0, 3, 1, 4)
            k = k * torch.sigmoid(self.gate[i](u)).view(B, 1, T, 1)
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self.o[i](y.transpose(1, 2).reshape(B, T, D))
            x = x + self.mlp[i](self.n2[i](x))
        return self.norm(x)


def test_a_key_path_reading_hidden_states_falls_back_to_raw_keys():
    torch.manual_seed(0)
    model = GatedKeys().eval()
    idx = torch.randint(0, 64, (2, 6))
    conv = dr.convert(model, "moda", preserve_init=True, example_inputs=(idx,), inplace=False).eval()
    with torch.no_grad():
        assert rel_err(conv(idx), model(idx)) <= INIT_RTOL
    rep = conv.report()
    writer = next(s for s in rep.sites if not s.sources)
    assert "raw keys (" in writer.detail and "depends on the hidden states" in writer.detail
    assert any(n.startswith("FFN-slot keys stored raw") and "ffn1" in n for n in rep.notes)


class ScoreOrder(TemperatureAttention):
    """Eager attention with the scale, soft-cap and mask in various orders (moda_attn applies softcap(s·scores) + mask)."""

    def __init__(self, variant):
        super().__init__()
        self.variant = variant
        T = 16
        self.register_buffer("tri", torch.tril(torch.ones(T, T)).view(1, 1, T, T))
        self.register_buffer("band", (torch.tril(torch.ones(T, T)) - torch.tril(torch.ones(T, T), -2)).view(1, 1, T, T))

    def forward(self, idx):
        x = self.emb(idx)
        B, T, D = x.shape
        H, hd = self.heads, D // self.heads
        pos = torch.arange(T)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        bias = (-(pos[None, :] - pos[:, None]).abs().float()).masked_fill(~causal, float("-inf"))
        tri = self.tri[:, :, :T, :T] == 0
        s, v_ = 1.0 / math.sqrt(hd), self.variant
        for n1, qkv in zip(self.n1, self.qkv):
            q, k, v = qkv(n1(x)).view(B, T, 3, H, hd).permute(2, 0, 3, 1, 4)
            a = q @ k.transpose(-2, -1)
            if v_ == "bias_before_scale":
                att = (a + bias) * s
            elif v_ == "bias_after_scale":
                att = a * s + bias
            elif v_ == "fill_before_softcap":
                att = 2.0 * torch.tanh((a * s).masked_fill(tri, float("-inf")) / 2.0)
            elif v_ == "fill_after_softcap":
                att = (2.0 * torch.tanh((a * s) / 2.0)).masked_fill(tri, float("-inf"))
            elif v_ == "bias_before_softcap":
                att = 2.0 * torch.tanh((a * s + bias) / 2.0)
            elif v_ == "fill_before_scale":  # -inf · s = -inf: commutes
                att = a.masked_fill(tri, float("-inf")) / math.sqrt(hd)
            elif v_ == "causal_buffer":
                att = (a / math.sqrt(hd)).masked_fill(tri, float("-inf"))
            else:  # band_buffer: a sliding window, not causal
                att = (a / math.sqrt(hd)).masked_fill(self.band[:, :, :T, :T] == 0, float("-inf"))
            x = x + (torch.softmax(att, dim=-1) @ v).transpose(1, 2).reshape(B, T, D)
        return self.norm(x)


@pytest.mark.parametrize("variant, node, why", [
    ("bias_before_scale", "add", "an additive mask below the scale"),
    ("fill_before_softcap", "masked_fill", "masked_fill below the c·tanh(·/c) soft-cap"),
    ("bias_before_softcap", "add", "an additive mask below the c·tanh(·/c) soft-cap"),
])
def test_a_mask_below_the_scale_or_softcap_is_refused(variant, node, why):
    """moda_attn applies the mask after scale and soft-cap: a mask the model scales or caps is refused, naming the
    node and the order (these converted silently wrong before: 0.36 / 0.58 relative error at λ = 0)."""
    with pytest.raises(AttentionPatternError) as ei:
        dr.convert(ScoreOrder(variant), "moda", preserve_init=True, example_inputs=(torch.randint(0, 32, (2, 8)),))
    msg = str(ei.value)
    assert ei.value.node.startswith(node) and f"`{ei.value.node}`" in msg and why in msg
    assert "[mask] -> [c·tanh(·/c) soft-cap] -> [scale] -> matmul" in msg


@pytest.mark.parametrize("variant, causal, softcap", [
    ("bias_after_scale", False, 0.0), ("fill_after_softcap", True, 2.0), ("fill_before_scale", True, 0.0),
    ("causal_buffer", True, 0.0), ("band_buffer", False, 0.0),
])
def test_mask_scale_softcap_in_order_are_exact(variant, causal, softcap):
    torch.manual_seed(0)
    model = ScoreOrder(variant).eval()
    with torch.no_grad():
        for p in model.qkv.parameters():
            p.mul_(4.0)  # sharp attention: a misplaced mask would show
    conv = dr.convert(model, "moda", preserve_init=True, example_inputs=(torch.randint(1, 32, (2, 8)),), inplace=False).eval()
    attn = [n for n in conv.graph.nodes if n.target is torch.ops.depthrewrite.moda_attn_slots.default]
    assert attn and all(n.args[8] is causal and n.args[11] == softcap for n in attn)
    for shape in ((2, 8), (1, 1), (3, 5)):
        idx = torch.randint(1, 32, shape)
        with torch.no_grad():
            assert rel_err(conv(idx), model(idx)) <= INIT_RTOL


class FlatStream(torch.nn.Module):
    """The residual stream is [B·T, D] from the embedding on; attention views it as [B, T, D] inside its branch."""

    def __init__(self, vocab=32, d=16, layers=2, heads=2):
        super().__init__()
        self.emb, self.heads = torch.nn.Embedding(vocab, d), heads
        self.n1 = torch.nn.ModuleList([torch.nn.LayerNorm(d) for _ in range(layers)])
        self.n2 = torch.nn.ModuleList([torch.nn.LayerNorm(d) for _ in range(layers)])
        self.qkv = torch.nn.ModuleList([torch.nn.Linear(d, 3 * d) for _ in range(layers)])
        self.mlp = torch.nn.ModuleList([torch.nn.Linear(d, d) for _ in range(layers)])
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, idx):
        B, T = idx.shape
        x = self.emb(idx)
        D = x.shape[-1]
        x = x.reshape(B * T, D)
        for n1, n2, qkv, mlp in zip(self.n1, self.n2, self.qkv, self.mlp):
            q, k, v = qkv(n1(x)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + y.transpose(1, 2).reshape(B * T, D)
            x = x + mlp(n2(x))
        return self.norm(x).view(B, T, D)


def test_a_flat_stream_is_refused_for_ffn_slots():
    """A [B·T, D] stream: FFN slots are refused at conversion (the first forward used to crash in torch.stack);
    attention slots only still convert exactly."""
    torch.manual_seed(0)
    model, idx = FlatStream().eval(), torch.randint(0, 32, (3, 6))
    with pytest.raises(ConfigError, match=r"\[batch, sequence, hidden\] stream.*ffn_kv=False"):
        dr.convert(model, "moda", example_inputs=(idx,), inplace=False)
    conv = dr.convert(model, "moda", ffn_kv=False, preserve_init=True, example_inputs=(idx,), inplace=False).eval()
    with torch.no_grad():
        assert rel_err(conv(idx), model(idx)) <= INIT_RTOL


MIXED_ROTATION = {
    "gemma3_text": dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=64,
                        rope_local_base_freq=10.0),  # local / global RoPE bases
    "smollm3": dict(no_rope_layers=[1, 0, 1], no_rope_layer_interval=2),  # a NoPE layer between RoPE layers
}


@pytest.mark.parametrize("name, pairs", [
    ("gemma3_text", ["attn0 (rotation", "ffn1 (rotation", "attn2 (rotation", "ffn3 (rotation"]),
    ("smollm3", ["attn0 (rotation", "-> attn2 (no positional key ops)", "ffn3 (no positional key ops) -> attn4"]),
    ("llama", None),
    ("qwen3", None),
])
def test_mixed_rotations_are_noted(name, pairs):
    """Spec §8 Q1 caveat: where a slot's writer and its reader rotate keys differently, the report says the depth
    scores depend on position and names the slot -> reader pairs; uniform RoPE (Llama, Qwen3 with k-norm) gets no
    note."""
    from depthrewrite.demo.zoo import hf_model

    model = hf_model(name, layers=3 if name in MIXED_ROTATION else 2, hidden=32, **MIXED_ROTATION.get(name, {}))
    notes = [n for n in dr.convert(model, "moda", inplace=False).report().notes if "depend on position" in n]
    if pairs is None:
        assert notes == []
    else:
        assert len(notes) == 1 and "§8 Q1" in notes[0] and all(p in notes[0] for p in pairs)


def test_no_ffn_slot_is_noted():
    """Falcon's parallel attention + MLP is read as one attention branch: no FFN slot is written, and the report says
    so (its header still names the configured variant)."""
    from depthrewrite.demo.zoo import hf_model

    rep = dr.convert(hf_model("falcon", layers=2, hidden=32), "moda").report()
    assert [s.sources for s in rep.sites if s.sources] == [("attn0",)]
    assert any("no FFN slots were written" in n and "Falcon" in n for n in rep.notes)
    rep = dr.convert(build_zoo_model("hf:llama"), "moda").report()
    assert not any("no FFN slots" in n for n in rep.notes)


def test_bloom_refusal_names_the_baddbmm_score_op():
    """BLOOM's ALiBi scores are baddbmm(alibi, q, kᵀ) behind a view: the refusal names the score op, not the view."""
    from depthrewrite.demo.zoo import hf_model

    with pytest.raises(AttentionPatternError) as ei:
        dr.convert(hf_model("bloom", layers=2, hidden=32), "moda")
    assert ei.value.node.startswith("baddbmm") and "ALiBi as baddbmm" in str(ei.value)
