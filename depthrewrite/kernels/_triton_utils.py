"""Small launch-configuration helpers shared by the ``fused.py`` kernel modules (plain Python: no triton import)."""

from __future__ import annotations

__all__ = ["pow2"]


def pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``); equals ``triton.next_power_of_2(n)`` for ``n >= 1``."""
    return 1 << (max(int(n), 1) - 1).bit_length()
