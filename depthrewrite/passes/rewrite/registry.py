"""One registry of schemes: each rewrite file registers one :class:`Scheme` record (config class, handler, the ops it
inserts, its block form, docs page, demo variants and the hooks pipeline stages need). Config type to handler is
torchao's shape: ``convert(model, "attnres", blocks=4)`` maps
the name to its config class; ``convert(model, AttnResConfig(blocks=4))`` works too.

Names are case-insensitive, and the Block variants have names of their own: ``"block-attnres"`` is ``"attnres"`` with
``blocks=DEFAULT_BLOCKS`` (4), ``"block-msar"`` the same for ``"msar"``; options given explicitly win over these
defaults (``convert(model, "block-attnres", blocks=8)``)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

from ...errors import ConfigError

if TYPE_CHECKING:
    import torch.fx as fx

__all__ = [
    "SchemeConfig",
    "Scheme",
    "SchemeVariant",
    "DepthState",
    "StageHookError",
    "register",
    "unregister",
    "schemes",
    "scheme",
    "scheme_of_op",
    "depth_state_inputs",
    "get_handler",
    "scheme_config",
    "scheme_names",
    "SCHEME_ALIASES",
    "DEFAULT_BLOCKS",
]

#: every registered scheme's record by name, in registration order (names, configs and handlers are read from it)
_SCHEMES: dict[str, "Scheme"] = {}
#: the block count of the ``block-*`` names (the demo's Block AttnRes / Block MSAR)
DEFAULT_BLOCKS = 4
#: other names of a scheme with some options preset: name -> (scheme, default options); :func:`register` adds
#: ``block-<name>`` for every scheme with a block form
SCHEME_ALIASES: dict[str, tuple[str, dict[str, Any]]] = {}


@dataclasses.dataclass(frozen=True)
class SchemeConfig:
    """Base of every scheme config. Subclasses are frozen dataclasses that validate in ``__post_init__``."""

    name = "base"
    version = 1

    def describe(self, block_size: int | None = None) -> str:
        """One line for reports."""
        return self.name

    def to_dict(self) -> dict[str, Any]:
        return {"scheme": self.name, "version": self.version, **dataclasses.asdict(self)}


def get_handler(config: SchemeConfig) -> Callable:
    """The rewrite registered for ``config``'s class (``KeyError`` for a config class no scheme registered)."""
    record = _SCHEMES.get(config.name)
    if record is None or record.config is not type(config):
        raise KeyError(type(config))
    return record.handler


def scheme_names() -> list[str]:
    """Every name :func:`scheme_config` accepts (lower case): the schemes, then the aliases."""
    return sorted(_SCHEMES) + [a for a in SCHEME_ALIASES if a not in _SCHEMES]


def scheme_config(scheme: str | SchemeConfig, **options: Any) -> SchemeConfig:
    """A config instance from a scheme name and options, or the config itself (then no options).

    ``scheme`` is case-insensitive (``"AttnRes"``, ``"MSAR"``); ``"block-attnres"`` / ``"block-msar"`` preset
    ``blocks=DEFAULT_BLOCKS``, which explicit ``options`` override."""
    if isinstance(scheme, SchemeConfig):
        if options:
            raise ConfigError(f"pass options inside the config, not beside it (got {sorted(options)})")
        return scheme
    key = scheme.strip().lower().replace("_", "-") if isinstance(scheme, str) else None
    if key in SCHEME_ALIASES and key not in _SCHEMES:
        key, preset = SCHEME_ALIASES[key]
        if "block_size" not in options:  # block_size wins over blocks anyway; keep the config free of a stale blocks
            options = {**preset, **options}
    if key not in _SCHEMES:
        raise ConfigError(f"unknown scheme {scheme!r}: choose one of {scheme_names()} or pass a SchemeConfig instance")
    scheme = key
    cls = _SCHEMES[scheme].config
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ConfigError(f"scheme {scheme!r} has no option(s) {unknown}; its options are {sorted(fields)}")
    return cls(**options)


# ---------------------------------------------------------------------------------------------------------------------
# the scheme record: everything the rest of the tree needs to know about one scheme, registered once in its own file


@dataclasses.dataclass(frozen=True)
class DepthState:
    """The depth state a converted model holds per token where a stage boundary cuts the chain (before sublayer j).

    Attributes:
        elements: values per token that cross the boundary (bytes = ``elements * report.bytes_per_element``).
        formula: how ``elements`` is made up, for reports: ``"(N_done+1)·d = 3·256"``, ``"n·d = 4·256"``.
    """

    elements: int
    formula: str


