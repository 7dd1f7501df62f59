"""MoDA on attention written outside Hugging Face: MLA (a value head dim that differs from the query/key head dim:
DeepSeek-V3, torchtitan's own class, and a plain-torch MLA-like decoder checked against a hand-written MoDA twin),
and litgpt's GPT (SDPA for Pythia and Llama-3.2, the eager ``q @ k.mT`` with soft-capping for Gemma-2, GQA as
``repeat_interleave``). ``preserve_init=True`` is exact at init (docs/moda.md) on every one of them."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import depthrewrite as dr
from depthrewrite.errors import ConfigError
from depthrewrite.kernels.dispatch import kernel_backend

from .helpers import assert_matches_reference, rel_err
from .reference_models import MLP, RMSNorm, rope


def _grads_ok(conv, loss):
    loss.backward()
    new = {n: p for n, p in conv.named_parameters() if n.startswith("depthrewrite.")}
    assert new
    for n, p in conv.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), n
    return new


# ---------------------------------------------------------------------------------------------------------------------
# MLA-like attention in plain torch: query/key head dim 12, value head dim 8


class MLAttention(nn.Module):
    """q/k of head dim ``dqk`` (RoPE on the whole head), v of head dim ``dv``; GQA as litgpt's repeat_interleave in
    the eager forms. ``form``: "sdpa" or the eager scores ``q @ kᵀ`` with kᵀ written as "mT", "permute" or
    "transpose"."""

    def __init__(self, D, H, Hk, dqk, dv, form):
        super().__init__()
        self.H, self.Hk, self.dqk, self.dv, self.form = H, Hk, dqk, dv, form
        self.q = nn.Linear(D, H * dqk, bias=False)
        self.k = nn.Linear(D, Hk * dqk, bias=False)
        self.v = nn.Linear(D, Hk * dv, bias=False)
        self.o = nn.Linear(H * dv, D, bias=False)

    def keys(self, k_raw):
        B, T, _ = k_raw.shape
        return rope(k_raw.view(B, T, self.Hk, self.dqk).transpose(1, 2))

    def qkv(self, x):
        B, T, _ = x.shape
        q = rope(self.q(x).view(B, T, self.H, self.dqk).transpose(1, 2))
        return q, self.keys(self.k(x)), self.v(x).view(B, T, self.Hk, self.dv).transpose(1, 2)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x)
        if self.form == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            G = self.H // self.Hk
            k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
            kt = {"mT": lambda: k.mT, "permute": lambda: k.permute(0, 1, 3, 2),
                  "transpose": lambda: k.transpose(-1, -2), "flip": lambda: k.mT.flip(-1)}[self.form]()
            s = (q @ kt) * (1.0 / math.sqrt(self.dqk))
            s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=x.device).tril(), float("-inf"))
            y = torch.softmax(s, dim=-1) @ v
        return self.o(y.transpose(1, 2).reshape(B, T, self.H * self.dv))


class MLADecoder(nn.Module):
    """PreNorm decoder of MLA-like attention and MLPs; ``moda=True``: the hand-written MoDA twin (moda.md §2: one
    joint softmax over causal sequence keys and the same token's slots of every earlier sublayer; FFN slots
    ``kv_proj(Norm(h))`` = [keys Hk·dqk | values Hk·dv], keys through the block attention's RoPE; λ per head)."""

    def __init__(self, vocab=64, D=32, layers=3, H=4, Hk=2, dqk=12, dv=8, form="sdpa", moda=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, D)
        self.norms = nn.ModuleList([RMSNorm(D) for _ in range(2 * layers)])
        self.fns = nn.ModuleList([MLAttention(D, H, Hk, dqk, dv, form) if j % 2 == 0 else MLP(D)
                                  for j in range(2 * layers)])
        self.final = RMSNorm(D)
        self.head = nn.Linear(D, vocab, bias=False)
        self.moda, self.H, self.Hk, self.dqk, self.dv = moda, H, Hk, dqk, dv
        if moda:
            L = 2 * layers
            self.kv_proj = nn.ParameterDict({str(j): nn.Parameter(torch.zeros(Hk * (dqk + dv), D))
                                             for j in range(1, L - 2, 2)})
            self.lam = nn.ParameterDict({str(j): nn.Parameter(torch.zeros(H)) for j in range(2, L, 2)})

    def forward(self, idx):
        x = self.emb(idx)
        if not self.moda:
            for norm, f in zip(self.norms, self.fns):
                x = x + f(norm(x))
            return self.head(self.final(x))
        B, T, _ = x.shape
        H, Hk, dqk, dv = self.H, self.Hk, self.dqk, self.dv
        G = H // Hk
        slots_k, slots_v = [], []
        for j, (norm, f) in enumerate(zip(self.norms, self.fns)):
            u = norm(x)
            if j % 2 == 0:
                q, k, v = f.qkv(u)
                s = (q @ k.repeat_interleave(G, 1).transpose(-1, -2)) / math.sqrt(dqk)
                s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
                if slots_k:
                    Kd = torch.stack(slots_k, 3).repeat_interleave(G, 1)  # [B, H, T, n, dqk]
                    Vd = torch.stack(slots_v, 3).repeat_interleave(G, 1)  # [B, H, T, n, dv]
                    sd = torch.einsum("bhtd,bhtnd->bhtn", q, Kd) / math.sqrt(dqk)
                    lam = self.lam[str(j)]
                    lam = (lam + (lam.clamp_min(0) - lam).detach()).view(1, H, 1, 1)  # λ ≥ 0, straight-through
                    e_s, e_d = torch.exp(s), lam * torch.exp(sd)
                    Z = e_s.sum(-1, keepdim=True) + e_d.sum(-1, keepdim=True)
                    y = (e_s @ v.repeat_interleave(G, 1) + torch.einsum("bhtn,bhtnd->bhtd", e_d, Vd)) / Z
                else:
                    y = torch.softmax(s, -1) @ v.repeat_interleave(G, 1)
                out = f.o(y.transpose(1, 2).reshape(B, T, H * dv))
                if j < len(self.fns) - 2:
                    slots_k.append(k)
                    slots_v.append(v)
            else:
                out = f(u)
                if str(j) in self.kv_proj:
                    kv = u @ self.kv_proj[str(j)].T
                    slots_k.append(self.fns[j - 1].keys(kv[..., : Hk * dqk]))
                    slots_v.append(kv[..., Hk * dqk:].view(B, T, Hk, dv).transpose(1, 2))
            x = x + out
        return self.head(self.final(x))


def _conv_name(name: str) -> str:
    if name.startswith("kv_proj."):
        return f"depthrewrite.kv_proj_{name.split('.')[1]}.weight"
    if name.startswith("lam."):
        return f"depthrewrite.moda_{name.split('.')[1]}.depth_weight"
    return name


def _mla_pair(form):
    torch.manual_seed(0)
    vanilla = MLADecoder(form=form)
    ref = MLADecoder(form=form, moda=True)
    ref.load_state_dict(vanilla.state_dict(), strict=False)
    idx = torch.randint(0, 64, (2, 7))
    conv = dr.convert(vanilla, "moda", preserve_init=True, example_inputs=(idx,), inplace=False)
    g = torch.Generator().manual_seed(1)
    box = conv.depthrewrite
    for j, p in ref.kv_proj.items():
        w = torch.randn(p.shape, generator=g) * 0.3
        p.data.copy_(w)
        getattr(box, f"kv_proj_{j}").weight.data.copy_(w)
    for j, p in ref.lam.items():
        w = torch.rand(p.shape, generator=g) * 1.5 - 0.25  # one or two heads clamped at 0
        p.data.copy_(w)
        getattr(box, f"moda_{j}").depth_weight.data.copy_(w)
    return vanilla, ref, conv, idx


@pytest.mark.parametrize("form", ["sdpa", "mT", "permute", "transpose"])
def test_mla_value_head_dim_matches_a_hand_written_moda(form):
    """Depth slots whose values are narrower than their keys (moda.md §2 with dv != d): outputs and every gradient
    equal the hand-written twin; the FFN slots' kv_proj is D -> Hk·(dqk + dv) and their keys go through the
    attention's RoPE; the eager forms (kᵀ as mT, permute or transpose, GQA as repeat_interleave) read Hk = 2."""
    vanilla, ref, conv, idx = _mla_pair(form)
    assert conv.depthrewrite.kv_proj_1.weight.shape == (2 * (12 + 8), 32)
    report = conv.report()
    assert any("dv=8" in n for n in report.notes)
    writers = [s for s in report.sites if not s.sources]
    assert writers and all("keys through attn" in s.detail and "2·(12 + 8)" in s.detail for s in writers)
    readers = [s for s in report.sites if s.sources]
    assert readers and all(("sdpa" if form == "sdpa" else "eager") in s.detail for s in readers)
    assert_matches_reference(ref, conv, idx, _conv_name)


def test_a_second_operand_that_is_not_a_transpose_of_k_is_refused():
    """kᵀ is read from the dataflow: a flip after the transpose is not kᵀ, and the refusal names the scores matmul."""
    from depthrewrite import AttentionPatternError

    torch.manual_seed(0)
    with pytest.raises(AttentionPatternError, match=r"`matmul`.*`flip` .* is not one") as e:
        dr.convert(MLADecoder(form="flip"), "moda", example_inputs=(torch.randint(0, 64, (2, 7)),))
    assert e.value.node == "matmul"


def test_mla_preserve_init_is_exact_and_the_kernel_matches():
    torch.manual_seed(0)
    vanilla = MLADecoder(form="mT")
    idx = torch.randint(0, 64, (2, 7))
    want = vanilla(idx)
    conv = dr.convert(vanilla, "moda", preserve_init=True, example_inputs=(idx,), inplace=False)
    assert rel_err(conv(idx), want) < 1e-5
    _, _, conv, idx = _mla_pair("sdpa")
    outs, grads = [], []
    for backend in ("reference", "triton"):  # the fused kernel in Triton's interpreter on CPU
        conv.zero_grad()
        with kernel_backend(backend):
            out = conv(idx)
            out.square().mean().backward()
        outs.append(out.detach())
        grads.append({n: p.grad.clone() for n, p in conv.named_parameters() if p.grad is not None})
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


# ---------------------------------------------------------------------------------------------------------------------
# torchtitan 0.3.0's DeepSeek-V3 (MLA: q/k head dim 16 + 8 = 24, value head dim 16; MoE in layer 1), SDPA attention


def _titan():
    from ...frameworks.models import build

    return build("torchtitan", "deepseek_v3")


def test_torchtitan_deepseek_v3_mla():
    model, args, kwargs = _titan()
    want = model(*args, **kwargs)
    conv = dr.convert(model, "moda", preserve_init=True, inplace=False)
    out = conv(*args, **kwargs)
    assert rel_err(out, want) < 1e-5  # λ = 0: the original model
    new = _grads_ok(conv, out.square().mean())
    lam = [p for n, p in new.items() if n.endswith("depth_weight")]
    assert lam and all(p.grad.abs().sum() > 0 for p in lam)
    kv = [p for n, p in new.items() if n.endswith(".weight") and "kv_proj" in n]
    assert kv and all(p.shape == (4 * (24 + 16), 64) for p in kv)
    assert any("dv=16" in n for n in conv.report().notes)

    paper = dr.convert(model, "moda", inplace=False)  # λ ≡ 1
    out = paper(*args, **kwargs)
    assert torch.isfinite(out).all() and rel_err(out, want) > 1e-4
    _grads_ok(paper, out.square().mean())
    paper.zero_grad()
    with kernel_backend("triton"):  # the fused kernel with value head dim 16 != 24, in the interpreter
        out_k = paper(*args, **kwargs)
    torch.testing.assert_close(out_k, out, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# litgpt's GPT


LITGPT = {
    "pythia-14m": dict(n_layer=2, n_embd=64, n_head=4, block_size=64, vocab_size=128, padded_vocab_size=128),
    "Llama-3.2-1B": dict(n_layer=2, n_embd=64, n_head=4, n_query_groups=2, intermediate_size=128, block_size=64,
                         vocab_size=128, padded_vocab_size=128),
    # soft-capped scores: litgpt writes them eagerly, q @ k.mT · s, softcap, + an additive finfo.min mask
    "gemma-2-2b": dict(n_layer=2, n_embd=64, n_head=4, n_query_groups=2, head_size=16, intermediate_size=128,
                       block_size=64, vocab_size=128, padded_vocab_size=128),
}
needs_litgpt = pytest.mark.skipif(importlib.util.find_spec("litgpt") is None, reason="litgpt is not installed")


def _litgpt(name):
    from litgpt import GPT, Config

    torch.manual_seed(0)
    return GPT(Config.from_name(name, **LITGPT[name])).eval()


@needs_litgpt
@pytest.mark.parametrize("name, form, hk", [("pythia-14m", "sdpa", 4), ("Llama-3.2-1B", "sdpa", 2),
                                            ("gemma-2-2b", "eager", 2)])
def test_litgpt(name, form, hk):
    model = _litgpt(name)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    want = model(ids)
    conv = dr.convert(model, "moda", preserve_init=True, inplace=False)
    out = conv(ids)
    assert rel_err(out, want) < 1e-5  # exact at init (docs/moda.md, preserve_init)
    readers = [s for s in conv.report().sites if s.sources]
    assert readers and all(s.detail.startswith(form) for s in readers)
    assert any(f"Hk={hk}," in n for n in conv.report().notes)  # GQA read before litgpt's repeat_interleave
    new = _grads_ok(conv, out.square().mean())
    assert all(p.grad.abs().sum() > 0 for n, p in new.items() if n.endswith("depth_weight"))
    paper = dr.convert(model, "moda", inplace=False)
    out = paper(ids)
    assert torch.isfinite(out).all() and rel_err(out, want) > 1e-4
    _grads_ok(paper, out.square().mean())


@needs_litgpt
def test_litgpt_kv_cache_refusal_does_not_say_use_cache_only():
    """litgpt's own KV cache (set_kv_cache, then calls with input_pos) has no use_cache argument: where MoDA refuses
    a cached call, the advice names the model-managed cache too."""
    conv = dr.convert(_litgpt("pythia-14m"), "moda", preserve_init=True)
    conv.set_kv_cache(batch_size=1)
    ids = torch.randint(0, 128, (1, 5))
    try:
        conv(ids, input_pos=torch.arange(5))
    except ConfigError as e:
        msg = str(e)
        assert "use_cache" not in msg or "model-managed cache" in msg, msg
