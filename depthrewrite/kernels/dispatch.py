"""Which implementation a registered depth op runs: the fused Triton kernel or the PyTorch reference.

Every op in ``depthrewrite/kernels/<op>/op.py`` asks :func:`use_triton` with its input tensors. The answer depends on
the kernel backend:

- ``"auto"`` (default): Triton when every tensor is on CUDA and Triton imports; the reference otherwise.
- ``"triton"``: always Triton. On CPU this needs ``TRITON_INTERPRET=1`` in the environment *before* the kernel
  modules are imported (the tests set it in ``tests/conftest.py``); otherwise a :class:`KernelError` says so.
- ``"reference"``: always the PyTorch reference (useful to bisect a numerical difference).

Set it with ``DEPTHREWRITE_KERNELS=auto|triton|reference``, :func:`set_kernel_backend`, or the
:func:`kernel_backend` context manager. Kernel modules also describe themselves with :func:`register_kernel_info`,
which is what ``depthrewrite.explain()`` prints.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..errors import ConfigError, KernelError

__all__ = [
    "BACKENDS",
    "KernelInfo",
    "get_kernel_backend",
    "set_kernel_backend",
    "kernel_backend",
    "use_triton",
    "triton_available",
    "interpreting",
    "register_kernel_info",
    "kernel_info",
]

BACKENDS = ("auto", "triton", "reference")
_backend = os.environ.get("DEPTHREWRITE_KERNELS", "auto")


def _check(mode: str) -> str:
    if mode not in BACKENDS:
        raise ConfigError(f"kernel backend {mode!r} is not one of {BACKENDS}; set DEPTHREWRITE_KERNELS to one of them")
    return mode


def get_kernel_backend() -> str:
    """The current kernel backend: ``"auto"``, ``"triton"`` or ``"reference"``."""
    return _check(_backend)


def set_kernel_backend(mode: str) -> None:
    """Set the kernel backend for every depth op (see the module docstring)."""
    global _backend
    _backend = _check(mode)


@contextlib.contextmanager
def kernel_backend(mode: str) -> Iterator[None]:
    """Run a block with another kernel backend, then restore the previous one."""
    global _backend
    old, _backend = _backend, _check(mode)
    try:
        yield
    finally:
        _backend = old


@functools.cache
def triton_available() -> bool:
    """Whether ``import triton`` works here."""
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "no Triton"
        return False
    return True


def interpreting() -> bool:
    """Whether Triton runs in interpreter mode (``TRITON_INTERPRET=1``): kernels execute on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(*tensors: torch.Tensor | None, op: str = "depth op") -> bool:
    """Whether the op named ``op`` should run its Triton kernel on these tensors (``None`` entries are ignored)."""
    mode = get_kernel_backend()
    if mode == "reference":
        return False
    ts = [t for t in tensors if t is not None]
    on_cuda = bool(ts) and all(t.is_cuda for t in ts)
    if mode == "auto":
        return on_cuda and triton_available()
    if not triton_available():
        raise KernelError(f"{op}: kernel backend 'triton' was requested, but triton does not import here")
    if not on_cuda and not interpreting():
        raise KernelError(
            f"{op}: kernel backend 'triton' was requested for CPU tensors; set TRITON_INTERPRET=1 before importing "
            "depthrewrite to run the kernels in Triton's interpreter, or use the 'auto' backend"
        )
    return True


@dataclass(frozen=True)
class KernelInfo:
    """What the fused implementation of one registered op does, for ``explain()`` and the docs.

    Attributes:
        op: the registered op, e.g. ``"depthrewrite::depth_attn"``.
        forward: the Triton kernel(s) the forward launches.
        backward: the Triton kernel(s) the backward launches (or how it is computed).
        fuses: one line: what the kernel does in one pass that the reference does in several.
        falls_back: when the op runs the PyTorch reference even on CUDA (empty if never).
    """

    op: str
    forward: str
    backward: str
    fuses: str
    falls_back: str = ""


_INFO: dict[str, KernelInfo] = {}


def register_kernel_info(info: KernelInfo) -> KernelInfo:
    """Record what the fused kernel of ``info.op`` does (called by each kernel module at import)."""
    _INFO[info.op] = info
    return info


def kernel_info() -> dict[str, KernelInfo]:
    """Every registered op's kernel description, by op name (imports all kernel modules first)."""
    from . import depth_attn, mhc, moda, msar  # noqa: F401  - importing registers them

    return dict(_INFO)
