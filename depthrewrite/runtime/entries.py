"""Call structures and the graphs captured for them (:class:`GraphEntry`: a graph, the guards on its input sizes),
and the lock that keeps captures and calls from different threads apart."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import Any, Iterator, Mapping

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ..capture import is_cache

# ---- call structures ----------------------------------------------------------------------------------------------


def _describe_leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", x.dtype, x.device, x.dim())
    try:
        hash(x)
    except TypeError:
        return ("obj", type(x).__qualname__)
    if isinstance(x, (bool, int, float, str, type(None))) or x is Ellipsis:
        return ("V", type(x).__name__, x)
    return ("obj", type(x).__qualname__)


def describe_value(value: Any) -> Any:
    leaves, spec = pytree.tree_flatten(value)
    if spec.is_leaf():
        return _describe_leaf(value)
    return (str(spec), tuple(map(_describe_leaf, leaves)))


def call_graph(gm: fx.GraphModule, args: tuple, kwargs: dict, checked: bool = False) -> Any:
    """Run ``gm`` (a runner or flat graph) as ``gm(*args, **kwargs)`` does, but not as a module call: its own forward
    pre-hooks (export's input checks) run, then its forward. A global module hook (FlopCounterMode, ModuleTracker)
    then sees the model's modules that the graph calls, never the graph module itself, which the original does not
    have. A graph with any other hook is called as a module. ``checked``: the call's inputs were matched against the
    graph's complete guards (:meth:`GraphEntry.matches`), so export's own input check, which would check the same
    sizes again through sympy (~0.4 ms a call, a third of a decoded token's overhead), is skipped."""
    if gm._forward_hooks or gm._backward_hooks or gm._backward_pre_hooks or gm._forward_hooks_with_kwargs:
        return gm(*args, **kwargs)
    for k, h in gm._forward_pre_hooks.items():
        if checked and h is _EXPORT_INPUT_CHECK and SKIP_EXPORT_INPUT_CHECK:
            continue
        if k in gm._forward_pre_hooks_with_kwargs:
            r = h(gm, args, kwargs)
            if r is not None:
                args, kwargs = r
        else:
            r = h(gm, args)
            if r is not None:
                args = r if isinstance(r, tuple) else (r,)
    return gm.forward(*args, **kwargs)


def _export_input_check() -> Any:
    try:
        from torch.export._unlift import _check_input_constraints_pre_hook
    except ImportError:  # pragma: no cover - another torch layout: never skipped
        return None
    return _check_input_constraints_pre_hook


_EXPORT_INPUT_CHECK = _export_input_check()
#: False runs export's input check on every call as before (for measuring only: ``python -m bench.generation --ab``)
SKIP_EXPORT_INPUT_CHECK = True


@dataclasses.dataclass
class GraphEntry:
    """One captured and rewritten graph: the call structure it serves, its shape guards and how long capture took."""

    module: fx.GraphModule  # a ConvertedGraphModule (see depthrewrite.converted)
    structure: str  # readable: "train, input_ids: int64[2d], labels: int64[2d]"
    guards: tuple  # per tensor input: {dim: fixed size, (symbol, lowest, highest or None), or Derived}
    seconds: float
    calls: int = 0
    runner: Any = None  # the module a call runs: glue plus one call per block module (depthrewrite.blocks); None: module
    offloaded: tuple = ()  # (path, module, hook): accelerate-offloaded modules its graphs read directly (.offload)
    collective: str | None = None  # a cross-rank collective traced into the graphs it runs (described), if any

    @property
    def run(self) -> fx.GraphModule:
        return self.module if self.runner is None else self.runner

    @property
    def module_calls(self) -> bool:
        """Whether its graphs call the model's intact modules as live modules (the lowering's ``called`` list that
        :func:`depthrewrite.blocks.build_runner` records; False: every module's ops are inlined), which a global
        module hook (FlopCounterMode, ModuleTracker) needs."""
        calls = self.runner.meta.get("depthrewrite_module_calls") if self.runner is not None else None
        return bool(calls and calls["called"])

    def graphs(self) -> list[fx.Graph]:
        """The graphs a call runs: the runner's and its block programs', or the flat graph's."""
        run = self.run
        return [run.graph, *(p.graph for p in run.__dict__.get("_dr_programs", {}).values())]

    def matches(self, tensors: list[torch.Tensor]) -> bool:
        """Whether a call's tensors (flattened, in the graph's input order) fit this graph's shape guards: every
        size the guards fix, every dynamic size within its range and equal per symbol, every derived size (a cache
        length ``s0 + 1``) equal to its expression of those symbols. With :attr:`complete` guards this is all
        export's own input check would check of a call of this structure (the structure, and the values of
        non-tensor inputs, are the call's key), so :func:`call_graph` skips that check."""
        if len(tensors) != len(self.guards):
            return False
        symbols: dict[str, int] = {}
        derived: list[tuple[Derived, int]] = []
        for t, dims in zip(tensors, self.guards):
            for d, g in dims.items():
                if d >= t.dim():
                    return False
                s = int(t.shape[d])
                if isinstance(g, int):
                    if s != g:
                        return False
                elif isinstance(g, Derived):
                    derived.append((g, s))
                else:  # export assumes dynamic sizes are >= 2, within the range the trace allowed, equal per symbol
                    name, lo, hi = g
                    if s < max(2, lo) or (hi is not None and s > hi) or symbols.setdefault(name, s) != s:
                        return False
        for g, s in derived:
            value = symbols.get(g.symbol)
            want = g(value) if value is not None else None
            if want is None:  # not evaluable here: export's own check decides, as before
                self.__dict__["complete"] = False
            elif want != s:
                return False
        return True

    @functools.cached_property
    def complete(self) -> bool:
        """Whether :meth:`matches` checks every size export's input check would: each derived size's symbol is also
        a size of its own somewhere (so its value is known before the derived one is compared)."""
        plain = {g[0] for dims in self.guards for g in dims.values() if isinstance(g, tuple)}
        return all(g.symbol in plain for dims in self.guards for g in dims.values() if isinstance(g, Derived))


class Derived:
    """A guard on a size the graph computes from one size symbol (``s0 + 1``, ``2*s0``): the value it must have
    for a given value of the symbol (sympy's evaluation, remembered per value: a decoding loop asks once per
    length)."""

    __slots__ = ("symbol", "expr", "_sym", "_seen")

    def __init__(self, expr: Any):
        (self._sym,) = expr.free_symbols
        self.symbol = str(self._sym)
        self.expr = expr
        self._seen: dict[int, int | None] = {}

    def __call__(self, value: int) -> int | None:
        out = self._seen.get(value, -1)
        if out == -1:
            import sympy

            r = self.expr.xreplace({self._sym: sympy.Integer(value)})
            out = int(r) if r.is_number else None
            if len(self._seen) < 4096:
                self._seen[value] = out
        return out

    def __repr__(self) -> str:
        return f"Derived({self.expr})"


def guards_of(gm: fx.GraphModule) -> tuple:
    out = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        v = n.meta.get("val")
        if not isinstance(v, torch.Tensor):
            continue
        dims: dict[int, Any] = {}
        for d, s in enumerate(v.shape):
            if isinstance(s, torch.SymInt):
                expr = s.node.expr
                if expr.is_number:
                    dims[d] = int(expr)
                elif expr.is_Symbol:
                    dims[d] = (str(expr), *_range(s.node.shape_env, expr))
                elif len(expr.free_symbols) == 1:  # a derived size (s0 + 1): checked against its symbol's value
                    dims[d] = Derived(expr)
                else:  # of several symbols: export defers such a relation to the graph's own checks, as here
                    continue
            else:
                dims[d] = int(s)
        out.append(dims)
    return tuple(out)


def _range(shape_env: Any, expr: Any) -> tuple[int, int | None]:
    """The value range the trace allowed a size symbol (a model's ``if T > 8`` makes T <= 8 a condition of its graph)."""
    r = getattr(shape_env, "var_to_range", {}).get(expr) if shape_env is not None else None
    if r is None:
        return 2, None
    def finite(x: Any) -> int | None:
        try:
            return int(x) if x.is_number and x.is_finite else None
        except Exception:  # noqa: BLE001 - sympy / torch infinities of several kinds
            return None

    lo, hi = finite(r.lower), finite(r.upper)
    return lo if lo is not None else 2, hi if hi is not None and hi < 2**62 else None


def readable_structure(training: bool, bound: Mapping[str, Any]) -> str:
    def one(x):
        if isinstance(x, torch.Tensor):
            return f"{str(x.dtype).replace('torch.', '')}[{x.dim()}d]"
        if is_cache(x):
            return f"{type(x).__name__}({x.get_seq_length()} cached)"
        if isinstance(x, (bool, int, float, str)):
            return repr(x)
        return type(x).__name__

    return ", ".join(["train" if training else "eval", *(f"{k}={one(v)}" for k, v in bound.items())])


# ---- threads ------------------------------------------------------------------------------------------------------


class _CaptureLock:
    """Captures run alone; calls that need none run concurrently (a server's thread pool).

    A capture is not confined to its thread: ``torch.export`` (non-strict) patches ``nn.Module.__call__`` and other
    process-wide state while it traces, and the model being captured runs as its original class meanwhile. So every
    call of a converted model holds this lock *shared* (:meth:`ConvertedModel.__call__`, before ``nn.Module.__call__``
    runs), and a capture holds it *exclusive*: it waits until no other thread is inside a converted model, and new
    calls wait at the door until it is done. A thread waiting to capture lets go of its own shared holds meanwhile (two
    calls that both need a capture take turns instead of waiting for each other), and new calls give way to a waiting
    capture. ``mutex`` guards the graph dicts and the module-tree record (:meth:`ConversionState.select`). One lock for
    the process: the state export patches is the process's."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._shared = 0  # shared holds, all threads (a thread waiting to capture does not count its own)
        self._owner: int | None = None  # the thread capturing
        self._depth = 0  # its nested exclusive holds
        self._waiting = 0  # threads waiting to capture
        self._mine = threading.local()  # .n: this thread's shared holds
        self.mutex = threading.RLock()

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            mine = getattr(self._mine, "n", 0)
            while self._owner not in (None, me) or (self._waiting and not mine and self._owner is None):
                self._cond.wait()
            self._shared += 1
            self._mine.n = mine + 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._mine.n -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            if self._owner != me:
                mine = getattr(self._mine, "n", 0)
                self._shared -= mine
                self._waiting += 1
                self._cond.notify_all()
                try:
                    while self._owner is not None or self._shared > 0:
                        self._cond.wait()
                except BaseException:  # interrupted while waiting: take the own holds back, give way again
                    self._waiting -= 1
                    self._shared += mine
                    self._cond.notify_all()
                    raise
                self._waiting -= 1
                self._owner = me
            self._depth += 1
        try:
            yield
        finally:
            with self._cond:
                self._depth -= 1
                if not self._depth:
                    self._owner = None
                    self._shared += getattr(self._mine, "n", 0)
                self._cond.notify_all()


LOCK = _CaptureLock()


def traced_call(args: tuple, kwargs: dict) -> bool:
    """Whether this call is being traced (Dynamo, or torch.export with fake inputs) rather than run: per call, since
    torch's is_exporting()/is_compiling() flags are the process's and are on while another thread captures."""
    if torch.compiler.is_dynamo_compiling():
        return True
    if not torch.compiler.is_exporting():
        return False
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(x, FakeTensor) for x in pytree.tree_leaves((args, kwargs)))
