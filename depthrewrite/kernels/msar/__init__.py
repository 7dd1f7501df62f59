"""MSAR: multi-stream depth attention with causal conv views and a sigmoid mixer."""

from .op import msar_mix, msar_mix_backward
from .reference import causal_depthwise_conv, msar_mix_ref

__all__ = ["msar_mix", "msar_mix_backward", "msar_mix_ref", "causal_depthwise_conv"]
