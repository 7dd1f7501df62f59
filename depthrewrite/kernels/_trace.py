"""Whether a depth op's reference is being traced as a decomposition for inductor (:mod:`.decompose`), per thread.

Its own module, below the references that ask and the decomposition table that sets it, so neither imports the
other."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

_state = threading.local()  # per thread: another thread's eager calls are not being traced


def tracing() -> bool:
    """Whether a reference is being traced as a decomposition for inductor right now, in this thread: a reference may
    then pick the formulation inductor fuses best (e.g. MSAR's causal conv as shifted multiply-adds instead of
    ``conv2d``)."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def traced() -> Iterator[None]:
    """Mark this thread as tracing a decomposition while the block runs (nests)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
