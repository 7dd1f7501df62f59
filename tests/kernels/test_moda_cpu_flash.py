"""MoDA's reference on CPU fp32/fp64 runs the sequence part with PyTorch's CPU flash-attention kernel (forward, and its
backward with the joint output and log-sum-exp): checked against an independent joint softmax over the concatenated
logits, written here, forward and every gradient, including query rows whose every key is masked (depth-only
attention, as the Triton kernel computes) and depth slots in another dtype."""

from __future__ import annotations

import pytest
import torch

from depthrewrite.kernels.dispatch import kernel_backend

OP = torch.ops.depthrewrite.moda_attn


def _joint(q, k, v, mask, Kd, Vd, lam, scale, causal):
    """The joint softmax over [sequence logits | depth logits], masked keys dropped, λ on the depth weights."""
    G = q.shape[1] // k.shape[1]
    T, S = q.shape[2], k.shape[2]
    kf, vf = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    Kdf, Vdf = Kd.to(q.dtype).repeat_interleave(G, 3), Vd.to(q.dtype).repeat_interleave(G, 3)
    s = (q @ kf.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~torch.ones(T, S, dtype=torch.bool).tril(), -torch.inf)
    if mask is not None:
        s = s.masked_fill(~mask, -torch.inf) if mask.dtype == torch.bool else s + mask
    sd = torch.einsum("bhtd,btnhd->bhtn", q, Kdf) * scale
    if lam is not None:
        sd = sd + lam.to(q.dtype).clamp_min(1e-30).log().view(1, -1, 1, 1)
    p = torch.softmax(torch.cat([s, sd], -1), -1)
    return p[..., :S] @ vf + torch.einsum("bhtn,btnhd->bhtd", p[..., S:], Vdf)


def _case(dtype, G=2, T=5, S=6, n=3, d=8, mask="bool", causal=False, lam=True, slots=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    Hk, B = 2, 2
    Hq = Hk * G
    r = lambda *s, dt=dtype: torch.randn(*s, generator=g, dtype=dt)  # noqa: E731
    q, k, v = r(B, Hq, T, d), r(B, Hk, S, d), r(B, Hk, S, d)
    Kd, Vd = r(B, T, n, Hk, d, dt=slots or dtype), r(B, T, n, Hk, d, dt=slots or dtype)
    m = None
    if mask == "bool":
        m = torch.rand(B, 1, T, S, generator=g) > 0.4
        m[:, :, 1] = False  # a query row without any key
    elif mask == "additive":
        m = torch.randn(1, 1, T, S, generator=g, dtype=dtype)
        m[..., 2, :] = -torch.inf
    w = torch.rand(Hq, generator=g, dtype=dtype) + 0.1 if lam else None
    return [q, k, v, m, Kd, Vd, w], 0.3, causal


@pytest.mark.parametrize(
    "kw",
    [
        dict(dtype=torch.float32),
        dict(dtype=torch.float64, mask="additive", G=1),
        dict(dtype=torch.float64, mask=None, causal=True, T=6, S=6, lam=False),
        dict(dtype=torch.float64, mask="bool", causal=True, T=6, S=6),
        dict(dtype=torch.float32, slots=torch.float64),
    ],
    ids=["fp32-bool-gqa", "fp64-additive", "fp64-causal", "fp64-bool-causal", "fp32-fp64-slots"],
)
def test_cpu_flash_path_matches_an_independent_joint_softmax(kw):
    tensors, scale, causal = _case(**kw)
    diff = [i for i, t in enumerate(tensors) if t is not None and t.is_floating_point() and i != 3]
    grad_out = None
    results = []
    for impl in ("op", "independent"):
        xs = [t.clone().requires_grad_() if i in diff else t for i, t in enumerate(tensors)]
        q, k, v, m, Kd, Vd, w = xs
        with kernel_backend("reference"):
            if impl == "op":
                out = OP(q, k, v, m, Kd, Vd, w, scale, causal, 0.0, None, 0.0)
            else:
                out = _joint(q, k, v, m, Kd, Vd, w, scale, causal)
            if grad_out is None:
                grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
            grads = torch.autograd.grad(out, [xs[i] for i in diff], grad_out)
        results.append([out, *grads])
    tol = dict(rtol=1e-4, atol=1e-5) if kw["dtype"] == torch.float32 else dict(rtol=1e-9, atol=1e-10)
    for a, b in zip(*results):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b.to(a.dtype), **tol)


def test_a_row_without_keys_matches_the_triton_kernel():
    tensors, scale, causal = _case(torch.float32, lam=False)
    outs = []
    for backend in ("reference", "triton"):  # on CPU the kernel runs in Triton's interpreter (tests/conftest.py)
        dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
        on = [t.to(dev) if isinstance(t, torch.Tensor) else t for t in tensors]
        with kernel_backend(backend):
            outs.append(OP(*on, scale, causal, 0.0, None, 0.0).cpu())
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
