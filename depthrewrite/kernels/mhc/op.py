"""``depthrewrite::mhc_coeffs``, ``mhc_pre``, ``mhc_post``, ``mhc_collapse``: the mHC site as registered ops.

Each op body dispatches with :func:`~depthrewrite.kernels.dispatch.route` and the gate :func:`.limits.covers`: the
fused Triton kernels of ``fused.py`` (imported lazily, only then) or the PyTorch reference of ``reference.py``. The backward of
``mhc_coeffs``, ``mhc_pre`` and ``mhc_post`` is its own registered op (``depthrewrite::mhc_coeffs_backward``,
``mhc_pre_backward``, ``mhc_post_backward``), called from the registered autograd formula, so a compiled backward
graph shows one opaque node per site; it dispatches the same way, to the Triton backward kernels or to the
closed-form PyTorch backward below (which recomputes the forward from the saved inputs). ``mhc_collapse`` is
reference-only (a mean or sum over n streams; nothing to fuse) and keeps the autograd recomputation.

Cases the kernels do not cover run the reference inside the op: fp64 (or other non fp32/bf16/fp16) tensors,
n > 8 streams, empty tensors, bf16 CPU tensors under Triton's interpreter. Double backward is not supported.
"""

from __future__ import annotations

import torch

from ..dispatch import KernelInfo, register_kernel_info, route
from .limits import MAX_STREAMS, covers
from .._trace import tracing
from .reference import mhc_coeffs_ref, mhc_collapse_ref, mhc_post_ref, mhc_pre_ref, sinkhorn

__all__ = [
    "covers", "mhc_coeffs", "mhc_pre", "mhc_post", "mhc_collapse",
    "mhc_coeffs_backward", "mhc_pre_backward", "mhc_post_backward",
]

Tensors4 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _fused(X: torch.Tensor, *tensors: torch.Tensor, op: str):
    """The ``fused`` module when the Triton kernels should and can run on this call (:func:`.dispatch.route`: the
    backend decision, then the gate :func:`.limits.covers`), else ``None``."""
    if not route(f"depthrewrite::{op}", (X, *tensors), lambda: covers(X, *tensors)):
        return None
    from . import fused

    return fused


# ---------------------------------------------------------------------------------------------------------------
# Closed-form PyTorch backward (the reference path of the backward ops; checked against autograd in fp64)
# ---------------------------------------------------------------------------------------------------------------


def _sinkhorn_backward_ref(logits: torch.Tensor, g: torch.Tensor, iters: int, eps: float, exact_rows: bool = False) -> torch.Tensor:
    """dL/dlogits of :func:`~depthrewrite.kernels.mhc.reference.sinkhorn`, storing the 2·iters − 1 iterates."""
    p = torch.softmax(logits, dim=-2)
    A = p + eps
    inputs = []
    steps = [-1] + [-2, -1] * max(iters - 1, 0)
    for i, dim in enumerate(steps):
        e = 0.0 if exact_rows and i == len(steps) - 1 else eps  # the last row normalisation (exact_rows: no eps)
        inputs.append((A, dim, e))
        A = A / (A.sum(dim, keepdim=True) + e)
    for A, dim, e in reversed(inputs):
        s = A.sum(dim, keepdim=True) + e
        g = (g - (g * (A / s)).sum(dim, keepdim=True)) / s
    return p * (g - (g * p).sum(-2, keepdim=True))


def _coeffs_backward_ref(X, phi, bias, alpha, gpre, gpost, gres, iters: int, eps: float, exact_rows: bool = False) -> Tensors4:
    acc = torch.promote_types(X.dtype, torch.float32)
    n = X.shape[-2]
    xf = X.flatten(-2).to(acc)
    ph, a, b = phi.to(acc), alpha.to(acc), bias.to(acc)
    K = xf.shape[-1]
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    mix = (xf @ ph) * r
    m_pre, m_post, m_res = mix[..., :n], mix[..., n : 2 * n], mix[..., 2 * n :]
    s_pre = torch.sigmoid(a[0] * m_pre + b[:n])
    s_post = torch.sigmoid(a[1] * m_post + b[n : 2 * n])
    g_pre = gpre.to(acc) * s_pre * (1 - s_pre)  # grads of the σ / Sinkhorn arguments
    g_post = 2 * gpost.to(acc) * s_post * (1 - s_post)
    logits = (a[2] * m_res + b[2 * n :]).unflatten(-1, (n, n))
    g_res = _sinkhorn_backward_ref(logits, gres.to(acc), iters, eps, exact_rows).flatten(-2)
    g_arg = torch.cat([g_pre, g_post, g_res], -1)
    gmix = torch.cat([a[0] * g_pre, a[1] * g_post, a[2] * g_res], -1)
    gbias = g_arg.reshape(-1, g_arg.shape[-1]).sum(0)
    galpha = torch.stack([(g_pre * m_pre).sum(), (g_post * m_post).sum(), (g_res * m_res).sum()])
    gz = gmix * r  # d/d(x @ φ)
    c = (gmix * mix).sum(-1, keepdim=True) * r * r / K  # the RMS term
    gx = gz @ ph.T - c * xf
    gphi = xf.reshape(-1, K).T @ gz.reshape(-1, gz.shape[-1])
    return gx.reshape(X.shape).to(X.dtype), gphi.to(phi.dtype), gbias.to(bias.dtype), galpha.to(alpha.dtype)


