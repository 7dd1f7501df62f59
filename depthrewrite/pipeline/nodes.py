"""What the pipeline passes ask of a graph node: is it a stage boundary, does it read depth state, and may a later
stage recompute it (sizes, no random ops)."""

from __future__ import annotations

import torch
import torch.distributed.pipelining  # noqa: F401  (registers torch.ops.pippy._pipe_split)
import torch.fx as fx

from ..passes.analyse.ops import op_name
from ..passes.rewrite.registry import depth_state_ops

__all__ = ["PIPE_SPLIT", "CLONE_KEY", "is_split", "op_name", "is_depth_op", "nondeterministic", "is_sym"]

PIPE_SPLIT = torch.ops.pippy._pipe_split.default
CLONE_KEY = "depthrewrite_pipeline_recomputed"  # node.meta: the side value a per-stage copy recomputes


def is_split(n: fx.Node) -> bool:
    """A stage boundary (``torch.ops.pippy._pipe_split``)."""
    return n.op == "call_function" and n.target is PIPE_SPLIT


def is_depth_op(n: fx.Node) -> bool:
    """A ``depthrewrite::`` op whose inputs are depth state (any registered scheme's ``state_ops``)."""
    return n.op == "call_function" and getattr(n.target, "namespace", None) == "depthrewrite" and op_name(n) in depth_state_ops()


def nondeterministic(n: fx.Node) -> bool:
    """A random op (dropout, bernoulli): recomputing it in another stage would draw different values."""
    tags = getattr(n.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags or op_name(n) in ("dropout", "native_dropout", "bernoulli")


def is_sym(n: fx.Node) -> bool:
    """A size or other Python scalar (not a tensor)."""
    v = n.meta.get("val", n.meta.get("example_value"))
    return isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)) and not isinstance(v, torch.Tensor)
