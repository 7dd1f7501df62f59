"""The one error hierarchy of depthrewrite.

Every error a user can see derives from :class:`DepthRewriteError`. Messages say what failed, where (the FX
node and the module path), why, and what to try.
"""

from __future__ import annotations

__all__ = [
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
    "PipelineError",
    "TrainingError",
    "NotFunctionPreservingWarning",
]


class DepthRewriteError(Exception):
    """Base class of every error raised by depthrewrite."""


class CaptureError(DepthRewriteError, RuntimeError):
    """``torch.export`` could not capture the model; carries export's own message."""


class NotPreNormError(DepthRewriteError, ValueError):
    """The model has residual adds, but they do not form a PreNorm chain ``h = h + f(norm(h))``.

    ``node`` names the first offending FX node.
    """

    def __init__(self, message: str, node: str | None = None):
        super().__init__(message)
        self.node = node


class NoResidualChainError(DepthRewriteError, ValueError):
    """The graph has no residual add that a chain could be built from."""


class AttentionPatternError(DepthRewriteError, ValueError):
    """An attention sublayer whose attention operator a rewrite (MoDA) cannot recognise; ``node`` names it."""

    def __init__(self, message: str, node: str | None = None):
        super().__init__(message)
        self.node = node


class ConfigError(DepthRewriteError, ValueError):
    """A scheme or CLI option has a value that cannot be used."""


class ModuleTreeChangedError(ConfigError):
    """A change around a converted model that its captured graphs cannot follow: a global module hook (registered for
    every module: it would run for the converted model but for none of the submodules inside its graph). Changes of
    the model's own module tree (replaced, added or removed submodules, hooks on submodules) are followed by
    recapturing instead. ``module`` is the dotted path of the submodule concerned (None for a global hook);
    ``change`` says what changed."""

    def __init__(self, message: str, module: str | None = None, change: str | None = None):
        super().__init__(message)
        self.module, self.change = module, change


class ModuleCallError(ConfigError):
    """A module that must run as a live module call (it has run-time hooks, is sharded by FSDP2 or holds
    tensor-parallel DTensor parameters) cannot be called: the rewrite changed its computation, or the model runs as one
    flat graph. ``modules`` lists the ``(path, why)`` pairs."""

    def __init__(self, message: str, modules: tuple = ()):
        super().__init__(message)
        self.modules = tuple(modules)


class CaptureGuardError(ConfigError):
    """Not raised by converted models any more (a call that breaks a shape guard now gets a graph of its own); kept so
    code that catches it keeps importing. A call to a converted model broke a shape guard of the capture: a dimension that ``torch.export`` fixed (or
    constrained) at the example inputs. ``input`` names the input, ``dim`` the dimension, ``captured`` the value it
    was captured with and ``given`` the value of this call (None where the guard is not a fixed size)."""

    def __init__(self, message: str, input: str | None = None, dim: int | None = None, captured: int | None = None,
                 given: int | None = None, guard: str | None = None):
        super().__init__(message)
        self.input, self.dim, self.captured, self.given, self.guard = input, dim, captured, given, guard


class KernelError(DepthRewriteError, RuntimeError):
    """A fused kernel cannot run these inputs (capacity, device or dtype)."""


class PipelineError(DepthRewriteError, RuntimeError):
    """A pipeline stage failed while running (cross-stage cache out of step, nothing to carry cached gradients).

    ``stage`` is the stage index. In a distributed run the peers of the failing rank stay blocked in send/recv until
    the process group's timeout: set one (``init_process_group(..., timeout=...)``).
    """

    def __init__(self, message: str, stage: int | None = None):
        super().__init__(message)
        self.stage = stage


class TrainingError(DepthRewriteError, FloatingPointError):
    """Training diverged (the loss became NaN or infinite); ``variant`` and ``step`` say where."""

    def __init__(self, message: str, variant: str | None = None, step: int | None = None):
        super().__init__(message)
        self.variant, self.step = variant, step


class NotFunctionPreservingWarning(UserWarning):
    """Warned by :func:`depthrewrite.convert` when the options chosen (default MoDA, mHC with ``alpha_init`` > 0)
    make the converted model another function than the original at initialisation; the scheme's ``exact`` options
    (``depthrewrite.scheme(name).exact``) give a function-preserving conversion."""