def _pre_backward_ref(X, pre, gu) -> tuple[torch.Tensor, torch.Tensor]:
    acc = torch.promote_types(X.dtype, pre.dtype)
    g = gu.to(acc).unsqueeze(-2)
    gx = pre.to(acc).unsqueeze(-1) * g
    gpre = (g * X.to(acc)).sum(-1)
    return gx.to(X.dtype), gpre.to(pre.dtype)


def _post_backward_ref(X, res, post, y, gout) -> Tensors4:
    acc = torch.promote_types(X.dtype, res.dtype)
    go, Xa = gout.to(acc), X.to(acc)
    ra = res.to(acc)
    gx = ra[..., 0:1, :].transpose(-1, -2) * go[..., 0:1, :]  # Σ_j res[j, i] go[j]: n multiply-adds (fusible)
    for j in range(1, go.shape[-2]):
        gx = gx + ra[..., j : j + 1, :].transpose(-1, -2) * go[..., j : j + 1, :]
    gres = (go.unsqueeze(-2) * Xa.unsqueeze(-3)).sum(-1)  # [..., n_out, n_in]: a reduction over D
    gpost = (go * y.to(acc).unsqueeze(-2)).sum(-1)
    gy = (post.to(acc).unsqueeze(-1) * go).sum(-2)
    return gx.to(X.dtype), gres.to(res.dtype), gpost.to(post.dtype), gy.to(y.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Forward ops
# ---------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("depthrewrite::mhc_coeffs", mutates_args=())
def mhc_coeffs(
    X: torch.Tensor, phi: torch.Tensor, bias: torch.Tensor, alpha: torch.Tensor, iters: int, eps: float,
    exact_rows: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k = _fused(X, phi, bias, alpha, op="mhc_coeffs")
    if k is not None:
        return k.mhc_coeffs_fwd(X, phi, bias, alpha, iters, eps, exact_rows)
    small = X.device.type == "cpu" and X.numel() // max(X.shape[-1], 1) <= _NUMPY_SINKHORN_ROWS and not tracing()
    return mhc_coeffs_ref(X, phi, bias, alpha, iters, eps, exact_rows, project=_sinkhorn_numpy if small else None)


#: up to this many stream rows (tokens × n) a CPU call runs Sinkhorn's normalisations in NumPy (decoding steps): its
#: 2·iters + 1 tiny divisions cost ~1 µs each there against ~4 µs as torch ops (20 iterations of one 4×4 matrix:
#: 86 µs against 221 µs; 2-core x86 VM, one thread, 2026-12-06). The same float32 operations in the same order.
_NUMPY_SINKHORN_ROWS = 256


def _sinkhorn_numpy(logits: torch.Tensor, iters: int, eps: float, exact_rows: bool = False) -> torch.Tensor:
    """:func:`~depthrewrite.kernels.mhc.reference.sinkhorn` of a small CPU tensor, its loop in NumPy (the reference
    itself when NumPy is missing or the dtype is not float32/float64)."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - torch without numpy
        np = None
    if np is None or logits.dtype not in (torch.float32, torch.float64):
        return sinkhorn(logits, iters, eps, exact_rows)
    total = np.add.reduce  # ndarray.sum's own Python wrapper costs ~0.5 µs a call, 40 calls here
    M = torch.softmax(logits, dim=-2).numpy()
    e = M.dtype.type(eps)
    M = M + e
    last = iters <= 1
    M = M / (total(M, -1, keepdims=True) + (M.dtype.type(0) if exact_rows and last else e))
    for i in range(iters - 1):
        M = M / (total(M, -2, keepdims=True) + e)
        M = M / (total(M, -1, keepdims=True) + (M.dtype.type(0) if exact_rows and i == iters - 2 else e))
    return torch.from_numpy(M)


@mhc_coeffs.register_fake
def _(X, phi, bias, alpha, iters, eps, exact_rows=False):
    acc = torch.promote_types(X.dtype, torch.float32)
    n = X.shape[-2]
    lead = X.shape[:-2]
    return X.new_empty((*lead, n), dtype=acc), X.new_empty((*lead, n), dtype=acc), X.new_empty((*lead, n, n), dtype=acc)


@torch.library.custom_op("depthrewrite::mhc_pre", mutates_args=())
def mhc_pre(X: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    k = _fused(X, pre, op="mhc_pre")
    if k is not None:
        return k.mhc_pre_fwd(X, pre)
    return mhc_pre_ref(X, pre)


@mhc_pre.register_fake
def _(X, pre):
    return X.new_empty(X.shape[:-2] + X.shape[-1:])


@torch.library.custom_op("depthrewrite::mhc_post", mutates_args=())
def mhc_post(X: torch.Tensor, res: torch.Tensor, post: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    k = _fused(X, res, post, y, op="mhc_post")
    if k is not None:
        return k.mhc_post_fwd(X, res, post, y)
    return mhc_post_ref(X, res, post, y)


@mhc_post.register_fake
def _(X, res, post, y):
    return torch.empty_like(X)


@torch.library.custom_op("depthrewrite::mhc_collapse", mutates_args=())
def mhc_collapse(X: torch.Tensor, mode: str) -> torch.Tensor:
    return mhc_collapse_ref(X, mode)


@mhc_collapse.register_fake
def _(X, mode):
    return X.new_empty(X.shape[:-2] + X.shape[-1:])


# ---------------------------------------------------------------------------------------------------------------
# Backward ops
# ---------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("depthrewrite::mhc_coeffs_backward", mutates_args=())
def mhc_coeffs_backward(
    X: torch.Tensor, phi: torch.Tensor, bias: torch.Tensor, alpha: torch.Tensor,
    gpre: torch.Tensor, gpost: torch.Tensor, gres: torch.Tensor, iters: int, eps: float, exact_rows: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad X, grad φ, grad bias, grad α) of :func:`mhc_coeffs` from the grads of (pre, post, res)."""
    k = _fused(X, phi, bias, alpha, gpre, gpost, gres, op="mhc_coeffs_backward")
    if k is not None:
        return k.mhc_coeffs_bwd(X, phi, bias, alpha, gpre, gpost, gres, iters, eps, exact_rows)
    return _coeffs_backward_ref(X, phi, bias, alpha, gpre, gpost, gres, iters, eps, exact_rows)


@mhc_coeffs_backward.register_fake
def _(X, phi, bias, alpha, gpre, gpost, gres, iters, eps, exact_rows=False):
    return torch.empty_like(X), torch.empty_like(phi), torch.empty_like(bias), torch.empty_like(alpha)


@torch.library.custom_op("depthrewrite::mhc_pre_backward", mutates_args=())
def mhc_pre_backward(X: torch.Tensor, pre: torch.Tensor, gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad X, grad pre) of :func:`mhc_pre` from the grad of u."""
    k = _fused(X, pre, gu, op="mhc_pre_backward")
    if k is not None:
        return k.mhc_pre_bwd(X, pre, gu)
    return _pre_backward_ref(X, pre, gu)


@mhc_pre_backward.register_fake
def _(X, pre, gu):
    return torch.empty_like(X), torch.empty_like(pre)


@torch.library.custom_op("depthrewrite::mhc_post_backward", mutates_args=())
def mhc_post_backward(
    X: torch.Tensor, res: torch.Tensor, post: torch.Tensor, y: torch.Tensor, gout: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad X, grad res, grad post, grad y) of :func:`mhc_post` from the grad of X'."""
    k = _fused(X, res, post, y, gout, op="mhc_post_backward")
    if k is not None:
        return k.mhc_post_bwd(X, res, post, y, gout)
    return _post_backward_ref(X, res, post, y, gout)


@mhc_post_backward.register_fake
def _(X, res, post, y, gout):
    return torch.empty_like(X), torch.empty_like(res), torch.empty_like(post), torch.empty_like(y)


# ---------------------------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------------------------


def _save_inputs(n_tensors: int):
    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:n_tensors])
        ctx.static = inputs[n_tensors:]

    return setup


