"""depthrewrite: find the PreNorm residual chain of any PyTorch transformer and rewrite it into depth-mixing schemes.

The public API::

    depthrewrite.capture(model)        # -> torch.fx.GraphModule (torch.export, dynamic batch/sequence)
    depthrewrite.inspect(model)        # -> ChainReport; print(report) shows the chain
    depthrewrite.detect_chain(gm)      # -> Chain (frozen data), on export or Dynamo graphs
    depthrewrite.convert(model, "attnres", blocks=4)   # converts in place, returns the model (still its own class)
    converted.save_pretrained(dir); depthrewrite.from_pretrained(dir)
    torch.compile(converted, backend="depthrewrite")   # fused kernels on CUDA, inductor for the rest
    depthrewrite.explain(compiled)     # -> Explanation: what the backend did to each graph
    depthrewrite.convert(model, "attnres", blocks=4, pipeline_stages=2)   # + depthrewrite.pipeline.stages(...)
"""

from typing import TYPE_CHECKING

from . import backend  # noqa: F401  - registers the "depthrewrite" torch.compile backend
from .api import convert, from_pretrained, inspect
from .runtime.handle import is_converted
from .capture import capture
from .equivalence import Equivalence, check_equivalence, unconvert
from .errors import (
    CaptureError,
    CaptureGuardError,
    AttentionPatternError,
    ConfigError,
    DepthRewriteError,
    KernelError,
    ModuleCallError,
    ModuleTreeChangedError,
    NoResidualChainError,
    NotPreNormError,
    NotFunctionPreservingWarning,
)
from .views.explain import Explanation, explain
from .passes.analyse.chain import Branch, Chain, Sublayer, detect_chain
from .passes.analyse.norms import NormSite
from .passes.rewrite import DepthState, Scheme, SchemeConfig, SchemeVariant, StageHookError, register, scheme, schemes
from .views.report import ChainReport, ConvertReport

from ._version import __version__

#: every registered scheme's config class under its class name (``depthrewrite.AttnResConfig``, ``MSARConfig``,
#: ``MHCConfig``, ``MoDAConfig``, ...): read from the registry, so a new scheme's rewrite file is all it takes
_CONFIGS = {s.config.__name__: s.config for s in schemes().values()}
globals().update(_CONFIGS)

if TYPE_CHECKING:  # the built-in configs, spelled out for type checkers and IDEs (at run time: _CONFIGS above)
    from .passes.rewrite.attnres import AttnResConfig
    from .passes.rewrite.mhc import MHCConfig
    from .passes.rewrite.moda import MoDAConfig
    from .passes.rewrite.msar import MSARConfig


def __getattr__(name: str):
    # depthrewrite.pipeline loads torch.distributed.pipelining; import it on first use only
    if name == "pipeline":
        import importlib

        return importlib.import_module(".pipeline", __name__)
    # the config class of a scheme registered after this module was imported
    config = next((s.config for s in schemes().values() if s.config.__name__ == name), None)
    if config is not None:
        return config
    raise AttributeError(f"module 'depthrewrite' has no attribute {name!r}")

__all__ = [
    "capture",
    "inspect",
    "convert",
    "is_converted",
    "from_pretrained",
    "check_equivalence",
    "Equivalence",
    "unconvert",
    "explain",
    "Explanation",
    "SchemeConfig",
    *_CONFIGS,
    "Scheme",
    "SchemeVariant",
    "DepthState",
    "StageHookError",
    "register",
    "scheme",
    "schemes",
    "ConvertReport",
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
    "ModuleTreeChangedError",
    "ModuleCallError",
    "CaptureGuardError",
    "AttentionPatternError",
    "KernelError",
    "NotFunctionPreservingWarning",
]
