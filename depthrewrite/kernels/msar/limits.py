"""Limits, default tiles and the coverage gate of ``depthrewrite::msar_mix`` (plain Python: no Triton; read by
``op.py`` and ``fused.py``). The op itself is documented once, in :mod:`.reference`."""

from __future__ import annotations

import torch

from ..dispatch import dtype_reason

__all__ = ["MAX_SOURCES", "MAX_STREAMS", "MAX_KERNEL", "FWD_TILES", "BWD_TILES", "grad_tiles", "stats_tiles", "covers"]

MAX_SOURCES = 16  # sources per launch (one tuple argument, selected at run time); more fall back to the reference
MAX_STREAMS = 4  # m <= 4 (three conv streams, explicit variables in the kernels)
MAX_KERNEL = 16  # k_r <= 16 taps

# Default tiles (and the interpreter's). On a GPU the forward uses them and compiles without register spills for K = 9,
# m = 4, k = (4, 8, 12) on sm_80 and sm_90 (ptxas -v; up to 255 registers); the backward's kernels take their GPU
# tiles from stats_tiles and grad_tiles (ext_t = 64 spills 1.2 KB).
FWD_TILES = dict(block_t=16, block_d=32, num_warps=8)
BWD_TILES = dict(block_t=16, block_d=32, ext_t=32, block_d2=16, num_warps=8)


def grad_tiles(device: torch.device) -> tuple[int, int, int]:
    """(block_d2, num_warps, num_stages) of the backward's grad kernel when the caller gives no ``block_d2``:
    ``BWD_TILES`` under the interpreter; on a GPU 8 columns per program: 16 spilled 16-244 B at 255 registers on
    sm_80 and sm_90 (ptxas -v), 8 is clean except sm_80 with the sigmoid mixer (124 B; 4 columns on 4 warps: 164 B,
    one stage: 124 B, ext_t = 16: 228 B, so that one is left as it is)."""
    if device.type != "cuda":
        return BWD_TILES["block_d2"], BWD_TILES["num_warps"], 3
    return 8, BWD_TILES["num_warps"], 3


def stats_tiles(device: torch.device, sigmoid: bool) -> tuple[int, int]:
    """(block_t, block_d) of the backward's stats kernel when the caller gives none: ``BWD_TILES``, except 16
    columns with the sigmoid mixer at sm_90 (32 spilled 12 B there in bf16 at 255 registers; 16 is clean at 237, all
    dtypes, ptxas -v). Without the mixer 32 columns stay (180 registers; 16 columns or 8 tokens made ptxas settle
    on 128 registers and spill 16-20 B)."""
    if sigmoid and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9:
        return BWD_TILES["block_t"], 16
    return BWD_TILES["block_t"], BWD_TILES["block_d"]


def covers(sources: list[torch.Tensor], query: torch.Tensor, conv: list[torch.Tensor],
           count: int | None = None) -> str | None:
    """``None`` when the fused kernels take this ``msar_mix`` (or ``msar_mix_backward``) call, else the reason it
    runs the reference (cheap shape/dtype checks). ``count``: how many sources there are when ``sources`` lists only
    some of them, one of each shape (a stacked call: one row of the stack and the extra sources; the stack's row
    count may be a dynamic size, which a list of its rows would fix)."""
    K, m = len(sources) if count is None else count, query.shape[0]
    if not 1 <= K <= MAX_SOURCES:
        return f"K={K} sources not in 1..MAX_SOURCES={MAX_SOURCES}"
    if not 1 <= m <= MAX_STREAMS:
        return f"m={m} streams not in 1..MAX_STREAMS={MAX_STREAMS}"
    if len(conv) != m - 1:
        return f"len(conv)={len(conv)} != m-1={m - 1}"
    for w in conv:
        if not 1 <= w.shape[-1] <= MAX_KERNEL:
            return f"conv filter of {w.shape[-1]} taps not in 1..MAX_KERNEL={MAX_KERNEL}"
    s0 = sources[0]
    if s0.dim() < 2:
        return "sources not [..., T, D]"
    why = dtype_reason(s0, what="sources")
    if why:
        return why
    if s0.numel() == 0:
        return "empty sources"
    if any(s.shape != s0.shape or s.dtype != s0.dtype or s.device != s0.device for s in sources):
        return "sources of different shapes, dtypes or devices"
    return None