@dataclasses.dataclass(frozen=True)
class SchemeVariant:
    """One named configuration of a scheme that the demo, ``bench.quality`` and the model-level benchmark train or time.

    Attributes:
        key: its command-line name (``"block-attnres"``), unique across schemes.
        label: its table label (``"Block AttnRes (4 blocks)"``).
        options: the config options (``{"blocks": 4}``).
        init_tol: the demo's init-equivalence tolerance (max|Δlogits| / max|logits|) with these options; None where the
            scheme is not function-preserving with them (the demo then reports the gap, not a failure).
        note: why, when ``init_tol`` is looser than 1e-5 or None (one clause, shown in the demo's table).
        demo: whether ``depthrewrite demo`` trains it by default (all variants: ``--schemes all``).
    """

    key: str
    label: str
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    init_tol: float | None = 1e-5
    note: str = ""
    demo: bool = True


class StageHookError(ConfigError):
    """A stage (pipeline planning, boundary reports, ...) needs a hook the scheme's record does not provide."""


@dataclasses.dataclass(frozen=True)
class Scheme:
    """One depth-mixing scheme, as registered by its rewrite file with :func:`register`.

    Attributes:
        name: the registry name (lower case), equal to ``config.name``.
        title: the human name for tables and docs (``"AttnRes"``, ``"mHC"``).
        config: its :class:`SchemeConfig` subclass.
        handler: ``handler(gm, chain, config) -> PassResult``: the rewrite.
        ops: the ``depthrewrite::<op>`` ops its rewrite inserts (names without the namespace; ``()`` for a scheme of
            aten ops only). Any of them marks a graph as converted to this scheme (:func:`scheme_of_op`, read by the
            compile backend's ``scheme=`` check); the first is the one per mixing site (the contract test counts it).
        state_args: per op among ``ops`` whose inputs are not all depth state (what a stage boundary carries), the
            positions of the arguments that are (a tensor, or a list of them); None: every tensor input of every op in
            ``ops`` is. MoDA's attention reads q/k/v and the mask too: only its slot lists (arguments 4 and 5) count.
        block_form: whether the config takes ``blocks`` / ``block_size`` (Block AttnRes, Block MSAR): pipeline cuts
            then fall on block boundaries, and ``block-<name>`` is an alias with ``blocks=DEFAULT_BLOCKS``.
        doc: its docs page, relative to the repository root (``"docs/attnres.md"``).
        exact: the options under which the converted model computes the original's function at init (``{}``: the
            defaults do; mHC ``{"alpha_init": 0.0}``); the contract test checks it on its whole zoo.
        variants: the demo / bench variants, :class:`SchemeVariant` records (a plain ``(key, label, options)`` tuple is
            accepted and made one); none: the scheme is not in the demo or the benchmarks.
        stage_anchor: ``stage_anchor(graph, report, j) -> fx.Node | None``: the first node of the pipeline stage that
            begins with sublayer j (1 <= j < L) in a converted graph; None when the graph has no such site.
        boundary_labels: ``boundary_labels(graph, report, j) -> dict[fx.Node, str]``: readable names of the depth-state
            values crossing a cut before sublayer j.
        state_at: ``state_at(report, j) -> DepthState``: the depth state per token crossing a cut before sublayer j.
        no_cached_decoding: None when a call with a filled KV cache (decoding one token, as ``generate()`` does) is
            exact with the model's own cache (the scheme mixes each token's own values only); else why not, which a
            converted model raises as a :class:`ConfigError` on such a call.
        mixes_tokens: None when the scheme's new ops read each token's own values only; else what they read of other
            tokens (MSAR's convs: the k−1 positions before each one). A call that continues a sequence from state the
            model keeps in its own buffers (a model-managed KV cache, which depthrewrite cannot extend with the
            scheme's state) is then refused as a :class:`ConfigError` naming it (depthrewrite.runtime.state).

    A stage that needs a hook the record leaves ``None`` asks :meth:`hook`, which raises :class:`StageHookError`
    naming the scheme and the hook — never another scheme's behaviour.
    """

    name: str
    title: str
    config: type
    handler: Callable
    ops: tuple[str, ...]
    state_args: dict[str, tuple[int, ...]] | None = None
    block_form: bool = False
    doc: str = ""
    exact: dict[str, Any] = dataclasses.field(default_factory=dict)
    variants: tuple[SchemeVariant, ...] = ()
    stage_anchor: Callable[..., "fx.Node"] | None = None
    boundary_labels: Callable[..., dict] | None = None
    state_at: Callable[..., DepthState] | None = None
    no_cached_decoding: str | None = None
    mixes_tokens: str | None = None

    def hook(self, name: str, stage: str) -> Callable:
        """The hook ``name`` for ``stage`` (e.g. ``"pipeline planning"``), or a :class:`StageHookError` saying the
        scheme does not provide it."""
        fn = getattr(self, name)
        if fn is None:
            raise StageHookError(
                f"{stage}: scheme {self.name!r} registers no {name!r} hook; add one to its Scheme record "
                f"(see CONTRIBUTING.md) to use it with {stage}"
            )
        return fn



