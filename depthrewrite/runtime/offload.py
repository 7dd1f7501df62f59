"""accelerate's offloading on a converted model (``cpu_offload``, ``disk_offload``, a ``device_map`` with offloaded
weights).

accelerate keeps an offloaded module's weights on the meta device and loads them in the module's own forward (its
``AlignDevicesHook``, installed as a forward set on the instance), putting them back after. A converted model calls
the modules its scheme leaves intact as live modules, so those load their weights as on the original. What its graphs
read directly (the depth-mixing parameters in ``model.depthrewrite``, a module whose computation the rewrite changed)
is loaded by the same hooks around the whole call (:func:`loaded`), and a capture loads every offloaded module once
while it traces (its graph checks run the model eagerly): a capture's peak memory is the whole model's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["accelerate_hooks", "loaded", "offload_hooks", "offloaded_reads"]


def accelerate_hooks(module: nn.Module) -> tuple:
    """The hooks accelerate put on ``module`` itself (its ``_hf_hook``; a ``SequentialHook`` chains several)."""
    hook = module.__dict__.get("_hf_hook")
    return () if hook is None else tuple(getattr(hook, "hooks", (hook,)))


def offload_hooks(model: nn.Module) -> list[tuple[str, nn.Module, Any]]:
    """``(path, module, hook)`` for every submodule whose accelerate hook offloads its weights (``AlignDevicesHook``
    with ``offload=True``)."""
    return [(n, m, h) for n, m in model.named_modules() for h in accelerate_hooks(m)
            if getattr(h, "offload", False) is True]


def offloaded_reads(model: nn.Module, reads: set[str]) -> tuple[tuple[str, nn.Module, Any], ...]:
    """The offloaded modules (:func:`offload_hooks`) one of whose parameters or buffers is in ``reads`` (paths the
    graphs read with ``get_attr``, outside any module call)."""
    hooks = offload_hooks(model)
    if not hooks:
        return ()
    owners = {p.rpartition(".")[0] for p in reads}
    return tuple((n, m, h) for n, m, h in hooks if n in owners
                 or (getattr(h, "place_submodules", False) and any(o == n or o.startswith(n + ".") for o in owners)))


@contextlib.contextmanager
def loaded(hooks: list[tuple[str, nn.Module, Any]]) -> Iterator[None]:
    """Load the weights of each ``(path, module, hook)`` onto its execution device with its own hook (what its forward
    does first) and offload them again after (what its forward does last)."""
    done: list[tuple[nn.Module, Any]] = []
    try:
        for _, m, h in hooks:
            h.pre_forward(m)
            done.append((m, h))
        yield
    finally:
        for m, h in reversed(done):
            h.post_forward(m, None)
