"""Limits, tile choices and the coverage gate of the mHC ops (plain Python: no Triton; read by ``op.py`` and
``fused.py``). The ops themselves are documented once, in :mod:`.reference`."""

from __future__ import annotations

import torch

from .._triton_utils import num_sms, pow2
from ..dispatch import dtype_reason

__all__ = ["MAX_STREAMS", "SEG", "covers", "coeff_layout", "coeff_blocks", "coeff_x_blocks", "apply_blocks"]

MAX_STREAMS = 8  # the coefficient kernels keep [BT, NP, NP] Sinkhorn tiles in registers; n > 8 falls back
SEG = 4  # Sinkhorn backward: pairs of normalisations per recomputation segment


def covers(X: torch.Tensor, *tensors: torch.Tensor) -> str | None:
    """``None`` when the fused kernels take this call of an mHC op (``X`` the ``[..., n, D]`` state, ``tensors`` the
    op's other tensor arguments), else the reason it runs the reference: fp32/bf16/fp16 tensors (no bf16 CPU tensor
    under Triton's interpreter), ``1 <= n <= MAX_STREAMS``, no empty tensor."""
    n = X.shape[-2]
    if not 1 <= n <= MAX_STREAMS:
        return f"n={n} streams not in 1..MAX_STREAMS={MAX_STREAMS}"
    if any(t.numel() == 0 for t in (X, *tensors)):
        return "empty tensor"
    return dtype_reason(X, *tensors)


def coeff_layout(n: int) -> tuple[int, int]:
    """(PP, NP): padded pre/post width and padded Sinkhorn side of the coefficient kernels."""
    return max(16, pow2(2 * n)), max(4, pow2(n))


def coeff_blocks(T: int, n: int, device: torch.device) -> tuple[int, int]:
    """(BT, BK) for the coefficient kernels: 64 tokens per program unless that leaves the GPU under-filled, 16 for
    n > 4 (the Sinkhorn backward keeps about ten [BT, NP, NP] fp32 tiles live; NP = 8 there)."""
    BT = 64 if -(-T // 64) >= num_sms(device) else 32
    if T <= 16 or n > 4:
        BT = 16
    return BT, 64


def coeff_x_blocks(device: torch.device) -> tuple[int, int, int, int]:
    """(BT, BK, num_warps, num_stages) of the coefficient backward's grad-X kernel (``[BT, BK]`` slices of X).

    sm_90 (and the interpreter): ``[32, 128]`` on 8 warps, 2 stages (156-194 registers, no spills, ptxas -v). sm_80
    spilled 96-384 B at 255 registers with that tile (presumably its ``mma`` accumulators in registers; sm_90
    compiles the dots differently), so below sm_90 the K-chunk is halved to 64.
    """
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        return 32, 64, 8, 2
    return 32, 128, 8, 2


def apply_blocks(T: int, D: int, n: int) -> tuple[int, int, int]:
    """(NP, BT, BD) for the apply kernels: tiles of about 4096 elements of X ([BT, NP, BD])."""
    NP = pow2(n)
    BD = min(pow2(D), max(64, 4096 // NP))
    BT = max(1, min(pow2(T), 4096 // (NP * BD)))
    return NP, BT, BD
