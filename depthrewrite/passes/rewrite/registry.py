"""One registry from config type to rewrite handler (torchao's shape): ``convert(model, "attnres", blocks=4)`` maps
the name to its config class; ``convert(model, AttnResConfig(blocks=4))`` works too."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ...errors import ConfigError

__all__ = ["SchemeConfig", "register_scheme", "get_handler", "scheme_config"]

_HANDLERS: dict[type, Callable] = {}
_NAMES: dict[str, type] = {}


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


def scheme_config(scheme: str | SchemeConfig, **options: Any) -> SchemeConfig:
    """A config instance from a scheme name and options, or the config itself (then no options)."""
    if isinstance(scheme, SchemeConfig):
        if options:
            raise ConfigError(f"pass options inside the config, not beside it (got {sorted(options)})")
        return scheme
    if not isinstance(scheme, str) or scheme not in _NAMES:
        raise ConfigError(f"unknown scheme {scheme!r}: choose one of {sorted(_NAMES)} or pass a SchemeConfig instance")
    cls = _NAMES[scheme]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ConfigError(f"scheme {scheme!r} has no option(s) {unknown}; its options are {sorted(fields)}")
    return cls(**options)
