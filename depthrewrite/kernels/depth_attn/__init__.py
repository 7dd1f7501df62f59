"""Depth attention over sources (AttnRes / Block AttnRes)."""

from .op import depth_attn
from .reference import depth_attn_ref

__all__ = ["depth_attn", "depth_attn_ref"]
