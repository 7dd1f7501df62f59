"""Depth attention over sources (AttnRes / Block AttnRes), and its two-phase pair (partial + merge)."""

from .op import depth_attn, depth_attn_merge, depth_attn_partial
from .reference import depth_attn_merge_ref, depth_attn_partial_ref, depth_attn_ref

__all__ = [
    "depth_attn",
    "depth_attn_ref",
    "depth_attn_partial",
    "depth_attn_partial_ref",
    "depth_attn_merge",
    "depth_attn_merge_ref",
]
