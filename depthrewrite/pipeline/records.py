"""Report records of a pipeline split: what crosses each stage boundary (part of the ConvertReport)."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Crossing", "Boundary", "PipelineInfo"]


@dataclasses.dataclass(frozen=True)
class Crossing:
    """One tensor that crosses a stage boundary."""

    name: str  # the FX node
    label: str  # "emb", "b1", "partial b2", "X (4 streams)", "h (residual stream)", "slot K attn0", or the node name
    kind: str  # "depth" | "side" (sent) | "recomputed" (a side value each stage computes itself; not sent)
    shape: tuple[int, ...]  # at the example micro-batch
    dtype: str
    bytes_per_token: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Boundary:
    """Stage ``index`` -> ``index + 1``, placed before sublayer ``before``."""

    index: int
    before: int  # sublayer index of the first sublayer of the next stage
    tensors: tuple[Crossing, ...]
    formula: str  # the depth-state size the scheme predicts, e.g. "(N_done+1)·d = 3·32"
    formula_bytes_per_token: int

    @property
    def depth_bytes_per_token(self) -> float:
        return sum(t.bytes_per_token for t in self.tensors if t.kind == "depth")

    @property
    def side_bytes_per_token(self) -> float:
        return sum(t.bytes_per_token for t in self.tensors if t.kind == "side")

    @property
    def sent_bytes_per_token(self) -> float:
        return self.depth_bytes_per_token + self.side_bytes_per_token


@dataclasses.dataclass(frozen=True)
class PipelineInfo:
    """Where the stage boundaries are and what crosses each (part of the ConvertReport)."""

    stages: int
    cuts: tuple[int, ...]  # sublayer index where each stage after the first begins
    stage_params: tuple[int, ...]
    boundaries: tuple[Boundary, ...]
    tokens: int  # B·T of the example the shapes were measured at
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return dict(
            stages=self.stages, cuts=list(self.cuts), stage_params=list(self.stage_params), tokens=self.tokens,
            boundaries=[dict(index=b.index, before=b.before, formula=b.formula,
                             formula_bytes_per_token=b.formula_bytes_per_token,
                             sent_bytes_per_token=b.sent_bytes_per_token,
                             tensors=[t.to_dict() for t in b.tensors]) for b in self.boundaries],
            notes=list(self.notes),
        )

    def table(self) -> str:
        from tabulate import tabulate

        rows = []
        for b in self.boundaries:
            for t in b.tensors:
                rows.append([f"{b.index}->{b.index + 1}", b.before, t.kind, t.label, "x".join(map(str, t.shape)), t.dtype,
                             f"{t.bytes_per_token:g}" if t.kind != "recomputed" else f"({t.bytes_per_token:g}, not sent)"])
            rows.append([f"{b.index}->{b.index + 1}", b.before, "total sent", "", "", "",
                         f"{b.sent_bytes_per_token:g} (formula {b.formula} = {b.formula_bytes_per_token})"])
        head = (f"pipeline: {self.stages} stages, cuts before sublayers {list(self.cuts)}, "
                f"parameters per stage {[f'{p:,}' for p in self.stage_params]}")
        text = head + "\n" + tabulate(rows, headers=["boundary", "before", "kind", "tensor", "shape", "dtype", "bytes/token"],
                                      tablefmt="simple")
        if self.notes:
            text += "\n" + "\n".join(f"note: {n}" for n in self.notes)
        return text

    def __str__(self) -> str:
        return self.table()
