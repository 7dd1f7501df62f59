"""Host-side launch helpers shared by the ``fused.py`` kernel modules and the ``limits.py`` files (plain Python: no
triton import, so the limits and the gates stay importable without Triton)."""

from __future__ import annotations

import torch

__all__ = ["pow2", "num_sms", "warps_for", "persistent_programs", "flat_rows", "acc_dtype", "dot_precision"]


def pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``); equals ``triton.next_power_of_2(n)`` for ``n >= 1``."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def num_sms(device: torch.device, cpu: int = 2) -> int:
    """Multiprocessors of a CUDA device; ``cpu`` (a small stand-in) under Triton's CPU interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return cpu


def warps_for(elems: int) -> int:
    """``num_warps`` for a program whose largest fp32 tile has ``elems`` elements: 4 up to 2048, 8 up to 8192, else
    16."""
    return 4 if elems <= 2048 else 8 if elems <= 8192 else 16


def persistent_programs(device: torch.device, n_tiles: int, per_sm: int = 4) -> int:
    """Grid size of a persistent kernel over ``n_tiles`` tiles: ``per_sm`` programs per multiprocessor (2 programs in
    all under the interpreter), never more than the tiles."""
    if device.type == "cuda":
        return max(1, min(n_tiles, per_sm * num_sms(device)))
    return max(1, min(n_tiles, 2))


def flat_rows(t: torch.Tensor, D: int) -> torch.Tensor:
    """``t`` as a contiguous ``[rows, D]`` matrix (a view when ``t`` is contiguous)."""
    return t.contiguous().view(-1, D)


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """The accumulation dtype of the references: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(t.dtype, torch.float32)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision`` for inputs of ``dtype``: true fp32 products (``"ieee"``) for fp32 (the
    references disable TF32), ``"tf32"`` (the tensor cores' native path) for half types."""
    return "ieee" if dtype == torch.float32 else "tf32"
