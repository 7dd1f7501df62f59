"""``depthrewrite.explain()``: what the compile backend did (or would do) to a model's graphs.

    compiled = torch.compile(conv, backend="depthrewrite")
    loss = compiled(ids).logits.sum()
    print(depthrewrite.explain(compiled))       # per graph: depth ops -> kernels, two-phase groups, AOT graphs

    print(depthrewrite.explain(conv))           # not compiled yet: what the backend would do on this device
    print(depthrewrite.explain(compiled, ids))  # runs the model once if it has not run yet
    depthrewrite.explain(compiled, ids, graph_breaks=True)   # + Dynamo's graph-break count (resets Dynamo's caches)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..backend import GraphRecord, records_for
from ..kernels import all_kernel_info as kernel_info
from ..kernels.dispatch import get_kernel_backend, interpreting, last_routes, triton_available, triton_supported_device

__all__ = ["explain", "Explanation", "implementation_of"]


def implementation_of(op: str, device: str) -> str:
    """Which implementation the registered op ``depthrewrite::<op>`` runs on ``device`` under the current settings."""
    infos = kernel_info()
    base = op[: -len("_backward")] if op.endswith("_backward") else op
    info = infos.get(f"depthrewrite::{base}")
    mode = get_kernel_backend()
    if info is None:
        return "PyTorch reference (no fused kernel for this op)"
    if info.forward.startswith("none"):
        return f"PyTorch reference ({info.forward.removeprefix('none:').strip()})"
    kernel = info.backward if op.endswith("_backward") else info.forward
    fallback = f"; falls back to the reference when {info.falls_back}" if info.falls_back else ""
    if mode == "reference":
        return "PyTorch reference (DEPTHREWRITE_KERNELS=reference)"
    if device == "cuda" and triton_available():
        if mode == "triton" or triton_supported_device(device):
            return f"Triton: {kernel}{fallback}"
        return "PyTorch reference (the fused kernels need an NVIDIA GPU of compute capability 8.0 or newer)"
    if mode == "triton":
        if interpreting():
            return f"Triton (interpreter): {kernel}{fallback}"
        return f"raises KernelError: kernel backend 'triton' on {device} needs TRITON_INTERPRET=1 (or use 'auto')"
    return f"PyTorch reference on {device} (Triton: {kernel} on CUDA)"


@dataclass
class Explanation:
    """The result of :func:`explain`; ``print()`` it, or read ``graphs`` / ``to_dict()``."""

    model: str
    compiled: bool
    device: str
    graphs: list[GraphRecord] = field(default_factory=list)
    static_ops: Counter = field(default_factory=Counter)  # for a converted model that is not compiled
    static_two_phase: list = field(default_factory=list)
    graph_breaks: int | None = None
    break_reasons: list[str] = field(default_factory=list)
    note: str = ""
    #: the torch.compile backend of a compiled model, when torch says ("depthrewrite", "inductor", ...; None: unknown)
    backend: str | None = None
    #: the model is wrapped in torch.compile but no graph has been compiled for it yet (Dynamo compiles on first call)
    pending: bool = False

    def kernels(self) -> dict[str, str]:
        """op -> implementation, over every graph (forward and backward)."""
        ops: Counter = Counter(self.static_ops)
        for g in self.graphs:
            ops.update(g.depth_ops)
            for a in g.aot:
                ops.update(a.depth_ops)
        return {op: implementation_of(op, self.device) for op in sorted(ops)}

    def routes(self) -> dict[str, str]:
        """op -> what its last call in this process ran and, for a fallback, why (the op's ``covers`` gate or the
        backend decision; :func:`depthrewrite.kernels.dispatch.last_routes`), for the depth ops of these graphs that
        have run."""
        seen = last_routes()
        out = {}
        for op in self.kernels():
            r = seen.get(f"depthrewrite::{op}")
            if r is not None:
                out[op] = r.impl if r.reason is None else f"{r.impl}: {r.reason}"
        return out

    def state(self) -> str:
        """One phrase: compiled, wrapped but not compiled yet, or not compiled (and with which backend)."""
        if self.graphs:
            return "compiled with backend='depthrewrite'"
        if self.compiled and self.backend not in (None, "depthrewrite"):
            return f"compiled with backend={self.backend!r}, not 'depthrewrite' (below: what depthrewrite's would do)"
        if self.pending:
            return "torch.compile-d, not compiled yet: Dynamo compiles on the first call (below: what the backend will do)"
        return "not compiled (below: what torch.compile(model, backend='depthrewrite') would do)"

    def to_dict(self) -> dict[str, Any]:
        return dict(
            model=self.model,
            compiled=self.compiled,
            pending=self.pending,
            backend=self.backend,
            device=self.device,
            kernel_backend=get_kernel_backend(),
            graph_breaks=self.graph_breaks,
            break_reasons=list(self.break_reasons),
            kernels=self.kernels(),
            last_calls=self.routes(),
            graphs=[
                dict(
                    index=g.index,
                    kind=g.kind,
                    nodes=g.n_nodes,
                    inner=g.inner,
                    depth_ops=dict(g.depth_ops),
                    two_phase=[str(t) for t in g.two_phase],
                    two_phase_declined=[str(t) for t in g.two_phase_declined],
                    two_phase_skipped=g.two_phase_skipped,
                    decomposed=dict(g.decomposed),
                    chain=g.chain_report.to_dict() if g.chain_report is not None else None,
                    chain_error=g.chain_error,
                    aot=[dict(stage=a.stage, nodes=a.n_nodes, depth_ops=dict(a.depth_ops)) for a in g.aot],
                )
                for g in self.graphs
            ],
            two_phase=[str(t) for t in self.static_two_phase],
            note=self.note,
        )

    def __str__(self) -> str:
        lines = [f"depthrewrite.explain: {self.model}"]
        state = self.state()
        lines.append(f"  {state}; device {self.device}; kernel backend {get_kernel_backend()!r}")
        if self.graph_breaks is not None:
            lines.append(f"  graph breaks (Dynamo): {self.graph_breaks}")
            lines += [f"    - {r}" for r in self.break_reasons]
        if self.note:
            lines.append(f"  {self.note}")
        for g in self.graphs:
            lines.append(f"graph {g.index}: {g.kind}, {g.n_nodes} nodes, inner compiler {g.inner}")
            if g.depth_ops:
                lines.append("  depth ops: " + ", ".join(f"{op} ×{n}" for op, n in sorted(g.depth_ops.items())))
            for t in g.two_phase:
                lines.append(f"  two-phase: {t}")
            for t in g.two_phase_declined:
                lines.append(f"  two-phase declined (cost model; two_phase='always' forces it): {t}")
            if g.kind == "converted" and not g.two_phase and not g.two_phase_declined:
                lines.append(f"  two-phase: not applied ({g.two_phase_skipped or 'no sites share a block prefix'})")
            if g.decomposed:
                lines.append(
                    "  lowered to the reference's aten ops for inductor (no Triton kernel runs them here): "
                    + ", ".join(f"{op} ×{n}" for op, n in sorted(g.decomposed.items()))
                )
            if g.chain_report is not None:
                c = g.chain_report.chain
                lines.append(
                    f"  PreNorm chain found: {len(c.sublayers)} sublayers, hidden {c.hidden_size} — not converted; "
                    "use depthrewrite.convert(model, scheme) to rewrite it"
                )
            if g.chain_error:
                lines.append(f"  no PreNorm chain in this graph: {g.chain_error}")
            for a in g.aot:
                ops = ", ".join(f"{op} ×{n}" for op, n in sorted(a.depth_ops.items())) or "no depth ops"
                lines.append(f"  AOT {a.stage} graph: {a.n_nodes} nodes; {ops}")
            if g.inner == "inductor" and not g.aot:
                lines.append("  AOT graphs: served from inductor's compile cache (not traced again), so not listed")
        if self.static_ops:
            lines.append("depth ops in the converted graph: " + ", ".join(f"{o} ×{n}" for o, n in sorted(self.static_ops.items())))
            for t in self.static_two_phase:
                verdict = "would batch" if t.worth_it else "would leave as single passes (cost model)"
                lines.append(f"  two-phase {verdict}: {t}")
        kernels = self.kernels()
        if kernels:
            lines.append("kernels:")
            width = max(len(k) for k in kernels)
            lines += [f"  {op:<{width}}  {impl}" for op, impl in kernels.items()]
            infos = kernel_info()
            fused = {o: infos[f"depthrewrite::{o}"].fuses for o in kernels if f"depthrewrite::{o}" in infos}
            if fused:
                lines.append("what each fused kernel fuses:")
                lines += [f"  {op:<{width}}  {text}" for op, text in fused.items()]
            routes = self.routes()
            if routes:
                lines.append("last call of each op (what ran; why a call fell back):")
                lines += [f"  {op:<{width}}  {text}" for op, text in routes.items()]
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle):  # IPython
        p.text(str(self))


def _device_of_module(module: nn.Module) -> str:
    p = next(iter(module.parameters()), None)
    return p.device.type if p is not None else "cpu"


def _describe_model(module: nn.Module) -> str:
    """A converted model (or one converted graph) by its original class name and conversion:
    ``LlamaForCausalLM converted to Block AttnRes (S=2 sublayers per block), ...: 8 sites, 1,024 new parameters``."""
    r = module.report()
    scheme = r.describe() if hasattr(r, "describe") else r.config.describe(r.block_size)
    return f"{r.model_class} converted to {scheme}: {len(r.sites)} sites, {r.new_params:,} new parameters"


def _backend_name(compiled: nn.Module) -> str | None:
    """The backend a ``torch.compile``-d module was compiled with, read from Dynamo's wrappers (private attributes:
    None when this torch stores it elsewhere)."""
    obj: Any = getattr(getattr(compiled, "dynamo_ctx", None), "callback", None)
    for _ in range(4):
        name = getattr(obj, "compiler_name", None) or getattr(obj, "_compiler_name", None)
        if isinstance(name, str):
            return name
        obj = getattr(obj, "_torchdynamo_orig_backend", None)
        if obj is None:
            return None
    return None


def explain(model: nn.Module, *args: Any, graph_breaks: bool = False, **kwargs: Any) -> Explanation:
    """Explain what the ``depthrewrite`` compile backend did to ``model``'s graphs.

    Args:
        model: a ``torch.compile``-d module (backend ``"depthrewrite"``), a converted model (not compiled: shows what
            the backend would do), or any module that was compiled with the backend.
        *args, **kwargs: optional example inputs; a compiled model that has not run yet is run once with them (Dynamo
            compiles lazily).
        graph_breaks (bool): also run Dynamo's own ``torch._dynamo.explain`` on the inputs for the number of graph
            breaks and their reasons. It traces the model again and **resets Dynamo's caches** (every compiled
            function in the process recompiles on its next call), so it is off by default.

    Returns:
        An :class:`Explanation`; ``print()`` it.
    """
    from torch._dynamo.eval_frame import OptimizedModule

    from ..converted import ConvertedGraphModule, graph_module_of
    from ..errors import ConfigError
    from ..runtime.handle import is_converted

    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"depthrewrite.explain() takes a module (a converted model, or torch.compile of a module), not "
            f"{type(model).__name__}; for a compiled function, explain the module it calls"
        )
    compiled = isinstance(model, OptimizedModule)
    module = model._orig_mod if compiled else model
    converted = isinstance(module, ConvertedGraphModule) or is_converted(module)
    name = _describe_model(module) if converted else type(module).__name__
    device = _device_of_module(module)
    backend = _backend_name(model) if compiled else None
    graphs = records_for(module)
    if compiled and not graphs and (args or kwargs):
        with torch.no_grad():
            model(*args, **kwargs)
        graphs = records_for(module)
    exp = Explanation(model=name, compiled=compiled or bool(graphs), device=device, graphs=graphs, backend=backend,
                      pending=compiled and not graphs and backend in (None, "depthrewrite"))
    if graph_breaks:
        if not (args or kwargs):
            raise ConfigError("explain(..., graph_breaks=True) needs example inputs to trace the model with")
        from torch._dynamo import explain as dynamo_explain

        out = dynamo_explain(module)(*args, **kwargs)
        exp.graph_breaks = out.graph_break_count
        exp.break_reasons = [str(getattr(b, "reason", b)).split("\n")[0] for b in out.break_reasons]
    if not graphs:
        if converted:
            from ..backend import depth_ops
            from ..passes.lower.two_phase import find_two_phase_groups

            graph = graph_module_of(module).graph
            exp.static_ops = depth_ops(graph)
            exp.static_two_phase = find_two_phase_groups(graph)
            if exp.pending:
                exp.note = ("nothing has run yet: call the model once (or pass example inputs, explain(compiled, "
                            "*inputs)) to see the graphs the backend compiled")
        elif compiled:
            exp.note = "compiled lazily: nothing has run yet; call the model once, or pass example inputs to explain()"
        else:
            exp.note = (
                "not compiled with backend='depthrewrite' and not converted; depthrewrite.inspect(model) shows its "
                "chain, depthrewrite.convert(model, scheme) rewrites it"
            )
    return exp
