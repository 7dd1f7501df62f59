"""Limits, tile choices and the coverage gates of the depth-attention ops (plain Python: no Triton; read by
``op.py`` and ``fused.py``). The ops themselves are documented once, in :mod:`.reference`."""

from __future__ import annotations

import torch

from .._triton_utils import pow2, warps_for
from ..dispatch import dtype_reason

__all__ = ["MAX_SOURCES", "MAX_ROW", "covers", "covers_merge", "row_config", "row_sources", "chunk_config"]

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


def row_sources(K: int, bt: int, bd: int, num_warps: int, elt: int) -> int:
    """Sources per launch of the whole-row forward (``K`` sources, ``[bt, bd]`` tiles, inputs of ``elt`` bytes).

    The compiler issues every source's row load up front (the sources are a ``static_range``), so a launch keeps
    ``NSRC`` rows in registers: ``bd·bt / threads`` registers per fp32 row and thread, half that for fp16/bf16.
    They get about 144 registers at 8 warps or fewer (255 per thread), 64 at 16 (128 per thread); more sources
    run as further launches of at most that many (the ``FIRST``/``LAST`` chunks, fp32 running state in scratch).
    ptxas -v: fp32 ``bd = 8192`` with 9 sources per launch spilled 4.5 KB; ``bd = 4096`` (9 × 16 registers) is clean.
    Chunks are balanced (9 sources at 4 per launch run as 3 × 3). fp16/bf16 rows stay in one launch: at ``bd = 8192``
    they spill 4 B (``bench.aot.SPILL_TOLERANCE``), less than a further launch through scratch would cost.
    """
    if elt < 4:
        return min(K, MAX_SOURCES)
    per = max(1, bt * bd // (32 * num_warps) * min(elt, 4) // 4)
    budget = (144 if elt >= 4 else 128) if num_warps <= 8 else 64
    cap = max(1, min(MAX_SOURCES, budget // per))
    n = -(-K // cap)
    return -(-K // n)


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
    # ptxas -v: the backward spills 4 B in a few configs (S > 1 at BT = 2/4 half types, fp32 S = 1 on 4 warps at
    # sm_80); BT = 1 or 8 warps remove that but cost more than a 4-byte spill (bench.aot.SPILL_TOLERANCE)
    return sp, kp, bt, bdc, warps_for(sp * bt * bdc)
