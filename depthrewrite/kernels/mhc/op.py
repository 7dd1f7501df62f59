"""``depthrewrite::mhc_coeffs``, ``mhc_pre``, ``mhc_post``, ``mhc_collapse``: the mHC site as registered ops
(PyTorch references now; the fused kernels plug in here). Backward recomputes from the saved inputs."""

from __future__ import annotations

import torch

from .reference import mhc_coeffs_ref, mhc_collapse_ref, mhc_post_ref, mhc_pre_ref

__all__ = ["mhc_coeffs", "mhc_pre", "mhc_post", "mhc_collapse"]


def _recompute_backward(ref, n_tensors: int, n_static: int):
    """An autograd backward that re-runs ``ref`` on the saved tensor inputs (the first ``n_tensors`` arguments)."""

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:n_tensors])
        ctx.static = inputs[n_tensors:]

    def backward(ctx, *grads):
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in ctx.saved_tensors]
            out = ref(*leaves, *ctx.static)
            outs = out if isinstance(out, tuple) else (out,)
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
            diff = [t for t in leaves if t.requires_grad]
            got = torch.autograd.grad([o for o, _ in pairs], diff, [g for _, g in pairs], allow_unused=True)
        it = iter(got)
        return tuple(next(it) if t.requires_grad else None for t in leaves) + (None,) * n_static

    return backward, setup


@torch.library.custom_op("depthrewrite::mhc_coeffs", mutates_args=())
def mhc_coeffs(
    X: torch.Tensor, phi: torch.Tensor, bias: torch.Tensor, alpha: torch.Tensor, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return mhc_coeffs_ref(X, phi, bias, alpha, iters, eps)


@mhc_coeffs.register_fake
def _(X, phi, bias, alpha, iters, eps):
    acc = torch.promote_types(X.dtype, torch.float32)
    n = X.shape[-2]
    lead = X.shape[:-2]
    return X.new_empty((*lead, n), dtype=acc), X.new_empty((*lead, n), dtype=acc), X.new_empty((*lead, n, n), dtype=acc)


@torch.library.custom_op("depthrewrite::mhc_pre", mutates_args=())
def mhc_pre(X: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return mhc_pre_ref(X, pre)


@mhc_pre.register_fake
def _(X, pre):
    return X.new_empty(X.shape[:-2] + X.shape[-1:])


@torch.library.custom_op("depthrewrite::mhc_post", mutates_args=())
def mhc_post(X: torch.Tensor, res: torch.Tensor, post: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
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


for _op, _ref, _nt, _ns in (
    (mhc_coeffs, mhc_coeffs_ref, 4, 2),
    (mhc_pre, mhc_pre_ref, 2, 0),
    (mhc_post, mhc_post_ref, 4, 0),
    (mhc_collapse, mhc_collapse_ref, 1, 1),
):
    _bw, _setup = _recompute_backward(_ref, _nt, _ns)
    _op.register_autograd(_bw, setup_context=_setup)
