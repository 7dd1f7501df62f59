"""Limits and the coverage gate of ``depthrewrite::moda_attn`` (plain Python: no Triton; read by ``op.py`` and
``fused.py``). The op itself is documented once, in :mod:`.reference`."""

from __future__ import annotations

import torch

from .._triton_utils import pow2
from ..dispatch import dtype_reason, interpreting

__all__ = ["MAX_HEAD_DIM", "covers", "block_config"]

MAX_HEAD_DIM = 256  # head dims are padded to a power of two; larger runs the reference


def covers(q, k, v, attn_mask, depth_k, depth_v, depth_weight, dropout_p) -> str | None:
    """``None`` when the fused kernel takes this ``moda_attn`` call, else the reason it runs the reference.

    Covered: fp32/bf16/fp16 with q, k, v, depth_k, depth_v of one dtype (bf16 only on CUDA: Triton's interpreter
    has no bf16), Hq a multiple of Hk, query/key and value head dims <= 256 (each padded to a power of two with
    masks; they may differ, as in MLA), n >= 1 depth slots, non-empty T and S, no mask or a boolean / floating mask
    broadcastable to ``[B, Hq, T, S]``, ``dropout_p == 0``.
    """
    if dropout_p > 0.0:  # the reference's dropout masks come from torch.rand with a seed; a kernel cannot match them
        return f"dropout_p={dropout_p} > 0 (seeded torch.rand masks)"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or depth_k.dim() != 5 or depth_v.dim() != 5:
        return "q/k/v not 4-d or depth slots not 5-d"
    why = dtype_reason(q)
    if why:
        return why
    if any(t.dtype != q.dtype for t in (k, v, depth_k, depth_v)):
        return "mixed input dtypes"
    B, Hq, T, d = q.shape
    Hk, S, dv = k.shape[1], k.shape[2], v.shape[3]
    if Hk == 0 or Hq % Hk:
        return f"Hq={Hq} not a multiple of Hk={Hk}"
    if max(d, dv) > MAX_HEAD_DIM:
        return f"head dim {max(d, dv)} > MAX_HEAD_DIM={MAX_HEAD_DIM}"
    if min(B, T, S, d, dv) == 0:
        return "empty input"
    if v.shape[:3] != k.shape[:3] or k.shape[0] != B or k.shape[3] != d:
        return "k/v shapes do not match q"
    n = depth_k.shape[2]
    if n < 1 or depth_k.shape != (B, T, n, Hk, d) or depth_v.shape != (B, T, n, Hk, dv):
        return "depth slots not [B, T, n >= 1, Hk, d] (keys) and [B, T, n, Hk, dv] (values)"
    if depth_weight is not None and (depth_weight.shape != (Hq,) or not depth_weight.is_floating_point()):
        return "depth_weight not a float [Hq] tensor"
    if attn_mask is not None:
        if not (attn_mask.dtype == torch.bool or attn_mask.is_floating_point()) or attn_mask.dim() > 4:
            return "mask neither bool nor floating, or more than 4-d"
        try:
            shape = torch.broadcast_shapes(attn_mask.shape, (B, Hq, T, S))
        except RuntimeError:
            shape = None
        if shape != (B, Hq, T, S):
            return f"mask {tuple(attn_mask.shape)} does not broadcast to [B, Hq, T, S]"
    return None


