"""Stage modules of a split converted model: stage s takes exactly what stage s-1 returns (explicit tensors, static
shapes) and keeps the original parameter names; with fewer ranks than stages, wrapped for cross-stage caching."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from ..converted import graph_module_of
from ..errors import ConfigError
from .cache import cached_stages
from .measure import crossings, example_batch, flat_inputs, specialise
from .nodes import is_split
from .place import split

__all__ = ["contiguous_grad", "stages"]


class _ContiguousGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def contiguous_grad(x):
    """Identity whose gradient is contiguous. PipelineStage sizes the previous stage's receive buffer from the gradient
    this stage computes for its input, and gloo refuses non-contiguous buffers (a custom op's backward may return an
    expanded gradient), so every received tensor passes through this."""
    return _ContiguousGrad.apply(x) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _build(converted, g: fx.Graph, st: dict[fx.Node, int], live: list[list[fx.Node]], s: int) -> fx.GraphModule:
    P = len(live) + 1
    sg = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    root: dict[str, Any] = {}
    if s == 0:
        for n in g.nodes:
            if n.op == "placeholder":
                env[n] = sg.placeholder(n.name)
    else:
        for n in live[s - 1]:
            ph = sg.placeholder(n.name)
            ph.meta = dict(n.meta)
            floating = isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_floating_point()
            env[n] = sg.call_function(contiguous_grad, (ph,)) if floating or "val" not in n.meta else ph

    def get(a: fx.Node) -> fx.Node:
        if a not in env:
            if a.op != "get_attr":
                raise ConfigError(f"pipeline: stage {s} reads `{a.name}` from stage {st[a]} without it crossing")
            root[a.target] = converted.resolve_attr(a.target)
            env[a] = sg.get_attr(a.target)
        return env[a]

    for n in g.nodes:
        if st[n] != s or n.op in ("placeholder", "get_attr", "output") or is_split(n):
            continue
        for a in n.all_input_nodes:
            get(a)
        env[n] = sg.node_copy(n, lambda a: env[a])
    if s < P - 1:
        sg.output(tuple(get(n) for n in live[s]))
    else:
        out = next(n for n in g.nodes if n.op == "output")
        res = pytree.tree_map_only(fx.Node, get, out.args[0])
        flat = pytree.tree_leaves(res)
        sg.output(flat[0] if len(flat) == 1 else tuple(flat))
    sg.eliminate_dead_code()
    sg.lint()
    return fx.GraphModule(root, sg, class_name=f"Stage{s}")


def _with_blocks(model, g: fx.Graph, st: dict[fx.Node, int], mods: list[fx.GraphModule]) -> list[fx.GraphModule]:
    """Each stage calls the block modules wholly inside it (the converted model's own blocks and programs,
    :mod:`depthrewrite.blocks`), so FSDP2 and checkpointing per block apply inside a stage as in the whole model."""
    from ..blocks import stage_with_blocks
    from ..runtime.handle import is_converted, state_of

    if not is_converted(model) or state_of(model).blocks is None:
        return mods
    state = state_of(model)
    where: dict[str, set[int]] = {p: set() for p in state.blocks}  # the stages reading a block's parameters
    for n in g.nodes:
        if n.op == "get_attr" and any(u.op != "output" for u in n.users):
            for p in state.blocks:
                if n.target.startswith(p + "."):
                    where[p].update(st[u] for u in n.users)
    return [stage_with_blocks(m, model, tuple(p for p in state.blocks if where[p] == {s}), state.checkpointing)
            for s, m in enumerate(mods)]


def stages(converted, P: int | None = None, example_inputs: tuple | None = None, example_kwargs: dict | None = None,
           *, ranks: int | None = None, align_blocks: bool = True) -> list[nn.Module]:
    """The P stage modules of ``converted`` for one micro-batch shape, in the current mode (training or eval).

    Args:
        converted: a model from :func:`depthrewrite.convert`; split here if it is not yet split into P stages.
        P: number of stages (default: the split already placed by ``convert(..., pipeline_stages=P)``).
        example_inputs, example_kwargs: one **micro-batch**, as you call the converted model; the stages are specialised
            to its shapes (pipelining needs static shapes): build them again for another micro-batch shape.
        ranks: pipeline ranks R, when R < P (several stages per rank, stage s on rank s % R): the stages cache the
            completed depth summaries per rank (:class:`CachedStage`) and receive only the new ones.

    Returns:
        ``[stage_0, ..., stage_{P-1}]``: stage 0 takes the model's inputs (flattened, tensors only), stage s > 0 takes
        exactly the tuple stage s-1 returns, the last returns the model's output tensor(s). Parameters keep their
        names in ``converted`` and are the same objects (their gradients land in ``converted``).
    """
    if ranks is not None and (not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1):
        raise ConfigError(f"ranks must be an integer >= 1 (the number of pipeline ranks), got {ranks!r}")
    model = converted
    converted = graph_module_of(model, "pipeline")
    cuts = converted.pipeline_cuts
    if P is None:
        P = len(cuts) + 1 if cuts is not None else 1
    if cuts is None or len(cuts) + 1 != P:
        split(model, P, align_blocks=align_blocks, example_inputs=example_inputs, example_kwargs=example_kwargs)
        converted = graph_module_of(model, "pipeline")
    flat = flat_inputs(converted, *example_batch(converted, example_inputs, example_kwargs))
    g, vals = specialise(converted, converted.graph, flat)
    st, live = crossings(g)
    mods = [_build(converted, g, st, live, s) for s in range(len(live) + 1)]
    mods = _with_blocks(model, g, st, mods)
    for s, m in enumerate(mods):
        m._dr_inputs = tuple(n.name for n in live[s - 1]) if s else tuple(n.name for n in g.nodes if n.op == "placeholder")
        m._dr_outputs = tuple(n.name for n in live[s]) if s < len(live) else ()
        m.train(converted.training)
    if ranks is None or ranks >= P:
        return mods
    return cached_stages(mods, g, st, live, vals, ranks)