def _need(ctx, grads: tuple) -> tuple:
    """The inputs' grads, None where an input does not require one."""
    return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad))


def _coeffs_bw(ctx, gpre, gpost, gres):
    X, phi, bias, alpha = ctx.saved_tensors
    iters, eps, *rest = ctx.static
    exact_rows = bool(rest[0]) if rest else False
    n, lead = X.shape[-2], X.shape[:-2]
    acc = torch.promote_types(X.dtype, torch.float32)
    z = lambda *s: X.new_zeros((*lead, *s), dtype=acc)  # noqa: E731 - an unused output's grad
    gpre = z(n) if gpre is None else gpre
    gpost = z(n) if gpost is None else gpost
    gres = z(n, n) if gres is None else gres
    grads = mhc_coeffs_backward(X, phi, bias, alpha, gpre, gpost, gres, iters, eps, exact_rows)
    return _need(ctx, grads) + (None,) * len(ctx.static)


def _pre_bw(ctx, gu):
    X, pre = ctx.saved_tensors
    return _need(ctx, mhc_pre_backward(X, pre, gu))


def _post_bw(ctx, gout):
    X, res, post, y = ctx.saved_tensors
    return _need(ctx, mhc_post_backward(X, res, post, y, gout))


def _collapse_bw(ctx, g):
    (X,) = ctx.saved_tensors
    with torch.enable_grad():
        leaf = X.detach().requires_grad_(True)
        (gx,) = torch.autograd.grad(mhc_collapse_ref(leaf, ctx.static[0]), [leaf], [g])
    return gx, None


