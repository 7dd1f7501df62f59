"""Graph analysis: read-only passes over a captured graph (norms, the residual chain)."""

from .chain import Branch, Chain, Sublayer, detect_chain
from .norms import NormSite, find_norms

__all__ = ["Branch", "Chain", "Sublayer", "detect_chain", "NormSite", "find_norms"]
