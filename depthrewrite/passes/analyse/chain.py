"""Detect the PreNorm residual chain of a captured transformer, from dataflow alone.

The chain we look for::

    h_0 = stream source (embedding, after position add / scaling / dropout)
    h_{k+1} = h_k + f_k(Norm_k(h_k))          for every sublayer k       (sequential PreNorm)
    h_{k+1} = h_k + f_a(N_a(h_k)) + f_m(N_m(h_k))                         (parallel block: GPT-J, NeoX, Phi, Cohere)
    h_{k+1} = h_k + Post_k(f_k(Norm_k(h_k)))                              (sandwich norm: Gemma2/3)
    out = FinalNorm(h_L)

How it is found (no class or module names are consulted, except module *structure* to break one tie, below):

1. every normalisation is found by :func:`~depthrewrite.passes.analyse.norms.find_norms` (also inside a
   ``torch.autocast`` / ``no_grad`` region that export records as a wrapper op, read at the region's boundary);
2. the final norm is the last norm (graph order) whose input is an ``add`` that starts a residual step;
3. walking back from there, each ``add`` is expanded into its *add tree* (operand adds read only by this tree and
   written in the same module's forward: ``attn + mlp + h``) and its leaves are split into the *skip* leaf ``h`` (the
   one leaf that is an ancestor of all others) and the branch terms; the walk stops at a node that is no such add:
   the stream source;
   Reshapes that keep every element and the hidden size (``view``/``reshape``/``flatten``/``unflatten``: OPT runs its
   MLP on a [B·T, D] stream) are followed between the steps, and between the last add and the final norm also
   casts, slices/selects along token dims and a mean over tokens (timm's ``global_pool="avg"`` before ``fc_norm``);
   :attr:`Chain.paths` records them. Anything else there is refused, naming that node (a backout subtraction, a
   scaling of the stream), as is an earlier residual sum that reaches the chain's source by elementwise ops only
   (a stream rescaled between blocks, ``h = a·h + b·h0``);
4. each step is then checked forward: every path from ``h`` to a branch term must pass through a norm of ``h`` (a
   vertex cut, checked with networkx on the dataflow graph). A branch that reads ``h`` raw is accepted only when its
   own output is normalised (OLMo2's "reordered norm", reported as such), or when it is the first sublayer and the
   stream source is itself a norm's output (an embedding that ends in a norm, ModernBERT-decoder: that norm is the
   first branch's pre-norm in effect, reported as "source norm"); otherwise :class:`NotPreNormError`.

A branch is an *attention* branch if it holds an attention op (SDPA / flash) or a matmul of two activations
(the eager form); an *MLP* branch if it multiplies an activation by a parameter; *other* otherwise. Activations are
followed along floating-point edges only, so an expert weight selected by router indices (MoE) stays a parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ...errors import NoResidualChainError, NotPreNormError
from .graph import Dataflow, module_path_of
from .norms import NormSite, find_norms, refused_wrapped_norms
from .ops import is_float_tensor, is_param, op_of, shape_str, tensor_inputs, tensor_val, val, wrapper_body, wrapper_call

__all__ = ["Branch", "Sublayer", "Chain", "detect_chain"]


@dataclass(frozen=True)
class Branch:
    """One branch ``f(Norm(h))`` of a sublayer. Node fields hold FX node names."""

    kind: str  # "attention" | "mlp" | "other"
    output: str  # the addend of the residual add (after dropout / post-norm / scaling)
    pre_norm: NormSite | None  # None only for a reordered-norm branch (OLMo2)
    post_norm: NormSite | None  # sandwich (Gemma2/3) or reordered (OLMo2) norm on the branch output
    module: str | None  # the innermost module that holds the whole branch body
    nodes: tuple[str, ...]  # the branch body (pre-norm excluded, post-norm excluded)
    n_ops: int
    n_params: int


@dataclass(frozen=True)
class Sublayer:
    """One residual step ``h_out = h_in + sum(branch outputs)``."""

    index: int
    input: str  # the stream value read (h_k)
    residual_add: str  # the node that carries h_{k+1}
    adds: tuple[str, ...]  # every add of the step's add tree, the residual add last
    branches: tuple[Branch, ...]
    module: str | None  # the module whose forward holds the residual add (the decoder layer)
    reading: str  # "prenorm" | "parallel" | "sandwich" | "reordered norm"

    @property
    def kind(self) -> str:
        return "+".join(b.kind for b in self.branches)

    @property
    def pre_norms(self) -> tuple[NormSite, ...]:
        out: list[NormSite] = []
        for b in self.branches:
            if b.pre_norm is not None and b.pre_norm not in out:
                out.append(b.pre_norm)
        return tuple(out)

    @property
    def branch_module(self) -> str | None:
        mods = [b.module for b in self.branches]
        return mods[0] if len(mods) == 1 else _common_module(mods)


@dataclass(frozen=True)
class Chain:
    """The PreNorm residual chain of one graph (frozen; names refer to nodes of the analysed graph)."""

    source: str
    sublayers: tuple[Sublayer, ...]
    final_norm: NormSite
    hidden_size: int
    ir: str  # "export" | "dynamo"
    source_module: str | None = None
    notes: tuple[str, ...] = field(default=())
    #: whether the stream source is an input of the graph (inputs_embeds) rather than computed by it
    source_is_input: bool = False
    #: paths[j]: the nodes between stream value h_j and the value its readers read, in graph order (reshapes that keep
    #: every element, OPT; for j = L also token slicing and mean pooling before a pooled final norm, timm
    #: ``global_pool="avg"``). Empty (or ``()`` for every j) for a plain chain.
    paths: tuple[tuple[str, ...], ...] = field(default=())

    def __len__(self) -> int:
        return len(self.sublayers)

    @property
    def kinds(self) -> list[str]:
        return [s.kind for s in self.sublayers]

    @property
    def stream_nodes(self) -> list[str]:
        """h_0 ... h_L."""
        return [self.source] + [s.residual_add for s in self.sublayers]

    def path(self, j: int) -> tuple[str, ...]:
        """The nodes from h_j to the value its readers read (see :attr:`paths`)."""
        return self.paths[j] if j < len(self.paths) else ()


def detect_chain(gm: fx.GraphModule) -> Chain:
    """Find the PreNorm residual chain of ``gm`` (an export or Dynamo graph). Mutates nothing.

    Raises :class:`NotPreNormError` (naming the first residual add that is not PreNorm) or
    :class:`NoResidualChainError`.
    """
    df = Dataflow(gm)
    norms = find_norms(gm, df)
    by_input: dict[str, list[NormSite]] = {}
    for n in norms:
        by_input.setdefault(n.input, []).append(n)
    by_output = {n.output: n for n in norms}

    passed: list[NormSite] = []  # later norms whose input is no residual sum (possibly the real final norm)
    for final in reversed(norms):
        x = df.by_name[final.input]
        base, _ = _strip_path(df, x, _TAIL)
        if op_of(base, gm) != "add":
            passed.append(final)
            continue
        steps, source, paths = _walk_back(df, x)
        if steps:
            break
        passed.append(final)
    else:
        _diagnose(df, by_input, by_output, norms)
        raise AssertionError("unreachable")  # _diagnose always raises

    # A later norm that the stream still reaches past this one is the model's real final norm: something the walk
    # does not follow sits in front of it (a backout subtraction, a scaling); name that, not the chain's readers.
    last_add = steps[-1][1]
    around = nx.restricted_view(df.nx, [df.by_name[final.output]], [])
    for later in passed:
        if nx.has_path(around, last_add, df.by_name[later.input]):
            err = _end_blocker(df, later)
            if err is not None:
                raise err

    try:
        src_norm = _source_norm(df, source, by_output)
        sublayers = [
            _check_step(df, i, h, add, tree, terms, by_input, by_output, src_norm if i == 0 else None)
            for i, (h, add, tree, terms) in enumerate(steps)
        ]
        _check_readers(df, source, steps, paths, sublayers, final, norms)
    except NotPreNormError as e:
        # Report the first offending add in graph order, not the one the backward walk met first.
        first = _first_raw_add(df, by_input, by_output)
        if first is not None and first.node != e.node:
            raise first from None
        raise
    _check_start(df, source)

    h0 = tensor_val(source)
    ir = "export" if any("val" in n.meta for n in df.nodes) else "dynamo"
    notes = []
    if any(s.reading == "reordered norm" for s in sublayers):
        notes.append(
            "reordered norm (OLMo2): branches read the raw stream and normalise their output, h + Norm(f(h)); "
            "rewrites keep this reading and stay exact at init only with mix_scale='count'"
        )
    notes += _source_norm_notes(df, source, sublayers, src_norm)
    # paths[k]: the nodes from residual add k to what the next sublayer (or the final norm) reads
    reshaped = [k for k in range(len(steps) - 1) if paths[k]]
    if reshaped:
        shapes = sorted({shape_str(tensor_val(df.by_name[paths[k][-1]]).shape) for k in reshaped})
        notes.append(
            f"the stream is reshaped between sublayers (before {len(reshaped)} of {len(steps)} sublayers, e.g. "
            f"`{paths[reshaped[0]][-1]}`, to {', '.join(shapes)}): rewrites mix in the stream source's shape "
            f"{shape_str(tensor_val(source).shape)} and reshape back where the model reads the stream"
        )
    tail = [df.by_name[n] for n in paths[-1]] if paths else []
    pools = [n for n in tail if _path_kind(df, n) == "pool"]
    cut = [n for n in tail if _path_kind(df, n) == "slice"]
    if pools:
        notes.append(
            f"pooled output: the final norm reads a mean over tokens ({_where(pools[0])}"
            + (f", after slicing {', '.join(f'`{n.name}`' for n in cut)}" if cut else "")
            + ") of the last residual sum; the output mix is computed per token, before the pool"
        )
    elif any(_drops_rank(n) for n in cut):
        notes.append(
            f"token output: the final norm reads selected tokens ({', '.join(f'`{n.name}`' for n in cut)}) of the "
            "last residual sum; the output mix is computed per token, before the selection"
        )
    return Chain(
        source=source.name,
        sublayers=tuple(sublayers),
        final_norm=final,
        hidden_size=int(h0.shape[-1]) if h0 is not None else -1,
        ir=ir,
        source_module=module_path_of(source),
        notes=tuple(notes),
        source_is_input=source.op == "placeholder",
        paths=((),) + tuple(paths),
    )


# ---------------------------------------------------------------------------------------------------------------------
# backward walk


def _add_tree(df: Dataflow, root: fx.Node, stop: set[fx.Node] = frozenset()) -> tuple[list[fx.Node], list[fx.Node]]:
    """The adds of one residual step rooted at ``root`` and their leaves (canonical nodes, graph order); the adds in
    ``stop`` are leaves (a residual add nested inside a branch)."""
    tree = [root]
    leaves: list[fx.Node] = []
    root_mod = module_path_of(root)
    todo = [root]
    while todo:
        cur = todo.pop()
        for a in tensor_inputs(cur):
            a = df.canon(a)
            if (
                op_of(a, df.gm) == "add"
                and a not in stop
                and len(df.users(a)) == 1
                and _same_shape(a, root)
                and (root_mod is None or module_path_of(a) in (None, root_mod))
                and not any(df.canon(b) in df.static for b in tensor_inputs(a))
            ):
                tree.append(a)
                todo.append(a)
            elif a not in leaves:
                leaves.append(a)
    tree.sort(key=df.order.__getitem__)
    leaves.sort(key=df.order.__getitem__)
    return tree, leaves


def _same_shape(a: fx.Node, b: fx.Node) -> bool:
    va, vb = tensor_val(a), tensor_val(b)
    if va is None or vb is None or va.dim() == 0 or vb.dim() == 0:  # a scalar (a summed loss term) is no stream
        return False
    return len(va.shape) == len(vb.shape) and va.shape[-1] == vb.shape[-1]


def _skip_leaf(df: Dataflow, leaves: list[fx.Node]) -> fx.Node | None:
    """The leaf every other leaf is computed from (the residual stream h), if exactly one."""
    if len(leaves) < 2:
        return None
    g = df.nx
    cands = [p for p in leaves if all(q is p or nx.has_path(g, p, q) for q in leaves)]
    return cands[0] if len(cands) == 1 else None


def _walk_back(df: Dataflow, end: fx.Node):
    """Steps (h_k as read, residual add, add tree, branch terms), the stream source, and for each step the path of
    nodes from its residual add to the value the next step (or the final norm) reads."""
    steps, paths = [], []
    cur = df.canon(end)
    kinds = _TAIL
    while True:
        add, path = _strip_path(df, cur, kinds)
        if op_of(add, df.gm) != "add":
            break
        tree, leaves = _add_tree(df, add)
        skip = _skip_leaf(df, leaves)
        nested = _nested_adds(df, add, tree, skip)
        if nested:  # a branch's own skip connection (a + g(a)) is one branch term, not a second branch
            tree, leaves = _add_tree(df, add, stop=nested)
            skip = _skip_leaf(df, leaves)
        if skip is None or not all(_same_shape(skip, x) for x in tree):
            break
        steps.append((skip, add, tree, [x for x in leaves if x is not skip]))
        paths.append(tuple(n.name for n in path))
        cur = skip
        kinds = ("view",)  # between sublayers: reshapes only
    steps.reverse()
    paths.reverse()
    return steps, cur, paths


#: what may sit between the last residual add and the final norm
_TAIL = ("view", "cast", "slice", "pool")


def _numel_equal(a, b) -> bool:
    try:
        return bool(statically_known_true(a.numel() == b.numel()))
    except Exception:  # noqa: BLE001 - symbolic shapes that cannot be compared: not provably equal
        return False


def _sym_equal(a, b) -> bool:
    try:
        return bool(statically_known_true(a == b))
    except Exception:  # noqa: BLE001
        return False


def _arg(node: fx.Node, i: int, name: str, default=None):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _dims(node: fx.Node, rank: int, i: int = 1, name: str = "dim") -> list[int] | None:
    d = _arg(node, i, name)
    d = [d] if isinstance(d, int) else d
    if not isinstance(d, (list, tuple)) or not d or not all(isinstance(x, int) for x in d):
        return None
    return [x % rank for x in d]


def _path_kind(df: Dataflow, node: fx.Node) -> str | None:
    """What ``node`` does to the stream, if it keeps every token's hidden vector whole: ``"view"`` (a reshape that
    keeps the hidden size and every element), ``"cast"``, ``"slice"`` (slicing or selecting along token dims) or
    ``"pool"`` (a mean over token dims). None for anything else, a slice or mean over the batch dim included.

    Token dims are those between the batch dim (0) and the hidden dim (last), see :func:`_token_dims`; a slice that
    keeps the batch dim whole (export writes ``x[:, 1:]`` as a full slice of dim 0, then one of dim 1) is a slice."""
    op = op_of(node, df.gm)
    if op not in ("view", "cast", "slice", "select", "mean", "getitem"):
        return None
    ins = tensor_inputs(node)
    x, y = (tensor_val(ins[0]), tensor_val(node)) if len(ins) == 1 else (None, None)
    if x is None or y is None or not x.is_floating_point() or x.dim() < 2 or y.dim() < 1:
        return None
    if not _sym_equal(x.shape[-1], y.shape[-1]):
        return None
    if op == "cast":
        return "cast" if tuple(x.shape) == tuple(y.shape) else None
    if op == "view":
        return "view" if _numel_equal(x, y) else None
    tokens = _token_dims(x.dim())
    if op == "getitem":  # Dynamo: x[:, 1:], x[:, 0]
        index = node.args[1]
        ok = _keeps_last_dim(index, x.dim()) and _index_keeps_batch(index, x.dim())
        return "slice" if ok else None
    if op == "mean":
        dims = _dims(node, x.dim())
        return "pool" if dims is not None and all(d in tokens for d in dims) else None
    d = _slice_dim(node, x.dim())  # slice(x, dim=0, ...), select(x, dim, index)
    if d is None:
        return None
    if d in tokens or (op == "slice" and d == 0 and _full_slice(node, x.shape[0])):
        return "slice"
    return None


def _drops_rank(node: fx.Node) -> bool:
    """A slice-kind path node that selects (``select``, or Dynamo's ``x[:, 0]``) rather than slices."""
    x, y = tensor_val(tensor_inputs(node)[0]), tensor_val(node)
    return x is not None and y is not None and y.dim() < x.dim()


def _token_dims(rank: int) -> range:
    """The token dims of a stream value of this rank: those between the batch dim (0) and the hidden dim (last);
    none for a rank-2 stream ([B, D], or OPT's flattened [B·T, D])."""
    return range(1, rank - 1)


def _slice_dim(node: fx.Node, rank: int) -> int | None:
    d = _arg(node, 1, "dim", 0)
    return d % rank if isinstance(d, int) else None


def _full_slice(node: fx.Node, size) -> bool:
    """``slice(x, dim, start, end, step)`` keeps all ``size`` elements of its dim."""
    start, end, step = _arg(node, 2, "start"), _arg(node, 3, "end"), _arg(node, 4, "step", 1)
    if start not in (None, 0) or step not in (None, 1):
        return False
    # export writes an open end as sys.maxsize, which a symbolic size's unbounded range cannot be proven below
    return end is None or (isinstance(end, int) and (end >= 2**62 or _sym_ge(end, size)))


def _sym_ge(a, b) -> bool:
    try:
        return bool(statically_known_true(a >= b))
    except Exception:  # noqa: BLE001
        return False


def _keeps_last_dim(index, rank: int) -> bool:
    """A basic index (ints and slices, at most one Ellipsis) that leaves the last dim whole."""
    index = index if isinstance(index, tuple) else (index,)
    if not all(isinstance(i, (int, slice)) or i is Ellipsis for i in index) or sum(i is Ellipsis for i in index) > 1:
        return False
    if any(isinstance(i, slice) and any(isinstance(b, fx.Node) for b in (i.start, i.stop, i.step)) for i in index):
        return False
    whole = slice(None)
    if Ellipsis in index:
        return all(i == whole for i in index[index.index(Ellipsis) + 1:])
    return len(index) < rank or index[-1] == whole


def _index_dim0(index, rank: int):
    """The entry of a basic index that applies to dim 0 (``slice(None)`` when none does)."""
    index = index if isinstance(index, tuple) else (index,)
    if not index:
        return slice(None)
    if index[0] is not Ellipsis:
        return index[0]
    return index[1] if len(index) - 1 >= rank else slice(None)


def _index_keeps_batch(index, rank: int) -> bool:
    return _index_dim0(index, rank) == slice(None)


def _strip_path(df: Dataflow, node: fx.Node, kinds) -> tuple[fx.Node, list[fx.Node]]:
    """Walk back from ``node`` through nodes of the given path kinds; returns the first other node and the path
    (canonical nodes, graph order)."""
    path: list[fx.Node] = []
    cur = df.canon(node)
    while _path_kind(df, cur) in kinds:
        path.append(cur)
        cur = df.canon(tensor_inputs(cur)[0])
    path.reverse()
    return cur, path


def _nested_adds(df: Dataflow, root: fx.Node, tree: list[fx.Node], skip: fx.Node | None) -> set[fx.Node]:
    """The adds of ``tree`` (``root`` excluded) that are a branch's own residual connection: one operand is computed
    from the other, and that operand is not the stream ``skip`` but a value computed from it (``a + g(a)`` with
    ``a = f(Norm(h))``). Such an add belongs to the branch; expanding it would split one branch in two."""
    if skip is None:
        return set()
    out = set()
    for a in tree:
        ins = [df.canon(x) for x in tensor_inputs(a)]
        if a is root or len(ins) != 2 or skip in ins:
            continue
        p, q = ins
        if (nx.has_path(df.nx, p, q) and nx.has_path(df.nx, skip, p)) or (
            nx.has_path(df.nx, q, p) and nx.has_path(df.nx, skip, q)
        ):
            out.add(a)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# forward checks


def _check_step(df, index, h, add, tree, terms, by_input, by_output, source_norm=None) -> Sublayer:
    norms_h = by_input.get(h.name, [])
    branches = []
    for y in terms:
        branches.append(_check_branch(df, h, y, add, norms_h, by_output, source_norm))
    if len(branches) > 1:
        reading = "parallel"
    elif branches[0].pre_norm is None and branches[0].post_norm is None:
        reading = "source norm"
    elif branches[0].post_norm is not None and branches[0].pre_norm is not None:
        reading = "sandwich"
    elif branches[0].pre_norm is None:
        reading = "reordered norm"
    else:
        reading = "prenorm"
    return Sublayer(
        index=index,
        input=h.name,
        residual_add=add.name,
        adds=tuple(a.name for a in tree),
        branches=tuple(branches),
        module=module_path_of(add),
        reading=reading,
    )


def _check_branch(df: Dataflow, h: fx.Node, y: fx.Node, add: fx.Node, norms_h, by_output, source_norm=None) -> Branch:
    span = df.between(h, y)
    if not span:
        raise NotPreNormError(
            f"residual add {_where(add)} adds {_where(y)}, which is not computed from the stream {_where(h)}: "
            "this is not a residual branch. depthrewrite needs every term added to the stream to be a sublayer "
            "output computed from it.",
            node=add.name,
        )
    pre = _norms_on(df, norms_h, span)
    cut = {df.by_name[n.output] for n in pre}
    post = by_output.get(y.name)
    if post is not None and post.input == h.name:
        post = None
    raw = _raw_reader(df, h, y, span, cut)
    if raw is not None:
        if post is None and source_norm is None:
            raise NotPreNormError(_raw_message(df, add, h, raw), node=add.name)
        pre = []  # reordered norm (the branch reads h raw and normalises its output), or h is a norm's output
    entry_nodes = {df.by_name[n.output] for n in pre} or {h}
    post_nodes = {df.by_name[s] for s in post.nodes} if post is not None else set()
    body: set[fx.Node] = set()
    for e in entry_nodes:
        body |= df.between(e, y)
    body -= entry_nodes
    body -= post_nodes
    body.discard(df.by_name[post.output] if post is not None else None)
    ordered = sorted(body, key=df.order.__getitem__)
    return Branch(
        kind=_classify(df, entry_nodes, body),
        output=y.name,
        pre_norm=pre[0] if pre else None,
        post_norm=post,
        module=_branch_module(df, ordered),
        nodes=tuple(n.name for n in ordered),
        n_ops=sum(1 for n in ordered if n.op in ("call_function", "call_method", "call_module")),
        n_params=_count_params(df, ordered),
    )


def _norms_on(df: Dataflow, norms_h: list[NormSite], span: set[fx.Node]) -> list[NormSite]:
    """The norms of the stream value whose output lies on a path to the branch (``span``)."""
    names = {n.name for n in span}
    return [n for n in norms_h if n.output in names]


def _raw_reader(df: Dataflow, h: fx.Node, y: fx.Node, span: set, cut: set) -> fx.Node | None:
    """A reader of ``h`` from which ``y`` can be reached without passing through a norm of ``h``."""
    g = nx.restricted_view(df.nx, [c for c in cut if c is not y], [])
    for u in df.users(h):
        if u in span and u not in cut and (u is y or nx.has_path(g, u, y)):
            return u
    return None


def _classify(df: Dataflow, entries: set[fx.Node], body: set[fx.Node]) -> str:
    act: set[fx.Node] = set()
    for e in entries:
        act |= nx.descendants(df.nx_float, e) | {e}
    has_linear = False
    for n in sorted(body, key=df.order.__getitem__):
        op = op_of(n, df.gm)
        if op in ("sdpa", "flex_attention"):
            return "attention"
        if op in ("matmul", "linear"):
            ins = [df.canon(a) for a in tensor_inputs(n)]
            acts = [a for a in ins if a in act]
            if op == "matmul" and len(acts) >= 2:
                return "attention"
            if any(a in df.static for a in ins) or op == "linear":
                has_linear = True
    return "mlp" if has_linear else "other"


def _count_params(df: Dataflow, body: list[fx.Node]) -> int:
    seen: set[fx.Node] = set()
    todo = [a for n in body for a in n.all_input_nodes if a in df.static]
    while todo:
        a = todo.pop()
        if a in seen:
            continue
        seen.add(a)
        todo.extend(b for b in a.all_input_nodes if b in df.static)
    total = 0
    for a in seen:
        if a.op == "get_attr":
            try:
                total += df.gm.get_parameter(a.target).numel()
            except AttributeError:
                pass  # a buffer or constant
        elif is_param(a):
            total += val(a).numel()
    return total


def _check_readers(df: Dataflow, source, steps, paths, sublayers, final: NormSite, norms) -> None:
    """Every reader of a stream value must belong to the chain: a pre-norm, the step's add tree, a reordered branch,
    or the final norm, and each node of a path (reshapes, pooling) is read by the next one only. Anything else would
    see a different value once the chain is rewritten."""
    for k, (h, add, tree, terms) in enumerate(steps):
        allowed = {a.name for a in tree}
        for b in sublayers[k].branches:
            if b.pre_norm is not None:
                allowed |= set(b.pre_norm.readers)
            else:
                allowed |= set(b.nodes)
        _only_readers(df, h, allowed)
    for k, (_, add, _, _) in enumerate(steps):
        walk = [add] + [df.by_name[n] for n in paths[k]]
        for a, b in zip(walk, walk[1:]):
            _only_readers(df, a, {b.name})
    last = df.by_name[paths[-1][-1]] if paths[-1] else df.by_name[sublayers[-1].residual_add]
    _only_readers(df, last, set(final.readers))


def _only_readers(df: Dataflow, h: fx.Node, allowed: set[str]) -> None:
    for u in df.users(h):
        if u.name in allowed:
            continue
        if u.op == "output":
            # a returned hidden state (output_hidden_states=True): the rewrite leaves the output reading the residual
            # sum h_k = h_0 + sum of the sublayer outputs, which equals the original's at init (docs/limitations.md)
            continue
        raise NotPreNormError(
            f"the residual stream {_where(h)} is also read by {_where(u)}, which is neither a pre-norm, nor the "
            "residual add, nor the final norm. A rewritten chain would change what that node sees. If the model "
            "returns intermediate hidden states or reads the stream in another way, disable that (e.g. "
            "output_hidden_states=False) before converting.",
            node=u.name,
        )


def _source_norm(df: Dataflow, source: fx.Node, by_output: dict[str, NormSite]) -> NormSite | None:
    """The norm whose output the stream source is, through dropout and casts only, when that norm normalises an
    embedding (no residual add above it): the embedding's own norm (ModernBERT-decoder), which the first sublayer may
    read as its pre-norm. None otherwise (a PostNorm layer's output norm reads a residual sum: not accepted)."""
    cur = df.canon(source)
    while cur.name not in by_output:
        op = op_of(cur, df.gm)
        if op == "getitem" and isinstance(cur.args[0], fx.Node) and op_of(cur.args[0], df.gm) == "dropout":
            cur = cur.args[0]  # native_dropout -> (out, mask)
            op = "dropout"
        if op not in ("dropout", "cast") or not cur.args or not isinstance(cur.args[0], fx.Node):
            return None
        cur = df.canon(cur.args[0])
    norm = by_output[cur.name]
    x = df.by_name[norm.input]
    above = nx.ancestors(df.nx, x) | {x}
    if any(op_of(a, df.gm) == "add" and _is_residual_add(df, a) for a in above):
        return None
    return norm


def _source_norm_notes(df: Dataflow, source: fx.Node, sublayers, norm: NormSite | None) -> list[str]:
    if norm is None or not sublayers or sublayers[0].reading != "source norm":
        return []
    first = sublayers[0]
    where = f" ({first.branch_module})" if first.branch_module else ""
    return [
        f"source norm: sublayer 0{where} has no pre-norm of its own and reads the stream source `{source.name}` "
        f"directly; that source is already normalised (`{norm.output}`"
        + (f" in {norm.module}" if norm.module else "")
        + "), so it is PreNorm in effect. Every scheme gives sublayer 0 the stream source as it is (AttnRes/MSAR: a "
        "single source; mHC: its input mix, exact at init with alpha_init=0), so the rewrite stays exact at init"
    ]


# ---------------------------------------------------------------------------------------------------------------------
# diagnosis of graphs without a valid chain


def _residual_adds(df: Dataflow) -> list[tuple[fx.Node, fx.Node, fx.Node]]:
    """(add, skip operand, branch operand) for every add whose one operand is computed from the other."""
    out = []
    g = df.nx
    for n in df.nodes:
        if op_of(n, df.gm) != "add":
            continue
        ins = [df.canon(a) for a in tensor_inputs(n)]
        if len(ins) != 2 or not all(_same_shape(a, n) for a in ins):
            continue
        a, b = ins
        if tensor_val(a) is None or not tensor_val(a).is_floating_point():
            continue
        if nx.has_path(g, a, b):
            out.append((n, a, b))
        elif nx.has_path(g, b, a):
            out.append((n, b, a))
    return _stream_adds(df, out)


def _stream_adds(df: Dataflow, adds: list[tuple[fx.Node, fx.Node, fx.Node]]) -> list[tuple[fx.Node, fx.Node, fx.Node]]:
    """Drop the adds that cannot be steps of a residual stream: a skip operand broadcast to the sum's shape (an
    attention mask added to the scores), and an add nested inside another add's branch (its skip operand is computed
    from that add's stream inside the branch: a short convolution's own skip in ``k_proj``)."""
    g = df.nx
    def unbroadcast(h: fx.Node, n: fx.Node) -> bool:
        a, b = tensor_val(h).shape, tensor_val(n).shape
        return len(a) == len(b) and all(_sym_equal(x, y) for x, y in zip(a, b))

    full = [(n, h, y) for n, h, y in adds if unbroadcast(h, n)]
    out = []
    for n, h, y in full:
        nested = any(
            n is not n2 and h is not h2 and nx.has_path(g, h2, h) and nx.has_path(g, n, y2) for n2, h2, y2 in full
        )
        if not nested:
            out.append((n, h, y))
    return out


def _diagnose(df: Dataflow, by_input, by_output, norms) -> None:
    _diagnose_depth_mix(df, norms)
    adds = _residual_adds(df)
    if not adds:
        counts = f"({sum(1 for n in df.nodes if op_of(n, df.gm) == 'add')} adds inspected, {len(norms)} norms found)"
        hidden = _hidden_in_wrappers(df)
        if hidden:
            raise NoResidualChainError(
                f"no residual chain outside wrapper regions: the graph has no add whose one operand is computed from "
                f"the other {counts}, but {hidden}"
            )
        raise NoResidualChainError(
            f"no residual chain: the graph has no add whose one operand is computed from the other {counts}. "
            "depthrewrite rewrites transformers of the form h = h + f(norm(h)); this model has no skip connection."
        )
    first = _first_raw_add(df, by_input, by_output, adds)
    if first is not None:
        raise first
    ends = [n for n in norms if any(nx.has_path(df.nx, a, df.by_name[n.input]) for a, _, _ in adds[-1:])]
    if ends:
        err = _end_blocker(df, ends[-1], [a for a, _, _ in adds])
        if err is not None:
            raise err
    add = adds[0][0]
    raise NotPreNormError(
        f"residual adds were found (first: {_where(add)}), but no chain from an embedding through them to a final "
        "norm: the sum after the last residual add is not read by a norm. depthrewrite needs PreNorm blocks and a "
        "final norm before the output head.",
        node=add.name,
    )


def _hidden_in_wrappers(df: Dataflow) -> str:
    """Words on residual adds that run inside wrapper regions (a whole block under ``torch.autocast`` or
    ``torch.no_grad``), which the analysis reads only at their boundary; '' when there are none."""
    found = []
    for n in df.nodes:
        wrapped = wrapper_call(n)
        if wrapped is not None:
            inner = Dataflow(wrapped[0])
            k = len(_residual_adds(inner))
            if k:
                found.append((n, k, len(find_norms(wrapped[0], inner))))
    if not found:
        return ""
    n, _, _ = found[0]
    return (
        f"{sum(k for _, k, _ in found)} residual adds and {sum(m for _, _, m in found)} norms run inside "
        f"{len(found)} wrapper region(s) (first: {_where(n)}, a `{n.target.name()}` region, body "
        f"`{wrapper_body(n)}`): a torch.autocast / set_grad_enabled block around the residual add. depthrewrite "
        "reads such a region at its boundary only (a norm inside one counts when the region is passed the stream "
        "value and returns the norm's output), so it cannot rewrite a residual add inside one: put the block "
        "around the norm or the sublayer instead."
    )


def _diagnose_depth_mix(df: Dataflow, norms: list[NormSite]) -> None:
    """Raise when the last norm reads an attention over stacked hidden states instead of a residual sum: the model
    already mixes depth (Inkling2's block attention residuals), and has no residual chain to rewrite."""
    if not norms:
        return
    final = norms[-1]
    x = df.by_name[final.input]
    mix = _depth_attention(df, x)
    if mix is None:
        return
    weights, stack = mix
    raise NotPreNormError(
        f"no residual chain to rewrite: the final norm {_where(df.by_name[final.output])} reads {_where(x)}, which is "
        f"not a residual sum h + f(Norm(h)) but an attention over a stack of earlier hidden states ({_where(stack)}, "
        f"weighted by {_where(weights)}). This model already mixes depth with learned attention over layer outputs "
        "(attention residuals, as AttnRes does), so its layers do not add to one residual stream. depthrewrite "
        "converts models whose layers do, h = h + f(Norm(h)).",
        node=x.name,
    )


def _depth_attention(df: Dataflow, x: fx.Node, limit: int = 12) -> tuple[fx.Node, fx.Node] | None:
    """(softmax, cat) when ``x`` is read off ``softmax(..) @ V`` (or an SDPA) through shape ops only, and V comes from
    a concatenation of values of x's hidden size along a new axis: attention over depth, not over the sequence."""
    cur, width = x, tensor_val(x).shape[-1] if tensor_val(x) is not None else None
    for _ in range(limit):
        if op_of(cur, df.gm) in ("matmul", "sdpa"):
            break
        ins = tensor_inputs(cur)
        if len(ins) != 1:
            return None
        cur = df.canon(ins[0])
    else:
        return None
    up = nx.ancestors(df.nx, cur)
    near = [n for n in up if df.order[cur] - df.order[n] <= 60]  # the attention's own inputs, not the whole model
    weights = next((n for n in sorted(near, key=df.order.__getitem__, reverse=True) if op_of(n, df.gm) == "softmax"), None)
    if weights is None and op_of(cur, df.gm) == "sdpa":
        weights = cur
    stacks = [
        n for n in near
        if op_of(n, df.gm) == "cat"
        and sum(1 for a in tensor_inputs(n) if tensor_val(a) is not None and tensor_val(a).shape[-1] == width) >= 2
    ]
    if weights is None or not stacks:
        return None
    return weights, max(stacks, key=df.order.__getitem__)


def _is_residual_add(df: Dataflow, n: fx.Node) -> bool:
    """An add whose one operand is computed from the other (as :func:`_residual_adds` finds them)."""
    if op_of(n, df.gm) != "add":
        return False
    ins = [df.canon(a) for a in tensor_inputs(n)]
    if len(ins) != 2 or not all(_same_shape(a, n) for a in ins) or not is_float_tensor(ins[0]):
        return False
    return nx.has_path(df.nx, ins[0], ins[1]) or nx.has_path(df.nx, ins[1], ins[0])


def _param_name(df: Dataflow, n: fx.Node) -> str:
    """The parameter or buffer a static value is read from (``resid_lambdas`` for ``resid_lambdas[-1]``)."""
    seen = set()
    while n.op not in ("get_attr", "placeholder") and n not in seen:
        seen.add(n)
        ins = [a for a in n.all_input_nodes if a in df.static]
        if not ins:
            break
        n = ins[0]
    if n.op == "get_attr":
        return f"`{n.target}`"
    return f"`{n.name}`"


def _describe(df: Dataflow, n: fx.Node, on_path: set[fx.Node], adds: list[fx.Node], last: fx.Node) -> str:
    """What node ``n`` on the stream's path (which starts at ``last``) does, in words, naming its other operand."""
    op = op_of(n, df.gm)
    others = [df.canon(a) for a in tensor_inputs(n) if df.canon(a) not in on_path]
    dyn = [o for o in others if o not in df.static]
    stat = [o for o in others if o in df.static]
    up = nx.ancestors(df.nx, last) | {last}

    def earlier(o: fx.Node) -> fx.Node | None:
        """The latest stream-shaped value ``o`` is computed from that the stream at ``last`` is computed from too."""
        cands = [u for u in (nx.ancestors(df.nx, o) | {o}) & up
                 if _same_shape(u, last) and is_float_tensor(u) and u not in df.static]
        return max(cands, key=df.order.__getitem__) if cands else None

    def value(o: fx.Node) -> str:
        u = earlier(o)
        if u is None:
            return f"`{o.name}`"
        kind = "the residual sum" if u in adds else "the stream value"
        return f"`{o.name}`, {kind}" if u is o else f"`{o.name}`, computed from {kind} {_where(u)}"

    if op in ("sub", "add"):
        verb = "a subtraction" if op == "sub" else "an addition"
        if dyn:
            what = "an earlier stream value" if earlier(dyn[0]) is not None else "another activation"
            return f"{verb} of {what} ({value(dyn[0])})"
        return f"{verb} of a parameter or constant (a shift of the stream" + (f" by {_param_name(df, stat[0])})" if stat else ")")
    if op in ("mul", "div"):
        mask = _input_mask(df, n, on_path, last) if op == "mul" else None
        if mask is not None:
            use = "masked pooling" if _pooled_after(df, n, on_path) else "a padding mask"
            return f"a multiplication of the stream by a mask computed from the inputs (`{mask.name}`), e.g. {use}"
        if dyn:
            return f"a multiplication of the stream by another activation ({value(dyn[0])}, a gate)"
        return "a scaling of the stream" + (f" by {_param_name(df, stat[0])}" if stat else " by a constant")
    target = getattr(n.target, "__name__", str(n.target))
    x, y = tensor_val(n.args[0]) if n.args and isinstance(n.args[0], fx.Node) else None, tensor_val(n)
    reduction = target.split(".")[0] in ("amax", "max", "amin", "min", "logsumexp")
    batch = _batch_words(n, x, op) if op in ("mean", "slice", "select", "getitem") or reduction else None
    if op == "mean":
        if batch:
            return f"a mean over {batch}"
        return "a mean over the hidden dimension" if _path_kind(df, n) is None else "a mean over the token dimension (pooling)"
    if op in ("slice", "select", "getitem") and batch:
        return f"{'a slice' if op == 'slice' else 'an index'} of {batch}"
    if op in ("slice", "select"):
        return "a slice of the hidden dimension"
    if op == "view":
        return "a reshape that changes the hidden size"
    if reduction and x is not None and y is not None and y.dim() < x.dim():
        if batch:
            return f"a reduction over {batch} (`{target}`)"
        return f"a reduction over the token dimension (`{target}`, max pooling), which depthrewrite does not follow (mean pooling it does)"
    return f"an op depthrewrite does not follow on the stream (`{target}`)"


def _batch_words(n: fx.Node, x, op: str | None) -> str | None:
    """For a reduction, slice or index of the stream value ``x`` that reaches into its batch dim (dim 0), that dim in
    words (``"dim 0 (batch) of the [2, 6, 16] stream, which mixes the examples of a batch"``); None otherwise."""
    if x is None or x.dim() < 2:
        return None
    rank = x.dim()
    if op == "getitem":
        if not n.args[1:] or _index_keeps_batch(n.args[1], rank):
            return None
    elif op in ("slice", "select"):
        if _slice_dim(n, rank) != 0 or (op == "slice" and _full_slice(n, x.shape[0])):
            return None
    else:
        dims = _dims(n, rank)
        if dims is None or 0 not in dims or rank - 1 in dims:
            return None
    what = "batch" if rank > 2 else "batch; a rank-2 stream has no token dims"
    mixes = ", which mixes the examples of a batch" if op not in ("slice", "select", "getitem") else ""
    return f"dim 0 ({what}) of the {shape_str(x.shape)} stream{mixes}"


def _input_mask(df: Dataflow, n: fx.Node, on_path: set[fx.Node], last: fx.Node) -> fx.Node | None:
    """The other operand of ``n`` (a product with the stream) when it is computed from the model's inputs only (a
    padding or attention mask built from the token ids), not from the stream: it shares no stream-shaped value with
    the stream at ``last``, and every value it shares with the stream's history is a graph input, a parameter-only
    value or not floating-point (token ids, a boolean mask)."""
    others = [df.canon(a) for a in tensor_inputs(n) if df.canon(a) not in on_path]
    dyn = [o for o in others if o not in df.static]
    if len(dyn) != 1:
        return None
    o = dyn[0]
    up = nx.ancestors(df.nx, last) | {last}
    shared = (nx.ancestors(df.nx, o) | {o}) & up
    for u in shared:
        if _same_shape(u, last) and is_float_tensor(u) and u not in df.static:
            return None  # computed from a stream value (or a stream-shaped input: inputs_embeds)
        if is_float_tensor(u) and not (u.op == "placeholder" or u in df.static):
            return None  # computed from an activation
    return o


def _pooled_after(df: Dataflow, n: fx.Node, on_path: set[fx.Node]) -> bool:
    """A node after ``n`` on the stream's path (``on_path``: to the final norm) has a lower rank: the stream is
    reduced (a sum or mean over tokens) after ``n``."""
    v = tensor_val(n)
    if v is None:
        return False
    return any((w := tensor_val(d)) is not None and w.dim() < v.dim() for d in nx.descendants(df.nx, n) & on_path)


def _blocker(df: Dataflow, start: fx.Node, end: fx.Node) -> fx.Node | None:
    """The first node (graph order) on a path from ``start`` to ``end`` that is not a reshape, cast, token slice or
    token pool."""
    span = df.between(start, end) - {start}
    return next((n for n in sorted(span, key=df.order.__getitem__) if _path_kind(df, n) is None), None)


_EXPECT = (
    "depthrewrite expects the last residual sum to reach the final norm unchanged, or only reshaped, cast, sliced "
    "over tokens or mean-pooled over tokens"
)


def _end_blocker(df: Dataflow, final: NormSite, adds: list[fx.Node] | None = None) -> NotPreNormError | None:
    """The error naming what sits between the last residual add and ``final`` (None if nothing can be named)."""
    end = df.by_name[final.input]
    if adds is None:
        adds = [a for a, _, _ in _residual_adds(df)]
    before = [a for a in adds if a is not end and nx.has_path(df.nx, a, end)]
    if not before:
        return None
    last = max(before, key=df.order.__getitem__)
    n = _blocker(df, last, end)
    if n is None:
        return None
    span = df.between(last, end)
    what = _describe(df, n, span, adds, last)
    where = final.module or f"`{final.output}`"
    todo = "remove that op or move it after the final norm before converting."
    if op_of(n, df.gm) == "mul" and _input_mask(df, n, span, last) is not None and _pooled_after(df, n, span):
        todo = (
            "a plain mean over tokens (no mask) is followed: pool after the final norm instead (normalise every "
            "token, then take the masked mean), or pool without the mask, before converting."
        )
    return NotPreNormError(
        f"the final norm ({where}) does not read the residual stream: between the last residual add {_where(last)} "
        f"and it sits {_where(n)}, {what}. {_EXPECT}; {todo}",
        node=n.name,
    )


def _check_start(df: Dataflow, source: fx.Node) -> None:
    """Refuse a chain that starts after an earlier residual sum that reaches it by elementwise ops only: the stream
    is rescaled between blocks (``h = a·h + b·h0``) and the chain found would be only the blocks after that."""
    anc = nx.ancestors(df.nx, source)
    adds = [a for a in anc if _is_residual_add(df, a)]
    if not adds:
        return
    last = max(adds, key=df.order.__getitem__)
    span = df.between(last, source)
    shape = tuple(tensor_val(last).shape)
    if any(tensor_val(n) is None or tuple(tensor_val(n).shape) != shape for n in span):
        return  # the earlier sum goes through a projection or reshape: another model part (a vision tower)
    if any(op_of(n, df.gm) in ("linear", "matmul", "sdpa", "flex_attention", "layer_norm", "rms_norm") for n in span):
        return
    n = _blocker(df, last, source)
    if n is None:
        return
    what = _describe(df, n, span, adds, last)
    raise NotPreNormError(
        f"the residual chain is interrupted between sublayers: the residual sum {_where(last)} reaches the next "
        f"sublayer's stream {_where(source)} only through {_where(n)}, {what}. depthrewrite expects every sublayer "
        "to read the previous residual sum directly, h = h + f(Norm(h)); a stream rescaled between blocks "
        "(h = a·h + b·h0) is not a residual step it can rewrite.",
        node=n.name,
    )


def _first_raw_add(df: Dataflow, by_input, by_output, adds=None) -> NotPreNormError | None:
    """The error for the first residual add (graph order) whose branch reads the stream with no norm."""
    for add, h, y in adds if adds is not None else _residual_adds(df):
        span = df.between(h, y)
        cut = {df.by_name[n.output] for n in _norms_on(df, by_input.get(h.name, []), span)}
        raw = _raw_reader(df, h, y, span, cut)
        post = by_output.get(y.name)
        if raw is not None and (post is None or post.input == h.name):
            return NotPreNormError(_raw_message(df, add, h, raw), node=add.name)
    return None


def _raw_message(df: Dataflow, add: fx.Node, h: fx.Node, raw: fx.Node) -> str:
    msg = (
        f"residual add {_where(add)} is not PreNorm: its branch reads the stream {_where(h)} directly at "
        f"{_where(raw)}, with no norm in between"
    )
    msg += _wrapper_words(df, raw, h)
    readers = [u for u in df.users(add) if u.op != "output"]
    norms_of_sum = [u for u in readers if op_of(u, df.gm) in ("layer_norm", "rms_norm", "pow", "mul", "cast")]
    sub = _interpolation(df, add, h)
    if sub is not None:
        msg += (
            f", and the term it adds subtracts the stream again ({_where(sub)}): the step is an interpolation "
            "h + r·(f(h) − h) = (1 − r)·h + r·f(h) towards the branch output, not a residual add h + f(Norm(h))"
        )
        if readers and len(norms_of_sum) == len(readers):
            msg += (
                f"; the sum is renormalised right after ({_where(readers[0])}), so every step reads a normalised "
                "stream: the nGPT (normalised Transformer) layout h = Norm(h + r·(f(h) − h)), PostNorm in effect"
            )
    elif readers and len(norms_of_sum) == len(readers):
        msg += (
            f", and the sum is normalised right after ({_where(readers[0])}): this is the PostNorm layout "
            "h = Norm(h + f(h)) (BERT, the original Transformer)"
        )
    return msg + (
        ". depthrewrite rewrites PreNorm chains h = h + f(Norm(h)) only, where every branch reads the stream "
        "through its own norm; convert a PreNorm model instead."
    )


def _wrapper_words(df: Dataflow, raw: fx.Node, h: fx.Node) -> str:
    """When ``raw`` is a wrapper region (``wrap_with_autocast``: a ``torch.autocast`` or ``set_grad_enabled`` block)
    holding a norm of ``h`` that is not read as a pre-norm: why not, in words ('' otherwise)."""
    if wrapper_call(raw) is None:
        return ""
    whys = [why for call, x, why in refused_wrapped_norms(df.gm, df) if call is raw and (x is None or df.canon(x) is df.canon(h))]
    what = f"that is a `{raw.target.name()}` region, body `{wrapper_body(raw)}`,"
    if not whys:
        return f" ({what} which holds no norm of the stream)"
    return (
        f" ({what} which holds a norm, but {whys[0]}; a norm inside such a region is read as a pre-norm only when "
        "the region is passed the stream value, returns the norm's output and reads the stream value for nothing "
        "else)"
    )


def _interpolation(df: Dataflow, add: fx.Node, h: fx.Node) -> fx.Node | None:
    """A ``sub(x, h)`` whose result the residual add adds: the step interpolates h + r·(x − h) (nGPT)."""
    for u in df.users(h):
        if op_of(u, df.gm) == "sub" and len(u.args) > 1 and isinstance(u.args[1], fx.Node):
            if df.canon(u.args[1]) is df.canon(h) and nx.has_path(df.nx, u, add):
                return u
    return None


def _where(node: fx.Node) -> str:
    mod = module_path_of(node)
    return f"`{node.name}`" + (f" (in {mod})" if mod else "")


def _branch_module(df: Dataflow, body: list[fx.Node]) -> str | None:
    """The module that holds a branch: the common module of its compute ops (projections, matmuls, attention),
    so that a residual scaling or dropout written in the decoder layer does not hide ``self_attn`` / ``mlp``."""
    core = [module_path_of(n) for n in body if op_of(n, df.gm) in ("linear", "matmul", "sdpa", "flex_attention")]
    core = [p for p in core if p is not None]
    if len(core) == 1:
        return core[0].rpartition(".")[0] or core[0]
    return _common_module(core) if core else _common_module([module_path_of(n) for n in body])


def _common_module(paths) -> str | None:
    paths = [p.split(".") for p in paths if p is not None]
    if not paths:
        return None
    common = paths[0]
    for p in paths[1:]:
        i = 0
        while i < min(len(common), len(p)) and common[i] == p[i]:
            i += 1
        common = common[:i]
    return ".".join(common) if common else ""
