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

from ..errors import ConfigError
from ..passes.analyse.chain import Chain

__all__ = ["ChainReport", "ConvertReport", "SiteInfo", "write_dot", "graphviz_dot"]


def graphviz_dot() -> str | None:
    """The path of Graphviz's ``dot`` program, or None (tests replace this to check the matplotlib fallback)."""
    return shutil.which("dot")


def write_dot(
    dot: str,
    path: Path,
    *,
    what: str,
    formats: str,
    no_pydot: str,
    no_graphviz: str,
    graph: nx.DiGraph | None = None,
    title: str = "",
) -> Path:
    """Write DOT text to ``path``: ``.dot`` as is; ``.svg`` / ``.png`` rendered through pydot and Graphviz's ``dot``,
    or, where either is missing and ``graph`` is given, drawn from ``graph`` with matplotlib
    (:func:`depthrewrite.views.render.draw_layered`).

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
        pydot, missing = None, ConfigError(f"saving {path.name} needs pydot: `pip install 'depthrewrite[viz]'`{no_pydot}")
        missing.__cause__ = e
    else:
        missing = None
        if graphviz_dot() is None:
            missing = ConfigError(
                f"saving {path.name} needs Graphviz's `dot` program (e.g. `apt-get install graphviz`) or matplotlib"
                f"{no_graphviz}"
            )
    if missing is not None:
        if graph is None:
            raise missing
        from .render import draw_layered

        try:
            return draw_layered(graph, path, title=title)
        except ConfigError:
            raise missing from None
    (parsed,) = pydot.graph_from_dot_data(dot)
    getattr(parsed, f"write_{path.suffix[1:]}")(str(path))
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
            f"stream source: `{c.source}` ({c.source_module or ('graph input' if c.source_is_input else 'computed in the root forward, not a graph input')})",
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
                g.add_edge(entry, bid, lateral=entry != h_in)  # lateral: drawn beside its norm (render.py)
                if b.post_norm is not None:
                    pid = f"{bid}.post"
                    g.add_node(pid, role="post_norm", node=b.post_norm.output, module=b.post_norm.module, label=f"{b.post_norm.module}\\n{b.post_norm.short}")
                    g.add_edge(bid, pid, lateral=True)
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
        """Write the diagram: ``.dot`` always works; ``.svg`` / ``.png`` are rendered by Graphviz (pydot and ``dot``)
        when installed, else drawn with matplotlib (the ``viz`` extra)."""
        return write_dot(
            self.to_dot(),
            Path(path),
            what="a chain diagram",
            formats=".svg, .png or .dot",
            no_pydot=" (and Graphviz's `dot`, e.g. `apt-get install graphviz`), or matplotlib. report.to_dot() and "
            "report.save('chain.dot') work without them.",
            no_graphviz="; report.save('chain.dot') works without either.",
            graph=self.to_networkx(),
            title=f"{self.model_class}: detected PreNorm residual chain ({self.num_sublayers} sublayers)",
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
    state_elements: int = 0  # depth-state values per token the site reads when not d-sized sources (MoDA's depth KV)


@dataclass(frozen=True, kw_only=True)
class ConvertReport(ChainReport):
    """What :func:`depthrewrite.convert` did: per mixing site its sources and parameters, and the totals.

    A :class:`ChainReport` too (the chain it rewrote; ``rows()``), so :func:`depthrewrite.inspect` returns one type.
    Fields are keyword-only."""

    config: Any  # the SchemeConfig that ran
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
    graphs: tuple[tuple[str, float, int], ...] = ()  # (call structure, capture seconds, calls) per captured graph
    blocks: tuple = ()  # depthrewrite.blocks.BlockInfo per block module the converted model calls

    def describe(self) -> str:
        """The scheme in one line with this conversion's block size (``Block AttnRes (S=2 sublayers per block),
        mix_scale='count'``); ``config.describe()`` alone does not know S."""
        return self.config.describe(self.block_size)

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
            graphs=[dict(structure=s, capture_seconds=t, calls=n) for s, t, n in self.graphs],
            blocks=[b.to_dict() for b in self.blocks],
        )

    def __str__(self) -> str:
        L = len(self.chain.sublayers)
        head = [
            f"{self.model_class} -> {self.describe()}: {len(self.sites)} sites over {L} sublayers",
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
        if self.graphs:
            text += f"\ngraphs captured ({len(self.graphs)}; one per call structure, on first use):\n" + tabulate(
                [[i, s, f"{t:.2f} s", n] for i, (s, t, n) in enumerate(self.graphs)],
                headers=["#", "call structure", "capture", "calls"], tablefmt="simple",
            )
        if self.blocks:
            from ..blocks import block_table

            cuts = tuple(self.pipeline.cuts) if self.pipeline is not None else None
            text += "\n" + block_table(self.blocks, self.chain.hidden_size, cuts)
        if self.pipeline is not None:
            text += "\n" + self.pipeline.table()
        return text

    def __repr__(self) -> str:
        return f"ConvertReport({self.model_class}, {self.config!r}, sites={len(self.sites)})"

    # -- pictures -----------------------------------------------------------------------------------------------------
    def to_networkx(self) -> nx.DiGraph:
        """The conversion as a graph: stream source, one box per sublayer (its norm inside), one node per mixing site
        before the sublayer (or final norm) it feeds, and what each site reads: ``emb`` from the source, ``out<k>``
        from sublayer k, a completed block ``b<j>`` from its block-sum node, an open block ``partial b<j>`` from its
        sublayers so far. Sources without a node of their own (mHC's streams ``x0..``) are named in the site's label.
        For the graph the rewrite actually produced, see :func:`depthrewrite.views.draw.rewritten_networkx`."""
        c = self.chain
        g = nx.DiGraph(model=self.model_class, scheme=self.describe())
        g.add_node("source", role="source", label=f"stream source\\n{c.source_module or c.source}")
        sites = {s.site: s for s in self.sites}
        S = self.block_size or 1
        prev = "source"

        def add_site(key: int | str, info: SiteInfo, before: str) -> str:
            sid = f"site:{key}"
            reads = list(info.sources)
            names = ", ".join(reads) if reads else "-"
            wrapped = "\\n".join(", ".join(reads[i:i + 6]) for i in range(0, len(reads), 6)) if reads else "(no stored sources)"
            g.add_node(sid, role="site", label=f"mix at site {key} (K={len(reads)})\\n{wrapped}", reads=names)
            linked = False
            here = len(c.sublayers) if key == "output" else int(key)
            for src in reads:
                tails = _site_sources(src, S, here)
                if tails is None:
                    continue
                for t in tails:
                    if isinstance(t, str) and t.startswith("b") and t not in g:
                        j = int(t[1:])
                        g.add_node(t, role="stream", label=f"block sum {t}")
                        for k in range((j - 1) * S, min(j * S, len(c.sublayers))):
                            g.add_edge(f"sub{k}", t)
                    if t in g:
                        g.add_edge(t, sid)
                        linked = True
            if not linked:
                g.add_edge(before, sid)
            return sid

        for sub in c.sublayers:
            sid = f"sub{sub.index}"
            kind = sub.kind if sub.kind in ("attention", "mlp") else "other"
            if sub.index in sites:
                entry = add_site(sub.index, sites[sub.index], prev)
            else:
                entry = prev
            g.add_node(sid, role=kind, label=f"{sub.index}: {sub.kind}\\n{sub.branch_module or sub.module}")
            g.add_edge(entry, sid)
            prev = sid
        entry = add_site("output", sites["output"], prev) if "output" in sites else prev
        g.add_node("final_norm", role="final_norm", label=f"final norm\\n{c.final_norm.module or c.final_norm.output}")
        g.add_edge(entry, "final_norm")
        return g

    def to_dot(self) -> str:
        """Graphviz DOT text of :meth:`to_networkx`."""
        g = self.to_networkx()
        fills = dict(source="#cfe2ff", stream="#e9ecef", final_norm="#ffe69c", site="#ffc078", attention="#d1e7dd",
                     mlp="#f8d7da", other="#e2d9f3")
        title = _esc(f"{self.model_class} -> {g.graph['scheme']}")
        lines = ['digraph "converted" {', "  rankdir=TB;", f'  labelloc=t; label="{title}"; fontname="Helvetica";',
                 '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];']
        for n, d in g.nodes(data=True):
            shape = "hexagon" if d["role"] == "site" else ("ellipse" if d["role"] == "stream" else "box")
            lines.append(f'  "{n}" [label="{_esc(d["label"])}", fillcolor="{fills.get(d["role"], "#ffffff")}", shape={shape}];')
        for a, b in g.edges():
            lines.append(f'  "{a}" -> "{b}";')
        lines.append("}")
        return "\n".join(lines) + "\n"

    def save(self, path: str | Path) -> Path:
        """Write the conversion diagram (:meth:`to_networkx`): ``.dot`` always; ``.svg`` / ``.png`` through Graphviz
        when installed, else matplotlib. :func:`depthrewrite.views.draw.save_rewritten` draws the rewritten graph itself."""
        g = self.to_networkx()
        return write_dot(
            self.to_dot(),
            Path(path),
            what="a conversion diagram",
            formats=".svg, .png or .dot",
            no_pydot=" (and Graphviz's `dot`), or matplotlib; report.save('conversion.dot') works without them.",
            no_graphviz="; report.save('conversion.dot') works without either.",
            graph=g,
            title=f"{self.model_class} -> {g.graph['scheme']}",
        )


def _site_sources(src: str, S: int, here: int) -> list[str] | None:
    """Graph nodes a site source name stands for, at the site before sublayer ``here``: ``emb`` -> source, ``out3`` ->
    sub3, ``b2`` -> the block-sum node, ``partial b2`` -> the block-sum node once the block is complete, else its
    sublayers so far; None: no node (mHC's streams x0..)."""
    name = src.strip()
    if name == "emb":
        return ["source"]
    if name.startswith("out") and name[3:].isdigit():
        return [f"sub{int(name[3:])}"]
    if name.startswith("partial b") and name[9:].isdigit():
        j = int(name[9:])
        if j * S <= here:
            return [f"b{j}"]
        return [f"sub{k}" for k in range((j - 1) * S, min(j * S, here))]
    if name.startswith("b") and name[1:].isdigit():
        return [name]
    return None
