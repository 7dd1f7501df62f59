"""Per-op benchmark cases for ``python -m bench.kernels``.

Each module here (``depth_attn.py``, ``msar.py``, ``mhc.py``, ``moda.py``) defines ``cases(device, dtype) -> list[Case]``
at realistic shapes. ``bench/kernels.py`` times every callable of every case side by side in one run.

The shapes are data: each module also defines ``rows(scale) -> list[Row]`` (``"bench"``: the shapes ``cases`` times;
``"aot"``: the shapes and constexpr branches ``python -m bench.aot`` compiles; ``"test"``: small shapes, one stressed
axis each, for ``tests/kernels/test_parity.py``) and ``call(row, device, dtype, seed) -> Call`` (the registered op on
random inputs with every parameter random). ``cases`` iterates ``rows("bench")`` (MoDA's keeps its own CPU shrink).
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Case:
    """One op at one shape.

    Attributes:
        op: the op name, e.g. ``"depth_attn"``.
        shape: a short human description of the shape, e.g. ``"T=16384 d=4096 K=9"``.
        impls: name -> zero-argument callable running the *forward*; names used: ``"fused"`` (our Triton kernel),
            ``"reference"`` (eager PyTorch reference), ``"compiled-reference"`` (filled in by bench/kernels.py when
            absent), and peers such as ``"liger"`` / ``"fla"`` / ``"sdpa-flash"`` when importable.
        impls_bwd: name -> zero-argument callable running forward *and* backward (same names; may be partial).
        bytes: the minimum bytes a single-pass forward must move (inputs read once + outputs written once); 0 if the
            op is compute-bound and FLOPs are the better measure.
        bytes_bwd: the same for forward+backward (0 if not stated).
        flops: forward FLOPs (0 if memory-bound).
        flops_bwd: forward+backward FLOPs (0 if not stated).
        note: anything a reader of the results needs (fallbacks, peer semantics that differ).
    """

    op: str
    shape: str
    impls: dict[str, Callable[[], object]]
    impls_bwd: dict[str, Callable[[], object]] = field(default_factory=dict)
    bytes: int = 0
    bytes_bwd: int = 0
    flops: int = 0
    flops_bwd: int = 0
    note: str = ""


@dataclass(frozen=True)
class Row:
    """One shape of one registered op, as data: the bench (``scale="bench"``) and the parity tests / AOT compile
    check (``scale="test"``, ``scale="aot"``) draw from the same per-op builders (``<op module>.rows`` and
    ``<op module>.call``).

    Attributes:
        op: the registered op, e.g. ``"depth_attn"`` (``torch.ops.depthrewrite.<op>``).
        dims: the shape values, e.g. ``{"T": 7, "D": 24, "K": 3}``; the builder reads them by name.
        stresses: which axis this row stresses (odd sizes, K = 1, T not a multiple of the tile, many sources, ...).
    """

    op: str
    dims: tuple[tuple[str, object], ...]
    stresses: str = ""

    @property
    def d(self) -> dict[str, object]:
        return dict(self.dims)

    @property
    def id(self) -> str:
        return self.op + "-" + "-".join(f"{k}{v}" for k, v in self.dims)


def row(op: str, stresses: str = "", **dims) -> Row:
    return Row(op, tuple(dims.items()), stresses)


@dataclass
class Call:
    """A registered op applied to concrete inputs: ``fn(*tensors)`` returns the output (a tensor or a tuple);
    ``tensors`` holds every tensor input (the differentiable ones with ``requires_grad``); ``grads`` are the output
    gradients to back-propagate (one per output)."""

    fn: Callable[..., object]
    tensors: list
    grads: list


def randn(g, *shape, device, dtype, scale: float = 1.0, shift: float = 0.0, grad: bool = True):
    """A random tensor from the CPU generator ``g`` (device-independent values), moved to ``device``/``dtype``."""
    import torch

    t = (torch.randn(tuple(shape), generator=g) * scale + shift).to(device=device, dtype=dtype)
    return t.requires_grad_(grad)


#: every op with a case module here (``bench/kernel_cases/<op>.py``), found on disk: a new op's module is picked up by
#: the benchmark, the parity test and the AOT check without a list to edit
OPS: tuple[str, ...] = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")))
