"""mHC: n residual streams with Sinkhorn-projected stream mixing (fused Triton kernels in ``fused.py``, loaded lazily)."""

from .op import mhc_coeffs, mhc_coeffs_backward, mhc_collapse, mhc_post, mhc_post_backward, mhc_pre, mhc_pre_backward
from .reference import mhc_coeffs_ref, mhc_collapse_ref, mhc_post_ref, mhc_pre_ref, sinkhorn

__all__ = [
    "mhc_coeffs", "mhc_pre", "mhc_post", "mhc_collapse",
    "mhc_coeffs_backward", "mhc_pre_backward", "mhc_post_backward",
    "mhc_coeffs_ref", "mhc_pre_ref", "mhc_post_ref", "mhc_collapse_ref", "sinkhorn",
]
