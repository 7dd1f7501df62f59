"""Which implementation a registered depth op runs: the fused Triton kernel or the PyTorch reference.

Every op in ``depthrewrite/kernels/<op>/op.py`` asks :func:`use_triton` with its input tensors. The answer depends on
the kernel backend:

- ``"auto"`` (default): Triton when every tensor is on CUDA, Triton imports and every device the tensors are on is
  one the kernels were written for (:func:`triton_supported_device`): an NVIDIA GPU (``torch.version.hip is None``;
  ROCm was never tested) of compute capability 8.0 or newer (the mHC kernels use TF32 ``tl.dot`` and MoDA uses
  bf16/fp16 ``tl.dot``, which need sm_80+). The reference otherwise, including on older or AMD GPUs.
- ``"triton"``: always Triton (on any GPU: no capability check). On CPU this needs ``TRITON_INTERPRET=1`` in the
  environment *before* the kernel modules are imported (the tests set it in ``tests/conftest.py``); otherwise a
  :class:`KernelError` says so.
- ``"reference"``: always the PyTorch reference (useful to bisect a numerical difference).

:func:`decide` names the outcome for one call (``"triton"``, ``"triton-interpreter"`` or ``"reference"``); an op
runs its Triton kernel only if the call is also one the kernel covers, which includes :func:`kernel_dtypes_ok`
(fp32/bf16/fp16, and no bf16 on CPU: Triton's interpreter has no bf16) plus each op's own shape conditions.

Set it with ``DEPTHREWRITE_KERNELS=auto|triton|reference``, :func:`set_kernel_backend`, or the
:func:`kernel_backend` context manager. Kernel modules also describe themselves with :func:`register_kernel_info`,
which is what ``depthrewrite.explain()`` prints.

Every op routes a call with :func:`route`: the backend decision above, then the op's own gate ``covers(...)`` (in
``<op>/limits.py``, Triton-free), which returns ``None`` when the fused kernel takes the call and otherwise the
reason it does not. :func:`last_routes` keeps, per op, what its last call ran and why, for ``explain()``.

This module imports no op package (the op packages import it): the dependency is one-way.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
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
    "decide",
    "triton_supported_device",
    "KERNEL_DTYPES",
    "kernel_dtypes_ok",
    "triton_available",
    "interpreting",
    "register_kernel_info",
    "kernel_info",
    "backend_reason",
    "route",
    "Route",
    "last_routes",
    "dtype_reason",
    "would_fuse",
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


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    """Compute capability of CUDA device ``index`` (cached per device index)."""
    major, minor = torch.cuda.get_device_capability(index)
    return int(major), int(minor)


def triton_supported_device(device: torch.Tensor | torch.device | str | int) -> bool:
    """Whether the ``"auto"`` backend runs the Triton kernels on this device (a tensor's device, a device or a CUDA
    device index): an NVIDIA GPU (not ROCm) of compute capability >= 8.0. CPU and other devices: ``False``."""
    if isinstance(device, torch.Tensor):
        device = device.device
    if isinstance(device, int):
        index = device
    else:
        device = torch.device(device)
        if device.type != "cuda":
            return False
        index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.version.hip is not None:
        return False
    return _capability(index) >= (8, 0)


def decide(op: str, *tensors: torch.Tensor | None) -> str:
    """What the op named ``op`` runs on these tensors (``None`` entries are ignored), under the current backend:
    ``"triton"`` (compiled kernels), ``"triton-interpreter"`` (kernels in Triton's CPU interpreter, forced
    ``"triton"`` backend only) or ``"reference"``. Raises :class:`KernelError` when the ``"triton"`` backend is
    forced and cannot run (no Triton; CPU tensors without ``TRITON_INTERPRET=1``)."""
    mode = get_kernel_backend()
    if mode == "reference":
        return "reference"
    ts = [t for t in tensors if t is not None]
    on_cuda = bool(ts) and all(t.is_cuda for t in ts)
    if mode == "auto":
        if on_cuda and triton_available() and all(triton_supported_device(d) for d in {t.device for t in ts}):
            return "triton"
        return "reference"
    if not triton_available():
        raise KernelError(f"{op}: kernel backend 'triton' was requested, but triton does not import here")
    if on_cuda:
        return "triton"
    if not interpreting():
        raise KernelError(
            f"{op}: kernel backend 'triton' was requested for CPU tensors; set TRITON_INTERPRET=1 before importing "
            "depthrewrite to run the kernels in Triton's interpreter, or use the 'auto' backend"
        )
    return "triton-interpreter"


def use_triton(*tensors: torch.Tensor | None, op: str = "depth op") -> bool:
    """Whether the op named ``op`` should run its Triton kernel on these tensors (``None`` entries are ignored):
    :func:`decide` says ``"triton"`` or ``"triton-interpreter"``."""
    return decide(op, *tensors) != "reference"


KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kernel_dtypes_ok(*tensors: torch.Tensor | None) -> bool:
    """Whether every tensor (``None`` entries are ignored) has a dtype the kernels take: fp32, bf16 or fp16, and bf16
    only on CUDA (Triton's CPU interpreter has no bf16). fp64 and the rest run the reference (e.g. for gradcheck).
    The rule itself is :func:`dtype_reason`'s."""
    return dtype_reason(*tensors) is None


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
    """Every registered op's kernel description, by op name: the op packages imported so far (importing
    ``depthrewrite.kernels.<op>`` registers it; :func:`depthrewrite.kernels.all_kernel_info` imports every op package)."""
    return dict(_INFO)


def dtype_reason(*tensors: torch.Tensor | None, what: str = "inputs") -> str | None:
    """``None`` when every tensor (``None`` entries are ignored) has a kernel dtype (fp32/bf16/fp16; bf16 only on
    CUDA), else the reason (for the ops' ``covers``)."""
    ts = [t for t in tensors if t is not None]
    for t in ts:
        if t.dtype not in KERNEL_DTYPES:
            return f"{str(t.dtype).removeprefix('torch.')} {what} (the kernels take fp32/bf16/fp16)"
        if t.dtype == torch.bfloat16 and not t.is_cuda:
            return f"bf16 CPU {what} (Triton's interpreter has no bf16)"
    return None


def backend_reason(op: str, *tensors: torch.Tensor | None) -> str | None:
    """``None`` when :func:`decide` picks Triton for these tensors, else why it picks the reference (raises as
    :func:`decide` does when the forced ``"triton"`` backend cannot run)."""
    if decide(op, *tensors) != "reference":
        return None
    return _reference_reason(tensors)


def _reference_reason(tensors: tuple) -> str:
    """Why :func:`decide` picked the reference for these tensors (it did)."""
    mode = get_kernel_backend()
    if mode == "reference":
        return "kernel backend 'reference'"
    ts = [t for t in tensors if t is not None]
    if not ts or not all(t.is_cuda for t in ts):
        return "CPU tensors under the 'auto' backend (DEPTHREWRITE_KERNELS=triton with TRITON_INTERPRET=1 runs them)"
    if not triton_available():
        return "triton does not import"
    return "a GPU the kernels were not written for (ROCm, or compute capability below 8.0)"


@dataclass(frozen=True)
class Route:
    """What one call of a registered op ran: ``impl`` is ``"triton"``, ``"triton-interpreter"`` or ``"reference"``;
    ``reason`` says why it is the reference (``None`` when fused)."""

    impl: str
    reason: str | None = None


_ROUTES: dict[str, Route] = {}


class _Routed(Exception):  # noqa: N818 - control flow of would_fuse(), never seen outside it
    """Raised by :func:`route` while :func:`would_fuse` probes an op body: carries the routing decision."""

    def __init__(self, fused: bool) -> None:
        self.fused = fused


_state = threading.local()  # per thread: a probe in one thread must not change what another thread's calls run


def route(op: str, tensors: tuple, covers: Callable[[], str | None]) -> bool:
    """Whether the op named ``op`` runs its fused kernel on this call: the backend decision (:func:`decide` on
    ``tensors``), then the op's gate (``covers()``, evaluated only when the backend picks Triton). The outcome and
    the fallback reason are recorded for :func:`last_routes`."""
    how = decide(op, *tensors)
    why = _reference_reason(tensors) if how == "reference" else covers()
    if getattr(_state, "probing", False):
        raise _Routed(why is None)
    _ROUTES[op] = Route(how if why is None else "reference", why)
    return why is None


def would_fuse(body: Callable[..., object], *args: object, **kwargs: object) -> bool:
    """Whether calling the op body ``body`` (the Python function a ``torch.library.custom_op`` wraps) with these
    arguments would run its fused kernel: the body runs only up to its :func:`route` call, which answers here instead
    of returning (nothing is computed, nothing recorded). Works on fake tensors: routing reads devices, dtypes and
    shapes only. A body that never routes (a reference-only op) would not fuse; it must route before computing
    anything, as every op body here does."""
    old = getattr(_state, "probing", False)
    _state.probing = True
    try:
        body(*args, **kwargs)
    except _Routed as r:
        return r.fused
    finally:
        _state.probing = old
    return False


def last_routes() -> dict[str, Route]:
    """Per op name, what its last call in this process ran and why (see :func:`route`)."""
    return dict(_ROUTES)
