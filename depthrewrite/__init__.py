"""depthrewrite: find the PreNorm residual chain of any PyTorch transformer and rewrite it into depth-mixing schemes.

The public API::

    depthrewrite.capture(model)        # -> torch.fx.GraphModule (torch.export, dynamic batch/sequence)
    depthrewrite.inspect(model)        # -> ChainReport; print(report) shows the chain
    depthrewrite.detect_chain(gm)      # -> Chain (frozen data), on export or Dynamo graphs
"""

from .api import inspect
from .capture import capture
from .errors import (
    CaptureError,
    ConfigError,
    DepthRewriteError,
    KernelError,
    NoResidualChainError,
    NotPreNormError,
)
from .passes.analyse.chain import Branch, Chain, Sublayer, detect_chain
from .passes.analyse.norms import NormSite
from .report import ChainReport

__version__ = "0.1.0"

__all__ = [
    "capture",
    "inspect",
    "detect_chain",
    "Chain",
    "Sublayer",
    "Branch",
    "NormSite",
    "ChainReport",
    "DepthRewriteError",
    "CaptureError",
    "NotPreNormError",
    "NoResidualChainError",
    "ConfigError",
    "KernelError",
]
