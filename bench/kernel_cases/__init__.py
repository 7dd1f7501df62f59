"""Per-op benchmark cases for ``python -m bench.kernels``.

Each module here (``depth_attn.py``, ``msar.py``, ``mhc.py``, ``moda.py``) defines ``cases(device, dtype) -> list[Case]``
at realistic shapes. ``bench/kernels.py`` times every callable of every case side by side in one run.
"""

from __future__ import annotations

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
