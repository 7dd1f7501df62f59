"""MoDA query rows with nothing visible: no sequence key (a pad query row under a padding mask) and λ = 0 (a
``preserve_init`` depth weight at init, or clamped at 0 once trained). The joint softmax is 0/0 there; the op defines
the row's output as 0 with no gradient (as SDPA gives a row without keys), on every path: the reference differentiated
by autograd (explicit sequence part), the op's CPU flash forward and backward, its written-out backward (soft-capped,
explicit), and the Triton kernel (interpreter on CPU). Also a finfo.min additive mask (HF eager's), where λ = 0 leaves a
row's sequence mass at ~1e-38: the row stays the original attention and nothing is 0·∞."""

from __future__ import annotations

import math

import pytest
import torch

from depthrewrite.kernels.dispatch import kernel_backend
from depthrewrite.kernels.moda import moda_attn, moda_attn_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # where the Triton path runs (on CPU: the interpreter)


def naive(q, k, v, keep, Kd, Vd, lam, scale, softcap=0.0):
    """Concatenated logits row by row in fp64; a row with zero total weight outputs 0 (no gradient)."""
    B, Hq, T, d = q.shape
    G = Hq // k.shape[1]
    rows = []
    for b in range(B):
        for h in range(Hq):
            g = h // G
            for t in range(T):
                s = (k[b, g] @ q[b, h, t]) * scale
                sd = (Kd[b, t, :, g] @ q[b, h, t]) * scale
                if softcap:
                    s, sd = softcap * torch.tanh(s / softcap), softcap * torch.tanh(sd / softcap)
                s = s.masked_fill(~keep[b, 0, t], -math.inf)
                w = 1.0 if lam is None else lam[h] + (lam[h].clamp_min(0) - lam[h]).detach()
                e = torch.cat([torch.exp(s), w * torch.exp(sd)])
                if e.sum() == 0:
                    rows.append(torch.zeros(d, dtype=q.dtype))
                    continue
                p = e / e.sum()
                rows.append(p[: k.shape[2]] @ v[b, g] + p[k.shape[2]:] @ Vd[b, t, :, g])
    return torch.stack(rows).view(B, Hq, T, d)


def _inputs(dtype=torch.float32, lam=True, seed=0):
    """MHA-free GQA (Hq 4, Hk 2), a bool mask [B, 1, T, S] with left-padded row 0 (pad queries see no key) and a
    fully masked query row in row 1; λ with zeros and a negative entry (clamped to 0)."""
    g = torch.Generator().manual_seed(seed)
    B, Hq, Hk, T, n, d = 2, 4, 2, 6, 3, 8
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    q, k, v = r(B, Hq, T, d), r(B, Hk, T, d), r(B, Hk, T, d)
    Kd, Vd = r(B, T, n, Hk, d), r(B, T, n, Hk, d)
    keep = torch.ones(T, T, dtype=torch.bool).tril().expand(B, 1, T, T).clone()
    keep[0, :, :, :2] = False  # row 0 left-padded by 2: its query rows 0 and 1 see no key at all
    keep[1, :, 3] = False
    w = torch.tensor([0.0, 0.7, -0.3, 1.2], dtype=dtype) if lam else None
    return [q, k, v, keep, Kd, Vd, w]


PATHS = [
    pytest.param("reference", 0.0, id="op-cpu-flash"),  # fp32, no soft-cap: CPU flash forward and backward
    pytest.param("reference", 3.0, id="op-explicit-softcap"),  # the written-out backward (_reference_grads)
    pytest.param("triton", 0.0, id="op-triton"),
    pytest.param("triton", 3.0, id="op-triton-softcap"),
    pytest.param("ref-autograd", 0.0, id="reference-autograd"),
]


@pytest.mark.parametrize("path, softcap", PATHS)
def test_rows_with_nothing_visible_are_zero_and_poison_nothing(path, softcap):
    cpu = _inputs()
    xs = [t.to(DEV) for t in cpu] if path == "triton" else cpu
    diff = [0, 1, 2, 4, 5, 6]
    ins = [t.clone().requires_grad_() if i in diff else t for i, t in enumerate(xs)]
    if path == "ref-autograd":
        out = moda_attn_ref(*ins, 0.3, False, 0.0, None, softcap)
    else:
        with kernel_backend(path):
            out = moda_attn(*ins, 0.3, False, 0.0, None, softcap)
            with torch.no_grad():  # the reference's no-grad forward takes the CPU flash path
                torch.testing.assert_close(moda_attn(*xs, 0.3, False, 0.0, None, softcap), out.detach(),
                                           rtol=1e-5, atol=1e-5)
    ref_in = [t.double().clone().requires_grad_() if i in diff else t for i, t in enumerate(cpu)]
    want = naive(*ref_in, 0.3, softcap)
    out = out.cpu()
    assert torch.isfinite(out).all()
    assert (out[0, 0, :2] == 0).all() and (out[0, 2, :2] == 0).all()  # λ = 0 and λ < 0 heads, pad query rows
    assert (out[0, 1, :2] != 0).any()  # λ > 0: depth-only attention there
    torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    if path == "ref-autograd":
        got = torch.autograd.grad(out, [ins[i] for i in diff], go)
    else:
        with kernel_backend(path):
            got = torch.autograd.grad(out, [ins[i] for i in diff], go)
    exp = torch.autograd.grad(want, [ref_in[i] for i in diff], go.double())
    for i, a, b in zip(diff, got, exp):
        assert torch.isfinite(a).all(), f"input {i}"
        torch.testing.assert_close(a.double().cpu(), b, rtol=1e-4, atol=1e-4, msg=lambda m, i=i: f"input {i}: {m}")


@pytest.mark.parametrize("path", ["reference", "triton", "ref-autograd"])
def test_finfo_min_mask_with_lambda_zero_is_the_original_attention(path):
    """An additive mask of finfo.min (HF eager) on a fully masked row: the original softmax is uniform over the keys;
    with λ = 0 MoDA keeps exactly that (not 0/0 from a sequence weight of e^{-3e38}); a row whose output gradient is 0
    (a pad row: nothing downstream reads it) gives finite gradients, λ's included."""
    q, k, v, keep, Kd, Vd, _ = _inputs()
    mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    dev = DEV if path == "triton" else "cpu"
    q, k, v, mask, Kd, Vd = (t.to(dev) for t in (q, k, v, mask, Kd, Vd))
    w = torch.zeros(4, device=dev, requires_grad=True)
    ins = [t.clone().requires_grad_() for t in (q, k, v, Kd, Vd)]
    args = (ins[0], ins[1], ins[2], mask, ins[3], ins[4], w, 0.3, False, 0.0, None, 0.0)
    if path == "ref-autograd":
        out = moda_attn_ref(*args)
    else:
        with kernel_backend(path):
            out = moda_attn(*args)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                            attn_mask=mask, scale=0.3)
    torch.testing.assert_close(out, sdpa, rtol=1e-5, atol=1e-5)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(dev)
    go[0, :, :2] = 0  # the pad rows
    go[1, :, 3] = 0
    if path == "ref-autograd":
        grads = torch.autograd.grad(out, [*ins, w], go)
    else:
        with kernel_backend(path):
            grads = torch.autograd.grad(out, [*ins, w], go)
    for gr in grads:
        assert torch.isfinite(gr).all()
