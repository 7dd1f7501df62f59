"""Cross-stage caching for several stages per rank ("loop" placement, stage s on rank s % R): a rank keeps the
completed depth summaries it already holds for a micro-batch, and the next stage on that rank receives only the new
ones; the backward gradient of a cached summary is deposited in the rank cache and added by the stage that first held
it."""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ..errors import PipelineError

__all__ = ["RankCache", "CachedStage", "cached_stages"]


class _Entry:
    __slots__ = ("value", "grad")

    def __init__(self, value: torch.Tensor):
        self.value, self.grad = value, None

    def deposit(self, g: torch.Tensor) -> None:
        self.grad = g.detach().clone() if self.grad is None else self.grad + g


class RankCache:
    """Per-rank store of depth summaries already held for a micro-batch: one FIFO per (value, consumer stage); stages
    run their micro-batches in order, so the consumer's next read is the owner's next write."""

    def __init__(self):
        self._q: dict[tuple[str, int], deque] = defaultdict(deque)

    def put(self, name: str, consumer: int, entry: _Entry) -> None:
        self._q[(name, consumer)].append(entry)

    def take(self, name: str, consumer: int) -> _Entry:
        q = self._q.get((name, consumer))
        if not q:
            raise PipelineError(
                f"cross-stage cache: stage {consumer} found no cached `{name}` for its next micro-batch (the earlier "
                "stage on its rank has not run that micro-batch's forward yet). Use a schedule that runs each stage's "
                "micro-batches in order with stage s on rank s % R (ScheduleLoopedBFS; not ZBV's V-shaped placement), "
                "and build fresh stages with pp.stages(..., ranks=R) after an interrupted step", stage=consumer)
        return q.popleft()

    def __len__(self) -> int:
        return sum(len(q) for q in self._q.values())


class _Deposit(torch.autograd.Function):
    """Identity on ``anchor``; in backward, the gradients later stages on this rank deposited for the cached values are
    added to those values' gradients (before they travel upstream)."""

    @staticmethod
    def forward(ctx, anchor, entries, *values):
        ctx.entries = entries
        return anchor.view_as(anchor)

    @staticmethod
    def backward(ctx, g):
        return (g, None, *[e.grad for e in ctx.entries])


class CachedStage(nn.Module):
    """A stage module that exchanges only what the neighbouring rank does not already hold.

    ``wire_inputs`` / ``wire_outputs`` name what is received / sent; the rest of the full interface comes from (goes
    to) the :class:`RankCache` shared by the stages on one rank. ``sent_bytes`` and ``full_bytes`` count the forward
    payload sent with and without the cache over ``forwards`` calls (PipelineStage's shape inference is one of them);
    the backward sends gradients of the same tensors. Parameters keep the converted model's names.
    """

    def __init__(self, module: fx.GraphModule, index: int, cache: RankCache, wire_in: list[int], cached_in: list[int],
                 wire_out: list[int], puts: list[tuple[int, int, list[int]]]):
        super().__init__()
        # the stage's parameters keep the converted model's names (no "module." prefix): share its children
        object.__setattr__(self, "module", module)
        for name, child in module.named_children():
            self.add_module(name, child)
        for name, p in module._parameters.items():
            self.register_parameter(name, p)
        for name, b in module._buffers.items():
            self.register_buffer(name, b)
        self.index = index
        self.cache = cache
        self._wire_in, self._cached_in, self._wire_out, self._puts = wire_in, cached_in, wire_out, puts
        names_in, names_out = module._dr_inputs, module._dr_outputs
        self.wire_inputs = tuple(names_in[i] for i in wire_in)
        self.cached_inputs = tuple(names_in[i] for i in cached_in)
        self.wire_outputs = tuple(names_out[i] for i in wire_out) if names_out else ()
        self.sent_bytes = 0
        self.full_bytes = 0
        self.forwards = 0

    def forward(self, *wire):
        names_in = self.module._dr_inputs
        full: list[Any] = [None] * len(names_in)
        for i, v in zip(self._wire_in, wire):
            full[i] = v
        grad = torch.is_grad_enabled()
        for i in self._cached_in:
            e = self.cache.take(names_in[i], self.index)
            x = e.value.detach()
            if grad and x.is_floating_point():
                x.requires_grad_(True)
                x.register_hook(lambda g, e=e: e.deposit(g))
            full[i] = x
        out = self.module(*full)
        self.forwards += 1
        if not self.module._dr_outputs:  # last stage
            return out
        out = tuple(out)
        entries, values = [], []
        for where, i, consumers in self._puts:  # this stage is the first on its rank to hold these values
            v = full[i] if where == 0 else out[i]
            e = _Entry(v.detach())
            for c in consumers:
                self.cache.put((names_in if where == 0 else self.module._dr_outputs)[i], c, e)
            entries.append(e)
            values.append(v)
        sent = [out[i] for i in self._wire_out]
        self.full_bytes += sum(t.numel() * t.element_size() for t in out)
        self.sent_bytes += sum(t.numel() * t.element_size() for t in sent)
        if entries and grad:
            k = next((k for k, t in enumerate(sent) if t.is_floating_point() and t.requires_grad), None)
            if k is None:
                raise PipelineError(
                    f"cross-stage cache: stage {self.index} sends no floating tensor that requires grad, so the gradients "
                    "of the depth summaries cached on its rank have nothing to travel back with. Run this stage with "
                    "parameters that require grad, or build the stages without the cache (pp.stages(..., ranks=None))",
                    stage=self.index)
            sent[k] = _Deposit.apply(sent[k], entries, *values)
        return tuple(sent)


def cached_stages(mods, g: fx.Graph, st: dict[fx.Node, int], live: list[list[fx.Node]], vals: dict[fx.Node, Any],
                  R: int) -> list[nn.Module]:
    """Wrap the P stage modules (of the specialised graph ``g``, node stages ``st``, values ``live`` across each
    boundary, example values ``vals``) in :class:`CachedStage`; the stages on one of the R ranks share a
    :class:`RankCache`."""
    P = len(mods)
    defined = {n: st[n] for n in g.nodes}
    caches = {r: RankCache() for r in range(R)}

    def held_by_rank_before(n: fx.Node, stage: int) -> bool:
        # stage - R is on the same rank; it held n if n was defined at or before it (n is live in between)
        return stage - R >= 0 and defined[n] <= stage - R and vals.get(n) is not None and isinstance(vals[n], torch.Tensor)

    out = []
    for s, m in enumerate(mods):
        ins = live[s - 1] if s else []
        outs = live[s] if s < P - 1 else []
        cached_in = [i for i, n in enumerate(ins) if held_by_rank_before(n, s)]
        wire_in = [i for i in range(len(ins) if s else len(m._dr_inputs)) if i not in cached_in]
        wire_out = [i for i, n in enumerate(outs) if not held_by_rank_before(n, s + 1)]
        # values this stage is the first on its rank to hold, which later stages on the rank read from the cache
        puts = []
        for where, lst in ((0, ins), (1, outs)):
            for i, n in enumerate(lst):
                if where == 1 and n in ins:
                    continue  # passed through: recorded as an input
                if s - R >= 0 and defined[n] <= s - R:
                    continue  # an earlier stage on this rank owns it
                consumers = [c for c in range(s + R, P, R) if c >= 1 and n in live[c - 1] and held_by_rank_before(n, c)]
                if consumers and isinstance(vals.get(n), torch.Tensor):
                    puts.append((where, i, consumers))
        out.append(CachedStage(m, s, caches[s % R], wire_in, cached_in, wire_out, puts))
    return out
