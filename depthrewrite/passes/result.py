"""Pass results, compatible with torch.fx's PassManager (``graph_module`` and ``modified``), plus a record of what
changed, which reports and tests read instead of global counters."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

__all__ = ["Change", "PassResult"]


@dataclass(frozen=True)
class Change:
    """One rewrite site: what was created, and which node's readers were redirected to it."""

    site: int | str  # sublayer index, or "output" for the site before the final norm
    module: str | None  # module path of the residual add whose stream value the site replaces (None: the source)
    created: tuple[str, ...]
    replaced: str | None  # the stream value whose readers now read the site's output
    sources: tuple[str, ...] = ()  # what the site reads: "emb", "out3", "b1", "partial b2"; mHC: streams "x0".."x3"
    params: str | None = None  # the site's parameter module under ``depthrewrite.`` ("mix_3", "hc_0")
    detail: str = ""  # scheme-specific, for reports (mHC: coefficient shapes)
    state_elements: int = 0  # depth-state values per token this site reads, when not d-sized sources (MoDA: depth KV)


@dataclass(frozen=True)
class PassResult:
    graph_module: fx.GraphModule
    changes: tuple[Change, ...] = field(default=())
    notes: tuple[str, ...] = field(default=())  # report lines (e.g. memory comparisons)
    state: tuple[int, str] | None = None  # (values per token, label) when the depth state is not d-sized vectors

    @property
    def modified(self) -> bool:
        return bool(self.changes)
