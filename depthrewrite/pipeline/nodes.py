"""What the pipeline passes ask of a graph node: is it a stage boundary, does it read depth state, and may a later
stage recompute it (sizes, no random ops)."""

from __future__ import annotations

import torch
import torch.distributed.pipelining  # noqa: F401  (registers torch.ops.pippy._pipe_split)
import torch.fx as fx

from ..passes.analyse.ops import op_name
from ..passes.rewrite.registry import depth_state_inputs

__all__ = ["PIPE_SPLIT", "CLONE_KEY", "is_split", "op_name", "is_depth_op", "reads_as_depth_state", "nondeterministic",
           "is_sym"]

PIPE_SPLIT = torch.ops.pippy._pipe_split.default
CLONE_KEY = "depthrewrite_pipeline_recomputed"  # node.meta: the side value a per-stage copy recomputes


def is_split(n: fx.Node) -> bool:
    """A stage boundary (``torch.ops.pippy._pipe_split``)."""
    return n.op == "call_function" and n.target is PIPE_SPLIT


def is_depth_op(n: fx.Node) -> bool:
    """A ``depthrewrite::`` op of a registered scheme (it reads depth state; see :func:`reads_as_depth_state`)."""
    return (n.op == "call_function" and getattr(n.target, "namespace", None) == "depthrewrite"
            and depth_state_inputs(op_name(n), n.args) is not None)


def reads_as_depth_state(user: fx.Node, n: fx.Node) -> bool:
    """Whether ``user`` (a node reading ``n``) is a depth op reading ``n`` as depth state (its scheme's
    ``state_args``: MoDA's attention reads its slots as depth state, its q/k/v not)."""
    if user.op != "call_function" or getattr(user.target, "namespace", None) != "depthrewrite":
        return False
    got = depth_state_inputs(op_name(user), user.args)
    return got is not None and any(x is n for x in got)


def nondeterministic(n: fx.Node) -> bool:
    """A random op (dropout, bernoulli): recomputing it in another stage would draw different values."""
    tags = getattr(n.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags or op_name(n) in ("dropout", "native_dropout", "bernoulli")


def is_sym(n: fx.Node) -> bool:
    """A size or other Python scalar (not a tensor)."""
    v = n.meta.get("val", n.meta.get("example_value"))
    return isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)) and not isinstance(v, torch.Tensor)
