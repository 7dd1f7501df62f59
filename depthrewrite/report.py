"""ChainReport: what detection found, as a table, a networkx graph, a DOT/SVG diagram, and a marked graph listing."""

from __future__ import annotations

import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import networkx as nx
import torch.fx as fx
from tabulate import tabulate

from .errors import ConfigError
from .passes.analyse.chain import Chain

__all__ = ["ChainReport", "ConvertReport", "SiteInfo", "write_dot"]


def write_dot(dot: str, path: Path, *, what: str, formats: str, no_pydot: str, no_graphviz: str) -> Path:
    """Write DOT text to ``path``: ``.dot`` as is; ``.svg`` / ``.png`` rendered through pydot and Graphviz's ``dot``.

    ``what`` and ``formats`` name the picture and the suffixes the caller accepts; ``no_pydot`` / ``no_graphviz``
    end the error messages with what works without them. Raises :class:`ConfigError` for anything else."""
    if path.suffix == ".dot":
        path.write_text(dot)
        return path
    if path.suffix not in (".svg", ".png"):
        raise ConfigError(f"cannot save {what} as {path.suffix!r}: use {formats}")
    try:
        import pydot
    except ImportError as e:
        raise ConfigError(f"saving {path.name} needs pydot: `pip install 'depthrewrite[viz]'`{no_pydot}") from e
    if shutil.which("dot") is None:
        raise ConfigError(f"saving {path.name} needs Graphviz's `dot` program (e.g. `apt-get install graphviz`){no_graphviz}")
    (graph,) = pydot.graph_from_dot_data(dot)
    getattr(graph, f"write_{path.suffix[1:]}")(str(path))
    return path


