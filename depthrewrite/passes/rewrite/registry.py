"""One registry from config type to rewrite handler (torchao's shape): ``convert(model, "attnres", blocks=4)`` maps
the name to its config class; ``convert(model, AttnResConfig(blocks=4))`` works too.

Names are case-insensitive, and the Block variants have names of their own: ``"block-attnres"`` is ``"attnres"`` with
``blocks=DEFAULT_BLOCKS`` (4), ``"block-msar"`` the same for ``"msar"``; options given explicitly win over these
defaults (``convert(model, "block-attnres", blocks=8)``)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ...errors import ConfigError

__all__ = ["SchemeConfig", "register_scheme", "get_handler", "scheme_config", "scheme_names", "SCHEME_ALIASES", "DEFAULT_BLOCKS"]

_HANDLERS: dict[type, Callable] = {}
_NAMES: dict[str, type] = {}

#: the block count of the ``block-*`` names (the demo's Block AttnRes / Block MSAR)
DEFAULT_BLOCKS = 4
#: other names of a scheme with some options preset: name -> (scheme, default options)
SCHEME_ALIASES: dict[str, tuple[str, dict[str, Any]]] = {
    "block-attnres": ("attnres", {"blocks": DEFAULT_BLOCKS}),
    "block-msar": ("msar", {"blocks": DEFAULT_BLOCKS}),
}


@dataclasses.dataclass(frozen=True)
class SchemeConfig:
    """Base of every scheme config. Subclasses are frozen dataclasses that validate in ``__post_init__``."""

    name = "base"
    version = 1

    def describe(self, block_size: int | None = None) -> str:
        """One line for reports."""
        return self.name

    def to_dict(self) -> dict[str, Any]:
        return {"scheme": self.name, "version": self.version, **dataclasses.asdict(self)}


def register_scheme(config_cls: type) -> Callable:
    def deco(fn: Callable) -> Callable:
        _HANDLERS[config_cls] = fn
        _NAMES[config_cls.name] = config_cls
        return fn

    return deco


def get_handler(config: SchemeConfig) -> Callable:
    return _HANDLERS[type(config)]


def scheme_names() -> list[str]:
    """Every name :func:`scheme_config` accepts (lower case): the schemes, then the aliases."""
    return sorted(_NAMES) + [a for a in SCHEME_ALIASES if a not in _NAMES]


def scheme_config(scheme: str | SchemeConfig, **options: Any) -> SchemeConfig:
    """A config instance from a scheme name and options, or the config itself (then no options).

    ``scheme`` is case-insensitive (``"AttnRes"``, ``"MSAR"``); ``"block-attnres"`` / ``"block-msar"`` preset
    ``blocks=DEFAULT_BLOCKS``, which explicit ``options`` override."""
    if isinstance(scheme, SchemeConfig):
        if options:
            raise ConfigError(f"pass options inside the config, not beside it (got {sorted(options)})")
        return scheme
    key = scheme.strip().lower().replace("_", "-") if isinstance(scheme, str) else None
    if key in SCHEME_ALIASES and key not in _NAMES:
        key, preset = SCHEME_ALIASES[key]
        if "block_size" not in options:  # block_size wins over blocks anyway; keep the config free of a stale blocks
            options = {**preset, **options}
    if key not in _NAMES:
        raise ConfigError(f"unknown scheme {scheme!r}: choose one of {scheme_names()} or pass a SchemeConfig instance")
    scheme = key
    cls = _NAMES[scheme]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ConfigError(f"scheme {scheme!r} has no option(s) {unknown}; its options are {sorted(fields)}")
    return cls(**options)
