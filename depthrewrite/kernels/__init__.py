"""Fused Triton kernels with their pure-PyTorch references (one folder per op).

Each op folder has the same shape (docs/kernels.md): ``reference.py`` (the op's one docstring and the PyTorch
reference), ``limits.py`` (the op's limits and its gate ``covers(...) -> None | str``; no Triton), ``fused.py`` (the
Triton kernels ``<op>_fwd_kernel`` / ``<op>_bwd_kernel_<what>`` and their launchers ``<op>_fwd`` / ``<op>_bwd``) and
``op.py`` (the registered ops, routed by :func:`.dispatch.route` with the gate).
"""

from __future__ import annotations

__all__ = ["all_kernel_info"]


def all_kernel_info():
    """Every registered op's :class:`~.dispatch.KernelInfo`, by op name, after importing every op package here."""
    import importlib
    import pkgutil

    from .dispatch import kernel_info

    for m in pkgutil.iter_modules(__path__):
        if m.ispkg:
            importlib.import_module(f"{__name__}.{m.name}")  # importing an op package registers it

    return kernel_info()