mhc_coeffs.register_autograd(_coeffs_bw, setup_context=_save_inputs(4))
mhc_pre.register_autograd(_pre_bw, setup_context=_save_inputs(2))
mhc_post.register_autograd(_post_bw, setup_context=_save_inputs(4))
mhc_collapse.register_autograd(_collapse_bw, setup_context=_save_inputs(1))

_FALLS_BACK = (
    f"fp64 (or any dtype but fp32/bf16/fp16), n > {MAX_STREAMS} streams, empty tensors (and bf16 CPU tensors under "
    "Triton's interpreter): the PyTorch reference"
)

# op: (forward, backward, fuses, falls_back)
_KERNELS = {
    "mhc_coeffs": (
        "mhc_coeffs_fwd_kernel (token blocks of 64; tl.dot over K-chunks of n·D, φ columns padded 24 -> 32 for n=4)",
        "depthrewrite::mhc_coeffs_backward: mhc_coeffs_bwd_kernel_coef (recompute GEMM, σ and Sinkhorn on chip) + "
        "mhc_coeffs_bwd_kernel_x (grad X and per-segment grad φ partials; grad φ / bias / α partials summed with torch)",
        "RMS of the flattened n·D state, the [n·D, n²+2n] projection, σ / 2σ and the 20-step Sinkhorn in one read of X",
        _FALLS_BACK,
    ),
    "mhc_pre": (
        "mhc_pre_fwd_kernel (grid tokens × D-blocks)",
        "depthrewrite::mhc_pre_backward: mhc_pre_bwd_kernel (one pass over D per token block: grad X, grad pre)",
        "u = Σ_i H_pre[i]·X_i with one read of X (fp32 accumulation)",
        _FALLS_BACK,
    ),
    "mhc_post": (
        "mhc_post_fwd_kernel (grid tokens × D-blocks)",
        "depthrewrite::mhc_post_backward: mhc_post_bwd_kernel (one pass over D per token block: grad X, res, post, y)",
        "X' = H_res X + H_postᵀ y (stream mixing and the residual merge) with one read of X and y, one write of X'",
        _FALLS_BACK,
    ),
    "mhc_collapse": (
        "none: PyTorch reference (a mean or sum over the n streams)",
        "autograd through the reference",
        "nothing (one reduction over n; not worth a kernel)",
        "always (reference-only op)",
    ),
}
for _op, (_fwd, _bwd, _fuses, _falls) in _KERNELS.items():
    register_kernel_info(KernelInfo(f"depthrewrite::{_op}", _fwd, _bwd, _fuses, _falls))
