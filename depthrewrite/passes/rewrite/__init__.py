"""Graph rewrites, one file per scheme, registered by config type (see ``registry``)."""

from ...kernels import depth_attn as _depth_attn  # noqa: F401  (registers depthrewrite::depth_attn)
from ...kernels import mhc as _mhc  # noqa: F401  (registers depthrewrite::mhc_*)
from ...kernels import moda as _moda  # noqa: F401  (registers depthrewrite::moda_*)
from ...kernels import msar as _msar  # noqa: F401  (registers depthrewrite::msar_mix)
from .registry import SchemeConfig, get_handler, register_scheme, scheme_config

from . import attnres, mhc, moda, msar  # noqa: E402,F401  (register the schemes)

__all__ = ["SchemeConfig", "register_scheme", "get_handler", "scheme_config"]
