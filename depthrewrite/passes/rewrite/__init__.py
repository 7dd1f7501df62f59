"""Graph rewrites, one file per scheme, each registering one :class:`Scheme` record (see ``registry``)."""

from .registry import (DepthState, Scheme, SchemeConfig, SchemeVariant, StageHookError, get_handler, register, scheme,
                       scheme_config, scheme_of_op, schemes, unregister)

from . import attnres, msar, mhc, moda  # noqa: E402,F401  (register the schemes, in this order)


def _import_other_schemes() -> None:
    """Import every other module of this package, so a new scheme's rewrite file registers itself (after the four
    above, in name order) with no line to add here (CONTRIBUTING.md)."""
    import importlib
    import pkgutil

    for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not m.name.startswith("_"):
            importlib.import_module(f"{__name__}.{m.name}")


_import_other_schemes()

__all__ = [
    "DepthState",
    "Scheme",
    "SchemeConfig",
    "SchemeVariant",
    "StageHookError",
    "get_handler",
    "register",
    "scheme",
    "scheme_config",
    "scheme_of_op",
    "schemes",
    "unregister",
]