def register(record: Scheme) -> Scheme:
    """Register a scheme (called once, at import, by the scheme's rewrite file); returns the record as registered
    (variants given as tuples are :class:`SchemeVariant` records in it)."""
    if record.name != record.config.name:
        raise ConfigError(f"Scheme {record.name!r}: its config {record.config.__name__} is named {record.config.name!r}")
    if record.name != record.name.lower() or record.name.startswith("block-") or record.name == "vanilla":
        # names are looked up lower case, "block-" is the alias prefix, and "vanilla" is the demo's unconverted model
        raise ConfigError(f"Scheme {record.name!r}: a scheme name is lower case, and neither 'vanilla' nor 'block-*'")
    stray = sorted(set(record.state_args or ()) - set(record.ops))
    if stray:  # state_args names ops of this scheme's own
        raise ConfigError(f"Scheme {record.name!r}: state_args names {stray}, which are not among its ops {record.ops}")
    variants = tuple(v if isinstance(v, SchemeVariant) else SchemeVariant(*v) for v in record.variants)
    taken = {v.key for s in _SCHEMES.values() if s.name != record.name for v in s.variants} | {"vanilla"}
    clash = sorted(v.key for v in variants if v.key in taken)
    if clash:  # the demo and the benchmarks look variants up by key across all schemes
        raise ConfigError(f"Scheme {record.name!r}: variant name(s) {clash} are already taken by another scheme")
    record = dataclasses.replace(record, variants=variants)
    _SCHEMES[record.name] = record
    if record.block_form:
        SCHEME_ALIASES.setdefault(f"block-{record.name}", (record.name, {"blocks": DEFAULT_BLOCKS}))
    return record


def unregister(name: str) -> Scheme:
    """Remove a registered scheme (its name, handler and ``block-<name>`` alias); returns its record. For tests that
    register a scheme of their own, and for code that replaces one."""
    key = str(name).strip().lower()
    if key not in _SCHEMES:  # an alias is not a scheme: unregistering "block-attnres" must not remove AttnRes
        raise ConfigError(f"unregister: no scheme named {name!r}; registered: {sorted(_SCHEMES)}")
    record = _SCHEMES.pop(key)
    for alias, (target, _) in list(SCHEME_ALIASES.items()):
        if target == record.name:
            del SCHEME_ALIASES[alias]
    return record


def schemes() -> dict[str, Scheme]:
    """Every registered scheme by name, in registration order."""
    return dict(_SCHEMES)


def scheme(name_or_config: str | SchemeConfig) -> Scheme:
    """The record of a scheme by name (any case, aliases too) or config instance."""
    if isinstance(name_or_config, SchemeConfig):
        key = name_or_config.name
    else:
        key = str(name_or_config).strip().lower().replace("_", "-")
        key = SCHEME_ALIASES.get(key, (key, {}))[0] if key not in _SCHEMES else key
    if key not in _SCHEMES:
        raise ConfigError(f"unknown scheme {name_or_config!r}: choose one of {scheme_names()}")
    return _SCHEMES[key]


def depth_state_inputs(op: str, args: tuple) -> list | None:
    """What of a ``depthrewrite::<op>`` call's ``args`` is depth state (a stage boundary carries it): the arguments at
    the op's ``state_args`` positions, lists flattened; ``args`` itself where every input is; None when ``op`` is not
    a depth op of any registered scheme."""
    s = scheme_of_op(op)
    if s is None:
        return None
    where = (s.state_args or {}).get(op)
    if where is None:
        return list(args)
    out: list = []
    for i in where:
        a = args[i] if i < len(args) else None
        out.extend(a if isinstance(a, (list, tuple)) else [a])
    return out


def scheme_of_op(op: str) -> Scheme | None:
    """The scheme whose rewrite inserts ``depthrewrite::<op>``, or None (an op no registered scheme lists)."""
    return next((s for s in _SCHEMES.values() if op in s.ops), None)
