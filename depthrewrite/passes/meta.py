"""Our node metadata lives under one key, ``node.meta["depthrewrite"]``; new nodes inherit ``nn_module_stack`` and
``stack_trace`` from the node whose role they take, so module-path based splits stay correct."""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

__all__ = ["META_KEY", "NodeRole", "inherit_meta"]

META_KEY = "depthrewrite"


@dataclass(frozen=True)
class NodeRole:
    role: str  # mix, partial_sum, source_sum (AttnRes/MSAR); expand, mhc_pre, mhc_state, collapse (mHC);
    #            moda_attn, kv_proj (MoDA)
    site: int | str
    scheme: str


def inherit_meta(new: fx.Node, old: fx.Node, role: NodeRole | None = None, val_from: fx.Node | None = None) -> None:
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in old.meta:
            new.meta[key] = old.meta[key]
    src = val_from if val_from is not None else old
    for key in ("val", "example_value", "tensor_meta"):
        if key in src.meta:
            new.meta[key] = src.meta[key]
    if role is not None:
        new.meta[META_KEY] = role
