"""The ``depthrewrite`` backend for ``torch.compile``.

    conv = depthrewrite.convert(model, "attnres", blocks=4)
    step = torch.compile(conv, backend="depthrewrite")          # training works: AOT autograd + inductor

What it does with each graph Dynamo hands it:

* **a converted model's graph** (it holds ``depthrewrite::*`` ops): runs the parameter-free lowering passes — today the
  two-phase batching of Block AttnRes sites (:mod:`depthrewrite.passes.lower.two_phase`) — then compiles with
  inductor through AOT autograd. Where a depth op's fused Triton kernel runs (CUDA, a call the kernel covers), the
  op stays an opaque node that inductor calls as an extern kernel, and inductor fuses everything around it. Where
  the op would run its PyTorch reference (CPU, the ``"reference"`` kernel backend, a GPU call the kernel does not
  cover), AOT autograd lowers it to that reference's aten ops (:mod:`depthrewrite.kernels.decompose`), forward and
  backward, so inductor fuses the depth mixing with its neighbours (the norm that follows, the residual add)
  instead of calling an opaque reference. Exported graphs are not touched: they keep one node per site.
* **an unconverted model's graph**: detects the PreNorm chain, logs the chain report (logger
  ``depthrewrite.backend``, level INFO), and compiles normally. Asking for a scheme here (``options={"scheme": ...}``)
  raises :class:`~depthrewrite.errors.ConfigError` pointing to :func:`depthrewrite.convert`: new parameters must be
  owned by the model, not by a compiled graph.

Options (``torch.compile(m, backend="depthrewrite", options={...})``):

* ``inner``: ``"inductor"`` (default), ``"aot_eager"`` (AOT autograd, graphs run eagerly: fast to compile, for
  debugging and tests) or ``"eager"`` (the Dynamo graph as is).
* ``two_phase``: batch Block AttnRes sites where the cost model says it moves fewer bytes (``True``, default),
  ``"always"``, or ``False``.
* ``decompose``: lower depth ops to their references where no Triton kernel would run them (``True``, default), or
  keep every depth op opaque (``False``).
* ``scheme``: assert the model was converted to this scheme: any registered name, any case
  (``depthrewrite.schemes()``: ``"attnres"``, ``"msar"``, ``"mhc"``, ``"moda"``, ...; not an alias such as
  ``"block-attnres"``, whose preset options this check cannot see). A graph names its scheme by the
  ``depthrewrite::*`` ops in it (each scheme's ``Scheme.ops``) or, for a scheme of aten ops only, by the tag its
  rewrite leaves in ``node.meta["custom"]`` (:data:`depthrewrite.passes.meta.SCHEME_TAG`), which Dynamo keeps.
* ``log_chain``: log the chain report of unconverted graphs (default True).

``depthrewrite.explain(compiled)`` shows what the backend did to each graph.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import fx

from .errors import ConfigError, DepthRewriteError

__all__ = ["depthrewrite_backend", "BackendOptions", "GraphRecord", "AotGraphRecord", "records_for", "clear_records"]

log = logging.getLogger("depthrewrite.backend")

INNER = ("inductor", "aot_eager", "eager")


@dataclass(frozen=True)
class BackendOptions:
    """The backend's options (see the module docstring)."""

    inner: str = "inductor"
    two_phase: bool | str = True
    decompose: bool = True
    scheme: str | None = None
    log_chain: bool = True

    @classmethod
    def from_dict(cls, options: dict[str, Any] | None) -> BackendOptions:
        options = dict(options or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(
                f"torch.compile(backend='depthrewrite'): unknown option(s) {unknown}; the backend takes {sorted(known)}"
            )
        opts = cls(**options)
        if opts.inner not in INNER:
            raise ConfigError(f"backend option inner={opts.inner!r} is not one of {INNER}")
        if opts.decompose not in (True, False):
            raise ConfigError(f"backend option decompose={opts.decompose!r} is not True or False")
        if opts.two_phase not in (True, False, "always"):
            raise ConfigError(f"backend option two_phase={opts.two_phase!r} is not one of True, False, 'always'")
        if opts.scheme is not None:
            from .passes.rewrite.registry import schemes

            names = tuple(schemes())
            key = opts.scheme.strip().lower() if isinstance(opts.scheme, str) else None
            if key not in names:  # a scheme, not an alias: "block-attnres" presets options this check cannot see
                raise ConfigError(f"backend option scheme={opts.scheme!r} is not one of {names}")
            opts = replace(opts, scheme=key)
        return opts


@dataclass
class AotGraphRecord:
    """One graph AOT autograd produced (``stage``: forward, backward or inference) and the depth ops in it."""

    stage: str
    n_nodes: int
    depth_ops: Counter
    device: str


@dataclass
class GraphRecord:
    """What the backend saw and did for one Dynamo graph."""

    index: int
    kind: str  # "converted" | "unconverted" | "no chain"
    n_nodes: int
    device: str
    inner: str
    depth_ops: Counter = field(default_factory=Counter)
    two_phase: list = field(default_factory=list)  # TwoPhaseGroup, applied
    two_phase_declined: list = field(default_factory=list)  # TwoPhaseGroup the cost model left as single passes
    two_phase_skipped: str = ""
    decomposed: Counter = field(default_factory=Counter)  # depth op name -> calls lowered to the reference's aten ops
    chain_report: Any = None  # ChainReport for unconverted graphs with a chain
    chain_error: str = ""
    aot: list[AotGraphRecord] = field(default_factory=list)
    _params: list = field(default_factory=list, repr=False)  # weakrefs to the parameter tensors the graph read

    def reads(self, params: list[torch.Tensor]) -> bool:
        """Whether this graph read any of ``params`` (how explain() finds the graphs of one model)."""
        mine = [r() for r in self._params]
        return any(p is q for p in params for q in mine if q is not None)


_RECORDS: list[GraphRecord] = []
MAX_RECORDS = 256  # the oldest records are dropped beyond this


def records_for(module: torch.nn.Module) -> list[GraphRecord]:
    """The records of every graph compiled with this backend that read ``module``'s parameters, in compile order.

    A converted model shares its original's parameters, so a converted model gets only the graphs of converted
    models, and any other module only the others."""
    from .converted import ConvertedGraphModule
    from .runtime.handle import is_converted

    params = list(module.parameters())
    converted = isinstance(module, ConvertedGraphModule) or is_converted(module)
    return [r for r in _RECORDS if (r.kind == "converted") == converted and r.reads(params)]


def clear_records() -> None:
    """Forget every record (``torch._dynamo.reset()`` does not)."""
    _RECORDS.clear()


def depth_ops(graph: fx.Graph) -> Counter:
    return Counter(
        n.target._schema.name.split("::", 1)[1]
        for n in graph.nodes
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "depthrewrite"
    )


def _schemes_of(gm: fx.GraphModule, ops: Counter) -> set[str]:
    """The registered schemes a converted graph was rewritten into: the owners of its ``depthrewrite::*`` ops
    (``Scheme.ops``), and the scheme tags its rewritten nodes carry (the only sign of a scheme without ops of its own)."""
    from .passes.meta import scheme_tags
    from .passes.rewrite.registry import scheme_of_op

    return {s.name for s in map(scheme_of_op, ops) if s is not None} | scheme_tags(gm.graph)


def _device_of(example_inputs) -> str:
    for t in example_inputs:
        if isinstance(t, torch.Tensor):
            return t.device.type
    return "cpu"


def _is_converted(gm: fx.GraphModule, ops: Counter) -> bool:
    """Whether Dynamo's graph comes from a converted model: it holds depth ops, new parameters (``depthrewrite.*``),
    or nodes a scheme's rewrite tagged (a scheme of aten ops only and no parameters leaves nothing else)."""
    if ops:
        return True
    from .passes.meta import scheme_tags
    from .passes.rewrite.editor import PARAM_PREFIX

    return any(PARAM_PREFIX in str(n.target) for n in gm.graph.nodes if n.op in ("placeholder", "get_attr")) or bool(
        scheme_tags(gm.graph)
    )


def _recording(stage: str, record: GraphRecord, compile_fn):
    def inner(gm: fx.GraphModule, example_inputs, **kwargs):
        st = stage
        if stage == "auto":
            st = "backward" if kwargs.get("is_backward") else ("inference" if kwargs.get("is_inference") else "forward")
        record.aot.append(AotGraphRecord(st, len(gm.graph.nodes), depth_ops(gm.graph), _device_of(example_inputs)))
        return compile_fn(gm, example_inputs, **kwargs)

    return inner


def _boxed_eager(gm: fx.GraphModule, example_inputs, **kwargs):
    from torch._functorch.aot_autograd import make_boxed_func

    return make_boxed_func(gm.forward)


def _depth_decompositions(opts: BackendOptions, record: GraphRecord) -> dict:
    """The depth ops' decomposition table for a converted graph (empty when ``decompose=False`` or nothing to lower)."""
    if not opts.decompose or record.kind != "converted" or not record.depth_ops:
        return {}
    from .kernels.decompose import decompositions

    return decompositions(record.decomposed)


def _compile(gm: fx.GraphModule, example_inputs, opts: BackendOptions, record: GraphRecord, mode: str | None):
    if opts.inner == "eager":
        return gm.forward
    ours = _depth_decompositions(opts, record)
    if opts.inner == "aot_eager":
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(
            fw_compiler=_recording("forward", record, _boxed_eager),
            bw_compiler=_recording("backward", record, _boxed_eager),
            inference_compiler=_recording("inference", record, _boxed_eager),
            **({"decompositions": ours} if ours else {}),
        )(gm, example_inputs)
    import torch._functorch.config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    patches = None
    if mode and mode != "default":
        import torch._inductor

        patches = torch._inductor.list_mode_options(mode)
    # where depth ops are lowered, AOT autograd's cache would skip the lowering on a hit (explain() would lose what
    # was lowered); inductor's FX graph cache keys on the lowered graph, so it stays on (_InductorTable pickles by name)
    caches = torch._functorch.config.patch(enable_autograd_cache=False) if ours else contextlib.nullcontext()
    with caches:
        return compile_fx(
            gm, example_inputs, inner_compile=_recording("auto", record, compile_fx_inner), config_patches=patches,
            decompositions=_InductorTable(ours) if ours else None,
        )


class _InductorTable(dict):
    """Inductor's decomposition table with the depth ops' entries, for ``compile_fx(decompositions=...)``.

    Inductor pickles the table into its FX graph cache key, and torch's own table holds entries pickle cannot name
    (``aten.alias_copy``'s pybind11 function), which turned the cache off for every converted graph: each compile
    (each seed of a study, each rerun) started from nothing. The graph inductor keys on is already decomposed (the
    table's depth entries ran in AOT autograd before), so the table is keyed by what it adds: the depth ops' names.
    """

    def __init__(self, ours: dict):
        from torch._inductor.decomposition import select_decomp_table

        super().__init__({**select_decomp_table(), **ours})
        self.names = tuple(sorted(op.name() for op in ours))

    def __reduce__(self):
        return _inductor_table, (self.names,)


def _inductor_table(names: tuple[str, ...]) -> _InductorTable:
    """What an :class:`_InductorTable` unpickles to (inductor only hashes it): torch's table and the named depth ops'
    reference decompositions."""
    from .kernels.decompose import decompositions

    return _InductorTable({op: fn for op, fn in decompositions().items() if op.name() in names})


def depthrewrite_backend(gm: fx.GraphModule, example_inputs: list, *, options: dict | None = None, mode: str | None = None):
    """The ``torch.compile`` backend (registered as ``"depthrewrite"``; see the module docstring)."""
    opts = BackendOptions.from_dict(options)
    ops = depth_ops(gm.graph)
    converted = _is_converted(gm, ops)
    record = GraphRecord(
        index=len(_RECORDS),
        kind="converted" if converted else "unconverted",
        n_nodes=len(gm.graph.nodes),
        device=_device_of(example_inputs),
        inner=opts.inner,
        depth_ops=ops,
        _params=[weakref.ref(t) for t in example_inputs if isinstance(t, torch.nn.Parameter)],
    )
    if converted:
        schemes = _schemes_of(gm, ops)
        if opts.scheme is not None and schemes and opts.scheme not in schemes:
            raise ConfigError(
                f"torch.compile(backend='depthrewrite', options={{'scheme': {opts.scheme!r}}}): this model was converted "
                f"to {'/'.join(sorted(schemes))}, not {opts.scheme}. Drop the option, or convert the original model "
                f"with depthrewrite.convert(model, {opts.scheme!r})."
            )
        _two_phase(gm, record, opts)
    else:
        _detect(gm, record, opts)
        if opts.scheme is not None and record.chain_report is not None:
            # only a graph that holds an unconverted chain; other fragments (a loss, a graph break) compile as they are
            raise ConfigError(
                f"torch.compile(backend='depthrewrite', options={{'scheme': {opts.scheme!r}}}) was given a model that is "
                f"not converted. The backend does not add parameters (a compiled graph would own them, and your "
                f"optimizer would never see them). Convert first: "
                f"model = depthrewrite.convert(model, {opts.scheme!r}); then torch.compile(model, backend='depthrewrite')."
            )
    _RECORDS.append(record)
    del _RECORDS[:-MAX_RECORDS]
    return _compile(gm, example_inputs, opts, record, mode)


def _two_phase(gm: fx.GraphModule, record: GraphRecord, opts: BackendOptions) -> None:
    if opts.two_phase is False:
        record.two_phase_skipped = "two_phase=False"
        return
    from .passes.lower.two_phase import apply_two_phase, find_two_phase_groups, two_phase_ops_available

    if not two_phase_ops_available():
        record.two_phase_skipped = "the phase-1/merge ops are not registered"
        return
    groups = find_two_phase_groups(gm.graph)
    apply = [g for g in groups if opts.two_phase == "always" or g.worth_it]
    record.two_phase = apply
    record.two_phase_declined = [g for g in groups if g not in apply]
    apply_two_phase(gm, apply)


def _detect(gm: fx.GraphModule, record: GraphRecord, opts: BackendOptions) -> None:
    from .passes.analyse.chain import detect_chain
    from .views.report import ChainReport

    try:
        chain = detect_chain(gm)
    except DepthRewriteError as e:
        record.kind = "no chain"
        record.chain_error = str(e).split("\n")[0]
        log.debug("depthrewrite backend: graph %d has no PreNorm chain: %s", record.index, record.chain_error)
        return
    except Exception as e:  # noqa: BLE001 - detection must never break a compile; say why and go on
        record.kind = "no chain"
        record.chain_error = f"detection failed: {type(e).__name__}: {e}"
        log.warning("depthrewrite backend: detection failed on graph %d (%s); compiling normally", record.index, e)
        return
    # keep the chain only: a report holding the graph would keep every compiled GraphModule alive
    record.chain_report = ChainReport(model_class=f"graph {record.index} (Dynamo)", chain=chain)
    if opts.log_chain:
        log.info(
            "depthrewrite backend: graph %d holds a PreNorm chain; convert it with depthrewrite.convert(model, scheme)"
            "\n%s",
            record.index,
            record.chain_report,
        )


def _register() -> None:
    """Register the name on import. When Dynamo itself is loading our entry point (``backend="depthrewrite"`` before
    ``import depthrewrite``), it registers the loaded function right after this import, so do nothing then."""
    from torch._dynamo.backends import registry

    if "depthrewrite" in registry._COMPILER_FNS or registry._BACKENDS.get("depthrewrite") is not None:
        return
    registry.register_backend(depthrewrite_backend, name="depthrewrite")


_register()
