"""What every layer may ask of a model: is it converted, and its :class:`~.state.ConversionState`.

The bottom of the runtime (nothing here imports the rest of it): the graph modules, the block runners and the
pipeline splitter ask these without importing the converted class."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.nn as nn

from ..errors import ConfigError

if TYPE_CHECKING:
    from .state import ConversionState


class ConvertedBase(nn.Module):
    """The base every converted class has (:class:`~.classes.ConvertedModel` is the one used): what
    :func:`is_converted` checks, defined here so that checking needs nothing above this module."""


def state_of(model: nn.Module) -> ConversionState:
    st = model.__dict__.get("_depthrewrite")
    if st is None:
        raise ConfigError(f"{type(model).__name__} is not a model converted by depthrewrite.convert()")
    return st


def is_converted(model: Any) -> bool:
    """Whether ``model`` was converted by :func:`depthrewrite.convert`."""
    return isinstance(model, ConvertedBase)
