"""The public verbs: :func:`inspect` (more follow: ``convert``, ``explain``)."""

from __future__ import annotations

import torch.fx as fx
import torch.nn as nn

from .capture import capture
from .passes.analyse.chain import detect_chain
from .report import ChainReport

__all__ = ["inspect"]


def inspect(
    model: nn.Module | fx.GraphModule,
    example_inputs: tuple | None = None,
    example_kwargs: dict | None = None,
) -> ChainReport:
    """Capture ``model`` and detect its PreNorm residual chain.

    Args:
        model (nn.Module | fx.GraphModule): a model (captured with :func:`~depthrewrite.capture`), or a graph that is
            already captured (``torch.export`` or a Dynamo graph as a ``torch.compile`` backend receives it).
        example_inputs (tuple, optional): positional inputs for capture; built for HF and timm models when None.
        example_kwargs (dict, optional): keyword inputs for capture.

    Returns:
        A :class:`ChainReport`; ``print(report)`` shows the chain as a table.

    Raises:
        CaptureError, NotPreNormError, NoResidualChainError (all :class:`DepthRewriteError`).
    """
    gm = capture(model, example_inputs, example_kwargs)
    chain = detect_chain(gm)
    name = gm.meta.get("depthrewrite_model_class") or type(model).__name__
    return ChainReport(model_class=name, chain=chain, graph=gm)
