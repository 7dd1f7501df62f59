"""Limits, tile choices and the coverage gates of the depth-attention ops (plain Python: no Triton; read by
``op.py`` and ``fused.py``). The ops themselves are documented once, in :mod:`.reference`."""

from __future__ import annotations

import torch

from .._triton_utils import pow2, warps_for
from ..dispatch import dtype_reason

__all__ = ["MAX_SOURCES", "MAX_ROW", "covers", "covers_merge", "row_config", "chunk_config"]

MAX_SOURCES = 16  # sources per kernel launch (one tuple argument); more run as chunks of this many (still fused)
MAX_ROW = 16384  # largest D of the whole-row kernels (depth_attn forward, merge)


def covers(sources, query, gain, *more, whole_row: bool = False) -> str | None:
    """``None`` when the fused kernels take this ``depth_attn`` / ``depth_attn_partial`` call (or their backward;
    ``more``: the incoming gradients), else the reason it runs the reference. ``whole_row``: the kernel keeps a
    whole row on chip (the ``depth_attn`` forward), so ``D <= MAX_ROW``. Any number of sources is fused."""
    why = dtype_reason(sources[0], what="sources")
    if why:
        return why
    if any(t.dtype != sources[0].dtype for t in sources):
        return "sources of different dtypes"
    why = dtype_reason(query, gain, *more, what="query/gain/gradients")
    if why:
        return why
    if whole_row and sources[0].shape[-1] > MAX_ROW:
        return f"D={sources[0].shape[-1]} > MAX_ROW={MAX_ROW} (whole-row kernel)"
    return None


def covers_merge(o, lse, last, query, gain, *more) -> str | None:
    """``None`` when the fused kernels take this ``depth_attn_merge`` call (or its backward; ``more``: the incoming
    gradient), else the reason it runs the reference."""
    why = dtype_reason(last, what="last source")
    if why:
        return why
    if o.dtype != torch.float32 or lse.dtype != torch.float32:
        return "o / lse not fp32"
    why = dtype_reason(query, gain, *more, what="query/gain/gradient")
    if why:
        return why
    if last.shape[-1] > MAX_ROW:
        return f"D={last.shape[-1]} > MAX_ROW={MAX_ROW} (whole-row kernel)"
    return None


def row_config(device: torch.device, D: int) -> tuple[int, int, int]:
    """(BT, BD, num_warps) of the whole-row kernels."""
    bd = pow2(D)
    bt = max(1, min(16, 2048 // bd)) if device.type == "cuda" else 2
    return bt, bd, warps_for(bt * bd)


def chunk_config(device: torch.device, S: int, K: int, D: int, T: int, elt: int) -> tuple[int, int, int, int, int]:
    """(SP, KP, BT, BDC, num_warps) of the D-chunked kernels.

    ``BT`` keeps one program's token block (``BT·K·D·elt`` bytes, read twice) small enough to stay in L2 between the
    two passes; ``BDC`` keeps the ``[SP, BT, BDC]`` fp32 tiles at about 4096 elements.
    """
    sp, kp = pow2(S), pow2(K)
    if device.type != "cuda":  # the interpreter: tiny blocks, so that small tests exercise every loop and mask
        return sp, kp, 2, 16, 4
    bt = 1
    while bt < 16 and bt * 2 * K * D * elt <= 128 * 1024 and bt * 2 <= pow2(T):
        bt *= 2
    bdc = max(16, min(pow2(D), 4096 // (sp * bt), 1024))
    return sp, kp, bt, bdc, warps_for(sp * bt * bdc)