@dataclass(frozen=True)
class ChainReport:
    """The detected PreNorm residual chain of one model. ``print(report)`` shows it as a table."""

    model_class: str
    chain: Chain
    graph: fx.GraphModule | None = field(default=None, repr=False, compare=False)

    # -- summary ------------------------------------------------------------------------------------------------------
    @property
    def num_sublayers(self) -> int:
        return len(self.chain.sublayers)

    def rows(self) -> list[dict[str, Any]]:
        """One dict per sublayer (the table's rows)."""
        out = []
        for s in self.chain.sublayers:
            norms = sorted({b.pre_norm.short for b in s.branches if b.pre_norm is not None})
            post = sorted({b.post_norm.short for b in s.branches if b.post_norm is not None})
            out.append(
                dict(
                    index=s.index,
                    module=s.branch_module or s.module or "?",
                    kind=s.kind,
                    norm=", ".join(norms) or "-",
                    post_norm=", ".join(post) or "-",
                    reading=s.reading,
                    ops=sum(b.n_ops for b in s.branches),
                    params=sum(b.n_params for b in s.branches),
                    hidden=self.chain.hidden_size,
                )
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        c = self.chain
        return dict(
            model_class=self.model_class,
            ir=c.ir,
            hidden_size=c.hidden_size,
            source=dict(node=c.source, module=c.source_module),
            final_norm=dict(node=c.final_norm.output, module=c.final_norm.module, kind=c.final_norm.label),
            sublayers=self.rows(),
            notes=list(c.notes),
        )

    def __str__(self) -> str:
        c = self.chain
        counts = Counter(s.kind for s in c.sublayers)
        kinds = ", ".join(f"{n} {k}" for k, n in counts.items())
        head = [
            f"{self.model_class}: {self.num_sublayers} sublayers ({kinds}), hidden size {c.hidden_size}, {c.ir} graph",
            f"stream source: `{c.source}` ({c.source_module or 'graph input'})",
            f"final norm:    {c.final_norm.module or c.final_norm.output} ({c.final_norm.label})",
        ]
        rows = self.rows()
        show_post = any(r["post_norm"] != "-" for r in rows)
        table = [
            [r["index"], r["module"], r["kind"], r["norm"]]
            + ([r["post_norm"]] if show_post else [])
            + [r["reading"], r["ops"], f"{r['params']:,}", r["hidden"]]
            for r in rows
        ]
        headers = ["#", "module", "kind", "pre-norm"] + (["post-norm"] if show_post else []) + ["reading", "ops", "params", "hidden"]
        text = "\n".join(head) + "\n" + tabulate(table, headers=headers, tablefmt="simple")
        if c.notes:
            text += "\n" + "\n".join(f"note: {n}" for n in c.notes)
        return text

    def __repr__(self) -> str:
        return f"ChainReport({self.model_class}, sublayers={self.num_sublayers}, kinds={self.chain.kinds!r})"

    # -- pictures -----------------------------------------------------------------------------------------------------
    def to_networkx(self) -> nx.DiGraph:
        """The chain as a graph: stream nodes ``h0..hL`` joined by skip edges, and per sublayer its norm(s) and branch."""
        c = self.chain
        g = nx.DiGraph(model=self.model_class)
        g.add_node("h0", role="source", node=c.source, module=c.source_module, label=f"h0 = {c.source_module or c.source}")
        for s in c.sublayers:
            h_in, h_out = f"h{s.index}", f"h{s.index + 1}"
            g.add_node(h_out, role="residual_add", node=s.residual_add, module=s.module, label=f"h{s.index + 1} = + ({s.module})")
            g.add_edge(h_in, h_out, kind="skip")
            for j, b in enumerate(s.branches):
                bid = f"s{s.index}.{j}"
                entry = h_in
                if b.pre_norm is not None:
                    nid = f"{bid}.norm"
                    g.add_node(nid, role="pre_norm", node=b.pre_norm.output, module=b.pre_norm.module, label=f"{b.pre_norm.module}\\n{b.pre_norm.short}")
                    g.add_edge(h_in, nid)
                    entry = nid
                g.add_node(bid, role="branch", kind=b.kind, node=b.output, module=b.module, label=f"{b.kind}: {b.module}")
                g.add_edge(entry, bid)
                if b.post_norm is not None:
                    pid = f"{bid}.post"
                    g.add_node(pid, role="post_norm", node=b.post_norm.output, module=b.post_norm.module, label=f"{b.post_norm.module}\\n{b.post_norm.short}")
                    g.add_edge(bid, pid)
                    bid = pid
                g.add_edge(bid, h_out, kind="branch")
        last = f"h{len(c.sublayers)}"
        g.add_node("final_norm", role="final_norm", node=c.final_norm.output, module=c.final_norm.module, label=f"{c.final_norm.module}\\n{c.final_norm.short}")
        g.add_edge(last, "final_norm")
        return g

    def to_dot(self) -> str:
        """Graphviz DOT text of :meth:`to_networkx` (no pydot needed for the text)."""
        colours = dict(source="#cfe2ff", residual_add="#e9ecef", pre_norm="#fff3cd", post_norm="#fff3cd", final_norm="#fff3cd")
        kind_colours = dict(attention="#d1e7dd", mlp="#f8d7da", other="#e2d9f3")
        g = self.to_networkx()
        lines = [f'digraph "{self.model_class}" {{', "  rankdir=TB;", '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];']
        for n, d in g.nodes(data=True):
            fill = kind_colours.get(d.get("kind"), colours.get(d["role"], "#ffffff"))
            shape = "ellipse" if d["role"] == "residual_add" else "box"
            lines.append(f'  "{n}" [label="{_esc(d["label"])}", fillcolor="{fill}", shape={shape}];')
        for a, b, d in g.edges(data=True):
            style = ' [style=dashed, color="#6c757d"]' if d.get("kind") == "skip" else ""
            lines.append(f'  "{a}" -> "{b}"{style};')
        lines.append("}")
        return "\n".join(lines) + "\n"

    def save(self, path: str | Path) -> Path:
        """Write the diagram: ``.dot`` always works; ``.svg`` / ``.png`` need the ``viz`` extra (pydot) and Graphviz."""
        return write_dot(
            self.to_dot(),
            Path(path),
            what="a chain diagram",
            formats=".svg, .png or .dot",
            no_pydot=" (and Graphviz's `dot`, e.g. `apt-get install graphviz`). report.to_dot() and "
            "report.save('chain.dot') work without them.",
            no_graphviz="; report.save('chain.dot') works without it.",
        )

    def graph_text(self, only_chain: bool = False) -> str:
        """The captured graph as one line per op, with the chain's nodes marked (``<< source``, ``<< pre-norm 3``...)."""
        if self.graph is None:
            raise ConfigError("this report has no graph attached (it was built from a Chain alone)")
        marks: dict[str, str] = {self.chain.source: "stream source"}
        for s in self.chain.sublayers:
            for b in s.branches:
                if b.pre_norm is not None:
                    marks.setdefault(b.pre_norm.output, f"pre-norm {s.index}")
                if b.post_norm is not None:
                    marks.setdefault(b.post_norm.output, f"post-norm {s.index}")
                marks.setdefault(b.output, f"branch {s.index} ({b.kind})")
            marks[s.residual_add] = f"residual add {s.index}"
        marks[self.chain.final_norm.output] = "final norm"
        lines = []
        for n in self.graph.graph.nodes:
            if n.op in ("placeholder", "get_attr", "output"):
                continue
            mark = marks.get(n.name)
            if only_chain and mark is None:
                continue
            target = getattr(n.target, "__name__", str(n.target))
            args = ", ".join(a.name if isinstance(a, fx.Node) else _short(a) for a in n.args)
            line = f"{n.name} = {target}({args})"
            lines.append(f"{line:<72} << {mark}" if mark else line)
        return "\n".join(lines)


def _short(a: Any) -> str:
    s = repr(a)
    return s if len(s) <= 24 else s[:21] + "..."


def _esc(s: str) -> str:
    return s.replace('"', '\\"')


@dataclass(frozen=True)
class SiteInfo:
    """One mixing site of a converted model."""

    site: int | str  # sublayer index, or "output"
    module: str | None  # the sublayer (or final norm) the site feeds
    sources: tuple[str, ...]  # what the site reads: "emb", "out3", "b1", "partial b2"; mHC: the n streams
    params: int
    detail: str = ""  # scheme-specific, e.g. mHC's coefficient shapes


@dataclass(frozen=True)
class ConvertReport:
    """What :func:`depthrewrite.convert` did: per mixing site its sources and parameters, and the totals."""

    model_class: str
    config: Any  # the SchemeConfig that ran
    chain: Chain
    sites: tuple[SiteInfo, ...]
    new_params: int
    model_params: int
    stored_sources: int  # vectors of size d kept per token as depth state (Full: L+1, Block: N_eff+1, mHC: n)
    bytes_per_element: int = 4
    block_size: int | None = None
    notes: tuple[str, ...] = ()
    state_elements: int | None = None  # values per token, when the depth state is not d-sized vectors (MoDA)
    state_label: str = "stored depth state"
    pipeline: Any = None  # depthrewrite.pipeline.PipelineInfo once the model is split into stages

    @property
    def param_ratio(self) -> float:
        return self.new_params / max(1, self.model_params)

    @property
    def memory_per_token(self) -> int:
        """Bytes per token of the depth state (stored sources, n streams, or MoDA's transient slots)."""
        values = self.state_elements if self.state_elements is not None else self.stored_sources * self.chain.hidden_size
        return values * self.bytes_per_element

    def to_dict(self) -> dict[str, Any]:
        return dict(
            model_class=self.model_class,
            config=self.config.to_dict(),
            sites=[dict(site=s.site, module=s.module, sources=list(s.sources), params=s.params, detail=s.detail) for s in self.sites],
            new_params=self.new_params,
            model_params=self.model_params,
            stored_sources=self.stored_sources,
            memory_per_token=self.memory_per_token,
            **({"pipeline": self.pipeline.to_dict()} if self.pipeline is not None else {}),
        )

    def __str__(self) -> str:
        L = len(self.chain.sublayers)
        head = [
            f"{self.model_class} -> {self.config.describe(self.block_size)}: {len(self.sites)} sites over {L} sublayers",
            f"new parameters: {self.new_params:,} ({100 * self.param_ratio:.3f}% of {self.model_params:,})",
        ]
        if self.state_elements is None:
            size = f"{self.stored_sources} x d={self.chain.hidden_size}"
        else:
            size = f"{self.state_elements:,} values"
        head.append(f"{self.state_label} per token: {size} = {self.memory_per_token:,} bytes ({self.bytes_per_element}-byte elements)")
        head += list(self.notes)
        detail = any(s.detail for s in self.sites)
        rows = [
            [s.site, s.module or "-", len(s.sources), " ".join(s.sources), f"{s.params:,}"] + ([s.detail] if detail else [])
            for s in self.sites
        ]
        headers = ["site", "before", "K", "reads", "params"] + (["coefficients"] if detail else [])
        text = "\n".join(head) + "\n" + tabulate(rows, headers=headers, tablefmt="simple")
        if self.pipeline is not None:
            text += "\n" + self.pipeline.table()
        return text

    def __repr__(self) -> str:
        return f"ConvertReport({self.model_class}, {self.config!r}, sites={len(self.sites)})"
