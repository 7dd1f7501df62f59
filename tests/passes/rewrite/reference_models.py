"""Plain PreNorm decoders with AttnRes, MSAR and mHC, written from shared/specs/ (not from the passes).

Used by the independent-reference tests: the vanilla twin (`use_attnres=False`) is converted by depthrewrite, the
weights are copied, and both sides get the same random pseudo-queries and gains.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.heads = heads

    def forward(self, x, attention_mask=None):
        """``attention_mask`` [B, T] (0 = pad): keys at pad positions are masked; a pad query keeps its own key (so
        a left-padded row's pad queries have one key and no NaN)."""
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        if attention_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            eye = torch.eye(T, dtype=torch.bool, device=x.device)
            causal = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device))
            allowed = causal & (attention_mask[:, None, None, :] != 0) | eye
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class TextbookAttention(Attention):
    """minGPT's attention: q @ kᵀ · 1/√d, masked_fill with a registered lower-triangular buffer, softmax, @ v."""

    def __init__(self, d: int, heads: int, block_size: int = 16):
        super().__init__(d, heads)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = torch.softmax(att, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


def rope(x, base: float = 10000.0):
    """Rotate-half RoPE of x [B, H, T, d] at positions 0..T-1 (the Llama convention)."""
    d, T = x.shape[-1], x.shape[-2]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.arange(T, dtype=torch.float32)[:, None] * inv  # [T, d/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class RoPEAttention(nn.Module):
    """Llama-style attention (separate q/k/v projections, GQA, RoPE); ``qk_norm``: Qwen3's per-head q/k RMSNorm
    before RoPE; ``bias``: Qwen2's q/k/v biases."""

    def __init__(self, d: int, heads: int, kv_heads: int, qk_norm: bool = False, bias: bool = False):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.q = nn.Linear(d, d, bias=bias)
        self.k = nn.Linear(d, kv_heads * self.hd, bias=bias)
        self.v = nn.Linear(d, kv_heads * self.hd, bias=bias)
        self.o = nn.Linear(d, d, bias=False)
        self.q_norm = RMSNorm(self.hd) if qk_norm else None
        self.k_norm = RMSNorm(self.hd) if qk_norm else None

    def _heads(self, x, H, norm):
        B, T, _ = x.shape
        x = x.view(B, T, H, self.hd)
        if norm is not None:
            x = norm(x)
        return rope(x.transpose(1, 2))

    def keys(self, k_raw):
        """The key path: [B, T, Hk·d] projected keys -> k-norm -> [B, Hk, T, d] -> RoPE at each token's position."""
        return self._heads(k_raw, self.kv_heads, self.k_norm)

    def qkv(self, x):
        B, T, _ = x.shape
        q = self._heads(self.q(x), self.heads, self.q_norm)
        v = self.v(x).view(B, T, self.kv_heads, self.hd).transpose(1, 2)
        return q, self.keys(self.k(x)), v

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(B, T, D))


class MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up = nn.Linear(d, 3 * d, bias=False)
        self.down = nn.Linear(3 * d, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


class Mix(nn.Module):
    """One site: h = c · Σ softmax(w · RMSNorm_γ(v_i)) v_i, in fp32 (spec §2, §5 count rescaling)."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(d))
        self.gain = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, sources, count: bool):
        V = torch.stack(sources).float()  # [K, B, T, D]
        keys = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + self.eps) * self.gain
        alpha = torch.softmax((keys * self.query).sum(-1), dim=0)  # [K, B, T]
        h = (alpha.unsqueeze(-1) * V).sum(0)
        return (h * len(sources) if count else h).to(sources[0].dtype)


class Decoder(nn.Module):
    """L_b blocks = 2·L_b sublayers (attention, MLP, ...). ``block_size`` S in sublayers; S=1 is Full AttnRes."""

    def __init__(self, vocab=64, d=32, layers=3, heads=4, use_attnres=False, block_size=1, count=True, norm_eps=1e-6,
                 attn="plain", kv_heads=None):
        """``attn``: "plain" (fused qkv, no RoPE, SDPA), "mingpt" (the same, written as minGPT's textbook attention),
        "llama" (RoPE, GQA with ``kv_heads``), "qwen3" (plus q/k-norm), "qwen2" (RoPE, GQA, q/k/v biases)."""
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.norms = nn.ModuleList([RMSNorm(d, norm_eps) for _ in range(2 * layers)])
        kvh = kv_heads or heads

        def make_attn():
            if attn == "plain":
                return Attention(d, heads)
            if attn == "mingpt":
                return TextbookAttention(d, heads)
            return RoPEAttention(d, heads, kvh, qk_norm=attn == "qwen3", bias=attn == "qwen2")

        self.fns = nn.ModuleList([make_attn() if j % 2 == 0 else MLP(d) for j in range(2 * layers)])
        self.final = RMSNorm(d, norm_eps)
        self.head = nn.Linear(d, vocab, bias=False)
        self.use_attnres, self.S, self.count = use_attnres, block_size, count
        if use_attnres:
            # sites 1..L-1 and the output site; sublayer 0 has a single source and no parameters (spec §11.9)
            self.mixes = nn.ModuleDict({str(j): Mix(d, 1e-6) for j in range(1, 2 * layers)} | {"output": Mix(d, 1e-6)})

    def forward(self, idx, attention_mask=None):
        """``attention_mask`` [B, T] (0 = pad; plain attention only): masks the attention's keys, and is passed to the
        mixes (MSAR's masks its sources, msar.md §5)."""
        x = self.emb(idx)
        am = {} if attention_mask is None else {"attention_mask": attention_mask}

        def call(f, y):
            return f(y, **am) if isinstance(f, Attention) else f(y)

        if not self.use_attnres:
            for norm, f in zip(self.norms, self.fns):
                x = x + call(f, norm(x))
            return self.head(self.final(x))
        mask = {} if attention_mask is None else {"mask": attention_mask}
        # K3 ordering (spec §4), written directly
        blocks, prefix = [], x
        for j, (norm, f) in enumerate(zip(self.norms, self.fns)):
            srcs = blocks + [prefix]
            h = self.mixes[str(j)](srcs, self.count, **mask) if len(srcs) > 1 else prefix
            if j % self.S == 0:
                blocks, prefix = blocks + [prefix], None
            out = call(f, norm(h))
            prefix = out if prefix is None else prefix + out
        h = self.mixes["output"](blocks + [prefix], self.count, **mask)
        return self.head(self.final(h))


# ------------------------------------------------------------------------------------------- MSAR (msar.md §2, §4, §5)


def causal_conv_taps(x, w):
    """Depthwise causal conv along dim -2, written tap by tap: y[t] = Σ_τ w[:, k-1-τ] · x[t-τ] (last tap = now)."""
    k = w.shape[1]
    y = torch.zeros_like(x)
    T = x.shape[-2]
    for tau in range(min(k, T)):
        y[..., tau:, :] += w[:, k - 1 - tau] * x[..., : T - tau, :]
    return y


class MSARMix(nn.Module):
    """``eps``: the key norms' ε (the model's); the mixer's RMS ε is 1e-6 whatever the model's (msar.md §5)."""

    EPS_MIX = 1e-6

    def __init__(self, d: int, kernels=(4, 8, 12), eps: float = 1e-6):
        super().__init__()
        m = len(kernels) + 1
        self.query = nn.Parameter(torch.zeros(m, d))
        self.gain = nn.Parameter(torch.ones(m, d))
        self.conv = nn.ParameterList([nn.Parameter(torch.zeros(d, k)) for k in kernels])
        self.phi = nn.Parameter(torch.zeros(m * d, m))
        self.bias = nn.Parameter(torch.zeros(m))
        self.alpha = nn.Parameter(torch.zeros(1))
        self.eps = eps

    def forward(self, sources, count: bool, mask=None):
        X = torch.stack(sources, dim=2).float()  # [B, T, K, d]
        if mask is not None:  # msar.md §5: pad positions contribute zeros to the convs
            X = X * mask[:, :, None, None]
        Z = []
        for r in range(len(self.conv) + 1):
            Xr = X if r == 0 else causal_conv_taps(X.transpose(1, 2), self.conv[r - 1]).transpose(1, 2)
            Kn = Xr * torch.rsqrt(Xr.pow(2).mean(-1, keepdim=True) + self.eps)
            a = torch.softmax(Kn @ (self.gain[r] * self.query[r]), dim=2)  # [B, T, K]
            Z.append((a[..., None] * Xr).sum(2))
        Zs = torch.stack(Z, 2)  # [B, T, m, d]
        z = Zs.flatten(-2)
        z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + self.EPS_MIX)
        g = torch.sigmoid(self.alpha * (z @ self.phi) + self.bias)
        h = (g[..., None] * Zs).sum(2)
        return (h * len(sources) if count else h).to(sources[0].dtype)


class MSARDecoder(Decoder):
    """Decoder with (Block) MSAR: the K3 loop of the AttnRes decoder with the MSAR mix."""

    def __init__(self, vocab=64, d=32, layers=3, heads=4, block_size=1, kernels=(2, 3, 5), norm_eps=1e-6):
        super().__init__(vocab, d, layers, heads, use_attnres=False, norm_eps=norm_eps)
        self.use_attnres, self.S, self.count = True, block_size, True
        sites = [str(j) for j in range(1, 2 * layers)] + ["output"]
        self.mixes = nn.ModuleDict({j: MSARMix(d, kernels, eps=norm_eps) for j in sites})


# ------------------------------------------------------------------------------------------- mHC (mhc.md §3, §8)


def sinkhorn_ref(Lg, iters, eps, exact_rows=True):
    """2·iters − 1 normalisations after softmax over outputs, each dividing by (sum + eps) as V4 does; exact_rows: the
    final row normalisation by the plain sum (the paper's exact row sums, docs/mhc.md)."""
    steps = [-1] + [-2, -1] * (iters - 1)
    M = torch.softmax(Lg, dim=-2) + eps
    for i, dim in enumerate(steps):
        M = M / (M.sum(dim, keepdim=True) + (0.0 if exact_rows and i == len(steps) - 1 else eps))
    return M


class MHCDecoder(Decoder):
    """Decoder with n residual streams, one mHC site per sublayer, mean collapse before the final norm."""

    def __init__(self, vocab=64, d=32, layers=3, heads=4, n=4, iters=20, eps=1e-6, exact_rows=True):
        super().__init__(vocab, d, layers, heads, use_attnres=False)
        self.n, self.iters, self.eps, self.exact_rows = n, iters, eps, exact_rows
        self.phi = nn.ParameterList([nn.Parameter(torch.zeros(n * d, n * n + 2 * n)) for _ in range(2 * layers)])
        self.b = nn.ParameterList([nn.Parameter(torch.zeros(n * n + 2 * n)) for _ in range(2 * layers)])
        self.a = nn.ParameterList([nn.Parameter(torch.zeros(3)) for _ in range(2 * layers)])

    def forward(self, idx):
        h = self.emb(idx)
        B, T, d = h.shape
        n = self.n
        X = h.unsqueeze(2).repeat(1, 1, n, 1)  # [B, T, n, d]
        for k, (norm, f) in enumerate(zip(self.norms, self.fns)):
            xf = X.reshape(B, T, n * d).float()
            mix = (xf @ self.phi[k]) * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            a, b = self.a[k], self.b[k]
            pre = torch.sigmoid(a[0] * mix[..., :n] + b[:n]) + self.eps
            post = 2 * torch.sigmoid(a[1] * mix[..., n : 2 * n] + b[n : 2 * n])
            Hres = sinkhorn_ref((a[2] * mix[..., 2 * n :] + b[2 * n :]).view(B, T, n, n), self.iters, self.eps, self.exact_rows)
            u = torch.einsum("btn,btnd->btd", pre, X.float()).to(X.dtype)
            y = f(norm(u))
            X = (torch.einsum("btji,btid->btjd", Hres, X.float()) + post[..., None] * y.float()[:, :, None, :]).to(X.dtype)
        return self.head(self.final(X.float().mean(2).to(X.dtype)))


# ------------------------------------------------------------------------------------------- MoDA (moda.md §2, §8)


class MoDADecoder(Decoder):
    """Decoder whose attentions after the first read same-token depth slots (earlier attention K/V and FFN kv_proj
    outputs) in one joint softmax with their causal sequence keys; λ per (site, head) as preserve_init (``lam=True``)
    or λ ≡ 1 (the paper). FFN-slot keys go through the key path of the block's attention (moda.md §8 Q1/Q2: its
    k-norm, then RoPE at the token's own position), as the attention's own keys do; values never do."""

    def __init__(self, vocab=64, d=32, layers=3, heads=4, attn="plain", kv_heads=None, lam=True):
        super().__init__(vocab, d, layers, heads, use_attnres=False, attn=attn, kv_heads=kv_heads)
        L, self.hd = 2 * layers, d // heads
        self.H, self.Hk = heads, kv_heads or heads
        kvd = 2 * self.Hk * self.hd
        self.kv_proj = nn.ParameterDict({str(j): nn.Parameter(torch.zeros(kvd, d)) for j in range(1, L - 2, 2)})
        self.kv_bias = (
            nn.ParameterDict({str(j): nn.Parameter(torch.zeros(kvd)) for j in range(1, L - 2, 2)}) if attn == "qwen2" else None
        )
        self.lam = nn.ParameterDict({str(j): nn.Parameter(torch.zeros(heads)) for j in range(2, L, 2)}) if lam else None

    def _qkv(self, f, u):
        B, T, D = u.shape
        if isinstance(f, RoPEAttention):
            return f.qkv(u)
        return f.qkv(u).view(B, T, 3, self.H, self.hd).permute(2, 0, 3, 1, 4)

    def forward(self, idx):
        x = self.emb(idx)
        B, T, D = x.shape
        H, Hk, hd = self.H, self.Hk, self.hd
        G = H // Hk
        slots_k, slots_v = [], []  # each [B, Hk, T, hd]
        for j, (norm, f) in enumerate(zip(self.norms, self.fns)):
            u = norm(x)
            if j % 2 == 0:
                q, k, v = self._qkv(f, u)
                kq, vq = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)  # query head h reads KV head h // G
                s = (q @ kq.transpose(-1, -2)) / hd**0.5  # [B, H, T, T]
                s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
                if slots_k:
                    Kd = torch.stack(slots_k, 3).repeat_interleave(G, 1)  # [B, H, T, n, hd]
                    Vd = torch.stack(slots_v, 3).repeat_interleave(G, 1)
                    sd = torch.einsum("bhtd,bhtnd->bhtn", q, Kd) / hd**0.5
                    lam = self.lam[str(j)].view(1, H, 1, 1) if self.lam is not None else 1.0
                    e_s, e_d = torch.exp(s), lam * torch.exp(sd)  # small logits: no max-shift needed
                    Z = e_s.sum(-1, keepdim=True) + e_d.sum(-1, keepdim=True)
                    y = (e_s @ vq + torch.einsum("bhtn,bhtnd->bhtd", e_d, Vd)) / Z
                else:
                    y = torch.softmax(s, -1) @ vq
                proj = f.o if isinstance(f, RoPEAttention) else f.proj
                out = proj(y.transpose(1, 2).reshape(B, T, D))
                if j < len(self.fns) - 2:  # the last attention writes nothing (nothing reads it)
                    slots_k.append(k)
                    slots_v.append(v)
            else:
                out = f(u)
                if str(j) in self.kv_proj:
                    kv = u @ self.kv_proj[str(j)].T
                    if self.kv_bias is not None:
                        kv = kv + self.kv_bias[str(j)]
                    k_raw, v_raw = kv[..., : Hk * hd], kv[..., Hk * hd :]
                    block_attn = self.fns[j - 1]
                    if isinstance(block_attn, RoPEAttention):
                        slots_k.append(block_attn.keys(k_raw))  # k-norm + RoPE of the block's attention
                    else:
                        slots_k.append(k_raw.view(B, T, Hk, hd).transpose(1, 2))
                    slots_v.append(v_raw.view(B, T, Hk, hd).transpose(1, 2))
            x = x + out
        return self.head(self.final(x))
