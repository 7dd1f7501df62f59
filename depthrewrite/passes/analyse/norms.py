"""Find every normalisation in a graph, whatever its spelling.

Recognised (on export and Dynamo graphs alike):

* ``nn.LayerNorm`` / ``F.layer_norm`` / ``aten.layer_norm`` / ``aten.native_layer_norm``;
* ``nn.RMSNorm`` / ``F.rms_norm`` / ``aten.rms_norm``;
* RMSNorm written out, as Hugging Face, T5 and Gemma write it::

      x * rsqrt(mean(x ** 2, -1, keepdim=True) + eps) [* weight | * (1 + weight)]   # also x*x, square(x), x / sqrt(..)

  with any casts around it (``x.float()`` ... ``.to(input_dtype)``), the gain cast or not (``self.weight.type_as(x) * x``,
  OLMo-core);
* any of these inside a wrapper region (``torch.autocast(enabled=False)`` around OLMo-core's RMSNorm: export's
  ``wrap_with_autocast`` op), when the norm normalises one of the region's operands and the region returns it: the
  site is the region's call (its reader) and the ``getitem`` that carries the norm's output, both in the outer graph.

A :class:`NormSite` records the tensor normalised (``input``, alias-stripped), the node that carries the finished
value (``output``: after the gain and the cast back), every node in between, and the nodes that read the input
(``readers``: the places a rewrite must redirect).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.fx as fx

from .graph import Dataflow, module_path_of
from .ops import op_of, strip_alias, strip_casts, tensor_inputs, tensor_val, wrapper_body, wrapper_call, wrapper_output_node, wrapper_outputs

__all__ = ["NormSite", "find_norms", "refused_wrapped_norms"]


@dataclass(frozen=True)
class NormSite:
    """One normalisation in the graph. Node fields hold FX node names."""

    kind: str
    input: str
    output: str
    nodes: tuple[str, ...]
    readers: tuple[str, ...]
    eps: float | None
    module: str | None
    weight: str | None = None

    @property
    def label(self) -> str:
        eps = "" if self.eps is None else f", eps={self.eps:g}"
        return f"{self.kind}{eps}"

    @property
    def short(self) -> str:
        """Compact name for tables: ``RMSNorm``, ``LayerNorm``, ``RMSNorm(1+w)``."""
        base = "LayerNorm" if self.kind.startswith("layer_norm") else "RMSNorm"
        return base + ("(1+w)" if "1 + weight" in self.kind else "")


def _const(a) -> float | None:
    return float(a) if isinstance(a, (int, float)) and not isinstance(a, bool) else None


def _same_value(a: fx.Node, b: fx.Node) -> bool:
    """The same node, or the same op applied to the same arguments (a value computed twice)."""
    return a is b or (a.op == b.op and a.target == b.target and a.args == b.args and a.kwargs == b.kwargs)


def _reduces_last_dim(node: fx.Node) -> bool:
    """``mean(x, dim=-1, keepdim=True)`` (the last dim, spelled -1 or by index)."""
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if isinstance(dims, (list, tuple)):
        if len(dims) != 1:
            return False
        dims = dims[0]
    if not keep or not isinstance(dims, int):
        return False
    if dims == -1:
        return True
    v = tensor_val(node.args[0]) if isinstance(node.args[0], fx.Node) else None
    return v is not None and dims == v.dim() - 1


def _square_of(node: fx.Node) -> fx.Node | None:
    """``x ** 2``, ``x * x`` or ``square(x)`` -> x; else None."""
    op = op_of(node)
    if op == "pow" and len(node.args) > 1 and node.args[1] == 2 and isinstance(node.args[0], fx.Node):
        return node.args[0]
    if op == "mul" and len(node.args) > 1 and node.args[0] is node.args[1] and isinstance(node.args[0], fx.Node):
        return node.args[0]
    if op == "square" and isinstance(node.args[0], fx.Node):
        return node.args[0]
    return None


def _written_rms(df: Dataflow, inv: fx.Node) -> tuple[fx.Node, fx.Node, float | None, list[fx.Node], bool] | None:
    """Match ``rsqrt(mean(x^2) + eps)`` (or the ``sqrt`` that a division uses) at ``inv``, and its application
    ``x * rsqrt(..)``. When ``x = h - mean(h)`` this is a LayerNorm written out (Cohere).

    Returns (input, the op that applies the statistic, eps, the nodes of the norm so far, centered)."""
    arg = inv.args[0] if inv.args else None
    if not isinstance(arg, fx.Node):
        return None
    eps: float | None = None
    mean = arg
    stat_nodes = [inv]
    if op_of(arg) == "add":
        a, b = arg.args[0], arg.args[1]
        if isinstance(a, fx.Node) and _const(b) is not None:
            mean, eps = a, _const(b)
        elif isinstance(b, fx.Node) and _const(a) is not None:
            mean, eps = b, _const(a)
        else:
            return None
        stat_nodes.append(arg)
    if op_of(mean) != "mean" or not _reduces_last_dim(mean):
        return None
    sq = mean.args[0]
    x1 = _square_of(sq) if isinstance(sq, fx.Node) else None
    if x1 is None:
        return None
    stat_nodes += [mean, sq]
    x = strip_casts(x1)
    want = "mul" if op_of(inv) == "rsqrt" else "div"
    for u in inv.users:
        if op_of(u) != want or len(u.args) != 2:
            continue
        other = u.args[1] if u.args[0] is inv else u.args[0]
        if want == "div" and u.args[1] is not inv:
            continue
        if not isinstance(other, fx.Node) or not _same_value(strip_casts(other), x):
            continue
        for start in (x1, other):  # the casts between x and the statistic belong to the norm
            cur = start
            while not _same_value(cur, x):
                stat_nodes.append(cur)
                cur = cur.args[0]
            if cur is not x:
                stat_nodes.append(cur)  # x computed twice (Cohere writes h - mean twice)
        src, centered = x, False
        if op_of(x) == "sub" and isinstance(x.args[0], fx.Node) and isinstance(x.args[1], fx.Node):
            mu = x.args[1]
            if op_of(mu) == "mean" and _reduces_last_dim(mu) and strip_casts(mu.args[0]) is strip_casts(x.args[0]):
                src, centered = strip_casts(x.args[0]), True
                stat_nodes += [x, mu]
                for start in (x.args[0], mu.args[0]):
                    cur = start
                    while cur is not src:
                        stat_nodes.append(cur)
                        cur = cur.args[0]
        return src, u, eps, stat_nodes, centered
    return None


def _extend(df: Dataflow, node: fx.Node, allow_affine: bool) -> tuple[fx.Node, list[fx.Node], str | None, bool]:
    """Follow the gain and casts after a normalisation: single-reader casts, ``* weight``, ``* (1 + weight)``,
    ``+ bias`` where the other operand is static (parameters only). Returns (output, nodes, weight, offset)."""
    nodes: list[fx.Node] = []
    weight: str | None = None
    offset = False
    cur = node
    while True:
        users = df.users(cur)
        if len(users) != 1:
            break
        u = users[0]
        op = op_of(u, df.gm)
        if op == "cast":
            nodes.append(u)
            cur = u
            continue
        if allow_affine and op in ("mul", "add"):
            others = [a for a in tensor_inputs(u) if strip_alias(a) is not strip_alias(cur)]
            if len(others) == 1 and others[0] in df.static:
                w = others[0]
                if op == "mul" and weight is None:
                    base = strip_casts(w)
                    if op_of(base) == "add" and any(_const(a) == 1.0 for a in base.args):
                        offset = True
                        base = next(a for a in base.args if isinstance(a, fx.Node))
                    weight = _param_name(strip_casts(base))
                nodes.append(u)
                cur = u
                continue
        break
    return strip_alias(cur), nodes, weight, offset


def find_norms(gm: fx.GraphModule, df: Dataflow | None = None) -> list[NormSite]:
    """Every normalisation of ``gm``, in graph order of its output."""
    df = df or Dataflow(gm)
    found: list[NormSite] = []
    for n in df.nodes:
        op = op_of(n, gm)
        if op in ("layer_norm", "rms_norm"):
            if not n.args or not isinstance(n.args[0], fx.Node):
                continue
            x = strip_casts(n.args[0])
            pre: list[fx.Node] = []
            cur = n.args[0]
            while cur is not x:
                pre.append(cur)
                cur = cur.args[0]
            body = n
            extra: list[fx.Node] = []
            if n.op == "call_function" and getattr(n.target, "overloadpacket", None) is not None and isinstance(
                n.meta.get("val"), (tuple, list)
            ):  # native_layer_norm -> (out, mean, rstd)
                gets = [u for u in n.users if op_of(u) == "getitem" and u.args[1] == 0]
                if len(gets) != 1:
                    continue
                body = gets[0]
                extra.append(body)
            out, post, _, _ = _extend(df, body, allow_affine=False)
            if n.op == "call_module":
                mod = gm.get_submodule(n.target)
                eps = getattr(mod, "eps", None)
                weight = f"{n.target}.weight" if getattr(mod, "weight", None) is not None else None
            else:
                eps_pos = 4 if op == "layer_norm" else 3
                eps = n.args[eps_pos] if len(n.args) > eps_pos else n.kwargs.get("eps")
                if eps is None and op == "layer_norm":
                    eps = 1e-5
                w_pos = 2
                w = n.args[w_pos] if len(n.args) > w_pos else n.kwargs.get("weight")
                weight = _param_name(strip_casts(w)) if isinstance(w, fx.Node) else None
            nodes = pre + [n] + extra + post
            found.append(_site(df, op, x, out, nodes, _const(eps), weight))
        elif op in ("rsqrt", "sqrt"):
            m = _written_rms(df, n)
            if m is None:
                continue
            x, applied, eps, stat, centered = m
            out, post, weight, offset = _extend(df, applied, allow_affine=True)
            kind = ("layer_norm" if centered else "rms_norm") + " (written out" + (", 1 + weight)" if offset else ")")
            found.append(_site(df, kind, x, out, stat + [applied] + post, eps, weight))
        elif wrapper_call(n) is not None:
            found.extend(_wrapped_norms(df, n))
    found.sort(key=lambda s: df.order[df.by_name[s.output]])
    return found


def _wrapped_norms(df: Dataflow, call: fx.Node, refused: list[tuple[fx.Node | None, str]] | None = None) -> list[NormSite]:
    """The norms inside the wrapper region called by ``call``, as sites of the outer graph: a norm whose input is an
    operand of the region and whose output the region returns. Its nodes are the region's call (the reader of the
    input a rewrite redirects) and the ``getitem`` that carries the output, then any casts or gain applied outside.

    The region must read that operand for the norm only (or return it unchanged, as OLMo-core's RMSNorm returns its
    input's no-op ``x.float()``): a region that also computes something else from it would see a rewrite's new value
    there too, so its norm is not offered as a site. Each norm of the region not offered is appended to ``refused``
    as (the outer operand it normalises, or None; why, in words)."""
    sub, operands = wrapper_call(call)
    holders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    static = {p for p, a in zip(holders, operands) if isinstance(a, fx.Node) and df.canon(a) in df.static}
    inner = Dataflow(sub, static_inputs=static)
    rets = [strip_alias(r) if isinstance(r, fx.Node) else None for r in wrapper_outputs(sub)]
    sites = []
    refused = refused if refused is not None else []
    for norm in find_norms(sub, inner):
        x_in, out_in = inner.by_name[norm.input], inner.by_name[norm.output]
        if x_in not in holders:
            refused.append((None, f"its input `{norm.input}` is computed inside the region, not passed to it"))
            continue
        k = holders.index(x_in)
        x = operands[k] if isinstance(operands[k], fx.Node) else None
        out = wrapper_output_node(call, rets.index(out_in)) if out_in in rets else None
        if x is None or out is None:
            refused.append((x, "the region does not return its output" if out is None else "its input is no tensor"))
            continue
        own = set(norm.nodes)
        other = [u.name for u in inner.users(x_in) if u.op != "output" and u.name not in own]
        if other:
            refused.append((x, "the region also computes something else from the norm's input ("
                            + ", ".join(f"`{o}`" for o in other[:3]) + f" in `{wrapper_body(call)}`)"))
            continue
        written = "written out" in norm.kind
        final, post, weight, offset = _extend(df, out, allow_affine=written and norm.weight is None)
        kind = norm.kind
        if offset and kind.endswith("(written out)"):
            kind = kind[: -len(")")] + ", 1 + weight)"
        if weight is None and norm.weight is not None:
            w_in = inner.by_name.get(norm.weight)
            if w_in in holders and isinstance(operands[holders.index(w_in)], fx.Node):
                weight = _param_name(strip_casts(operands[holders.index(w_in)]))
            else:
                weight = norm.weight if w_in is None or w_in.op == "get_attr" else None
        site = _site(df, kind, x, final, [call] + ([out] if out is not call else []) + post, norm.eps, weight)
        if norm.module and site.module != norm.module:
            site = replace(site, module=norm.module)
        sites.append(site)
    return sites


def refused_wrapped_norms(gm: fx.GraphModule, df: Dataflow | None = None) -> list[tuple[fx.Node, fx.Node | None, str]]:
    """The norms inside wrapper regions of ``gm`` that :func:`find_norms` does not offer as sites: (the region's call,
    the operand the norm normalises or None, why in words). For error messages."""
    df = df or Dataflow(gm)
    out = []
    for n in df.nodes:
        if wrapper_call(n) is not None:
            refused: list = []
            _wrapped_norms(df, n, refused)
            out += [(n, x, why) for x, why in refused]
    return out


def _param_name(node: fx.Node) -> str:
    return str(node.target) if node.op == "get_attr" else node.name


def _site(df: Dataflow, kind: str, x: fx.Node, out: fx.Node, nodes: list[fx.Node], eps, weight) -> NormSite:
    x = strip_alias(x)
    names = {m.name for m in nodes}
    readers = tuple(u.name for u in df.users(x) if u.name in names)
    module = None
    for m in nodes:
        module = module_path_of(m) or module
        if module:
            break
    ordered = tuple(sorted(names, key=lambda s: df.order[df.by_name[s]]))
    return NormSite(kind=kind, input=x.name, output=out.name, nodes=ordered, readers=readers, eps=eps, module=module, weight=weight)
