"""Graph rewrites, one file per scheme, registered by config type (see ``registry``)."""

from ...kernels import depth_attn as _depth_attn  # noqa: F401  (registers depthrewrite::depth_attn)
from .registry import SchemeConfig, get_handler, register_scheme, scheme_config

from . import attnres  # noqa: E402,F401  (registers the scheme)

__all__ = ["SchemeConfig", "register_scheme", "get_handler", "scheme_config"]