# (rows, bn, warps, stages) per kernel, by the largest padded head dim BD they serve. Each table was checked with
# `python -m bench.aot --op moda` (ptxas -v, Triton 3.8) for the arch it names; comments give the spills of the tiles
# they replace.
_INTERPRETER_TILES = dict(fwd=(16, 16, 4, 1), dq=(16, 16, 4, 1), kv=(16, 16, 4, 1))
_FP32_TILES = (  # sm_90 (no tensor cores with input_precision="ieee": the dots run on FMA units)
    # was fwd (64, 32, 8, 2): 4 B, kv (32, 32, 8, 2): 12 B
    (64, dict(fwd=(32, 32, 8, 2), dq=(32, 32, 8, 2), kv=(16, 32, 8, 2))),
    # was fwd (32, 32, 8, 2): up to 616 B, dq (16, 32, 8, 2): 8 B, kv (16, 16, 4, 2): up to 696 B
    (128, dict(fwd=(16, 32, 8, 2), dq=(16, 16, 8, 2), kv=(16, 16, 8, 2))),
    (MAX_HEAD_DIM, dict(fwd=(16, 16, 8, 2), dq=(16, 16, 8, 2), kv=(16, 16, 8, 2))),
)
_FP32_TILES_SM80 = (
    # was fwd (64, 32, 8, 2): 8 B, dq (32, 32, 8, 2): 20-32 B
    (64, dict(fwd=(32, 32, 4, 2), dq=(16, 32, 8, 2), kv=(16, 32, 8, 2))),
    # was fwd (32, 32, 8, 2): 4 B, dq (16, 32, 8, 2): 8 B, kv (16, 16, 4, 2): up to 668 B
    (128, dict(fwd=(16, 32, 4, 2), dq=(16, 16, 8, 2), kv=(16, 16, 8, 2))),
    (MAX_HEAD_DIM, dict(fwd=(16, 16, 8, 2), dq=(16, 16, 8, 2), kv=(16, 16, 8, 2))),
)
_HALF_TILES = (  # sm_90: no spills at d <= 128
    (64, dict(fwd=(128, 64, 8, 3), dq=(64, 64, 4, 2), kv=(64, 64, 4, 2))),
    (128, dict(fwd=(128, 64, 8, 2), dq=(32, 64, 8, 2), kv=(64, 32, 8, 2))),
    (MAX_HEAD_DIM, dict(fwd=(64, 32, 8, 2), dq=(32, 32, 8, 2), kv=(32, 32, 8, 2))),
)
_HALF_TILES_SM80 = (  # sm_80 (mma.sync: accumulators in registers): the sm_90 tiles spilled 20-52 B (dq/kv at d = 64
    # on 4 warps, fwd at d = 128 with keys of 64); here with the same tiles on 8 warps, and fwd keys of 32 at d = 128
    (64, dict(fwd=(128, 64, 8, 3), dq=(64, 64, 8, 2), kv=(64, 32, 8, 2))),
    (128, dict(fwd=(128, 32, 8, 2), dq=(32, 64, 8, 2), kv=(64, 32, 8, 2))),
    (MAX_HEAD_DIM, dict(fwd=(64, 32, 8, 2), dq=(32, 32, 8, 2), kv=(32, 32, 8, 2))),
)


def block_config(G: int, d: int, dtype: torch.dtype, arch: int = 9, dv: int | None = None) -> dict[str, int]:
    """Block sizes and warps for head dim ``d`` (queries and keys), value head dim ``dv`` (default ``d``; MLA's is
    narrower), group size ``G`` and compute capability major ``arch`` (8: sm_80's table for fp16/bf16; 9 and above:
    Hopper's; tiny under the interpreter). The tiles are those of the larger of the two padded head dims.

    Returns a dict: ``GP`` (G rounded up to a power of two), ``BD`` (head dim padded to a power of two, >= 16),
    ``BDV`` (the same for the value head dim) and, per
    kernel (prefix ``fwd_``, ``dq_``, ``kv_``), ``rows`` (folded query rows per tile: ``rows / GP`` tokens × GP heads),
    ``bn`` (sequence keys per tile), ``warps`` and ``stages``. Chosen so that an AOT compile of every kernel for its
    arch (strides of 1 specialised, as the JIT does; ``bench.aot``) shows no register spills at d <= 128; fp32 (no
    tensor cores with ``input_precision="ieee"``) is the correctness path, with smaller tiles, not the fast one.
    """
    GP = pow2(G)
    BD = max(16, pow2(d))
    BDV = BD if dv is None else max(16, pow2(dv))
    if interpreting():
        c = _INTERPRETER_TILES
    else:
        if dtype == torch.float32:
            table = _FP32_TILES_SM80 if arch < 9 else _FP32_TILES
        else:
            table = _HALF_TILES_SM80 if arch < 9 else _HALF_TILES
        c = next((tiles for limit, tiles in table if max(BD, BDV) <= limit), table[-1][1])
    out = dict(GP=GP, BD=BD, BDV=BDV)
    for k, (rows, bn, warps, stages) in c.items():
        rows = max(rows, GP)  # at least one token per tile
        out.update({f"{k}_rows": rows, f"{k}_BMT": rows // GP, f"{k}_BN": bn, f"{k}_warps": warps, f"{k}_stages": stages})
    return out
