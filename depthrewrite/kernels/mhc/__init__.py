"""mHC: n residual streams with Sinkhorn-projected stream mixing."""

from .op import mhc_coeffs, mhc_collapse, mhc_post, mhc_pre
from .reference import mhc_coeffs_ref, mhc_collapse_ref, mhc_post_ref, mhc_pre_ref, sinkhorn

__all__ = [
    "mhc_coeffs", "mhc_pre", "mhc_post", "mhc_collapse",
    "mhc_coeffs_ref", "mhc_pre_ref", "mhc_post_ref", "mhc_collapse_ref", "sinkhorn",
]
