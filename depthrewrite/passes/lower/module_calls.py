"""Modules stay modules (issue #24, docs/design/module-calls.md, steps 1 and 2): put back a ``call_module`` of the
live ``nn.Linear`` / ``nn.Embedding`` in place of each region of the rewritten flat graph that the rewrite left
intact. Opt-in: ``depthrewrite.convert(..., module_calls=True)``; nothing here runs otherwise.

* At capture (:func:`export_with_signatures`, :func:`stamp`): ``torch.export`` records each candidate module's call
  signature (``preserve_module_call_signature``); every captured node is stamped with its capture name and what its
  arguments were (internal edges by name, ``get_attr`` targets, constants), and each module call's *region* (the
  nodes with that ``nn_module_stack`` key, without ``_assert_tensor_metadata`` and no-op casts) is recorded.
* After the rewrite (:func:`lower_module_calls`), on a copy of the flat graph: a region becomes
  ``call_module(path, *inputs)`` when its ops are exactly the captured ones, each reads what it read at capture,
  the edges from outside bind consistently to the signature's inputs, every value read outside is a signature
  output, and the call's inputs come before the region. Nodes a rewrite made (they carry a ``NodeRole``) or copied
  (their stamp is on two nodes) are never taken for the module's own. The call gets its parent's module stack, so
  the block split places it like the ops it replaces; its output keeps the replaced node's name.

The flat graph itself is left as it was (the report, export of a converted model and pipeline stages read it); the
lowered copy is what the block runner and the block programs run (``gm.meta[LOWERED_META]``).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import re
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from ..analyse.ops import alias_of
from ..meta import role_of

__all__ = ["CALL_META", "LOWERED_META", "SIGNATURES_META", "STAMP_META", "ModuleCallInfo", "candidate_paths",
           "export_with_signatures", "lower_module_calls", "stamp"]

log = logging.getLogger(__name__)

#: node.meta key: ``(capture name, argument fingerprint)`` of a node as captured
STAMP_META = "depthrewrite_capture"
#: gm.meta key: the :class:`ModuleCallInfo` of a capture with ``module_calls=True``
SIGNATURES_META = "depthrewrite_module_signatures"
#: gm.meta key: ``(graph, called, refused)``, the lowered copy of the flat graph the block runner splits
LOWERED_META = "depthrewrite_module_call_graph"
#: node.meta key of a call_module this pass made: the module's path
CALL_META = "depthrewrite_module_call"

_ASSERT = "aten._assert_tensor_metadata.default"
#: the module classes called in steps 1-2 of the plan
_CLASSES = (nn.Linear, nn.Embedding)


@dataclasses.dataclass
class ModuleCallInfo:
    """What a capture recorded for the lowering: signatures by module path, regions (capture names of the region's
    ops) by ``nn_module_stack`` key, the canonical node (through no-op casts) of each capture name, and the paths
    export refused (with why)."""

    signatures: dict[str, Any]
    regions: dict[str, frozenset[str]]
    canon: dict[str, str]
    dropped: tuple[tuple[str, str], ...] = ()


def candidate_paths(model: nn.Module) -> list[str]:
    """The paths whose call signature is recorded: every ``nn.Linear`` / ``nn.Embedding`` (chosen by what sits at
    the path at capture), except depthrewrite's own new modules."""
    from ..rewrite.editor import PARAM_PREFIX

    return [n for n, m in model.named_modules()
            if n and isinstance(m, _CLASSES) and n != PARAM_PREFIX and not n.startswith(PARAM_PREFIX + ".")]


def export_with_signatures(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any):
    """``torch.export.export`` (non-strict) preserving the call signatures of :func:`candidate_paths`. A path export
    refuses (named in its error) is dropped and the export retried; when the error names none, it is retried with
    no signatures at all (the lowering then calls nothing). The refused paths go to ``ep.meta``-less storage on the
    returned program as ``_dr_dropped``."""
    paths = candidate_paths(model)
    dropped: list[tuple[str, str]] = []
    for _ in range(8):
        try:
            ep = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False,
                                     preserve_module_call_signature=tuple(paths))
        except Exception as e:  # noqa: BLE001 - a refusal of one path; the plain export below reports the rest
            if not paths:
                raise
            text = str(e)
            named = _refused_path(e, paths) or [p for p in paths if re.search(rf"(?<![\w.]){re.escape(p)}(?![\w])", text)]
            why = f"{type(e).__name__}: {text.strip().splitlines()[0] if text.strip() else ''}"[:200]
            if named:
                worst = max(named, key=len)
                dropped.append((worst, why))
                paths.remove(worst)
            else:
                dropped += [(p, "export refused the signatures: " + why) for p in paths]
                paths = []
            log.info("module calls: export refused %s; retrying without", dropped[-1][0] if named else "signatures")
            continue
        ep.__dict__["_dr_dropped"] = tuple(dropped)
        return ep
    ep = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
    ep.__dict__["_dr_dropped"] = tuple(dropped) + tuple((p, "too many refusals") for p in paths)
    return ep


def _refused_path(e: BaseException, paths: list[str]) -> list[str]:
    """The preserved path whose call export's signature hooks (``torch/_export/wrappers.py``) refused in ``e``'s
    tracebacks (a SymInt or another non-tensor leaf among its inputs or outputs)."""
    seen: set[int] = set()
    found: list[str] = []
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            if frame.f_code.co_filename.replace("\\", "/").endswith("_export/wrappers.py"):
                p = frame.f_locals.get("path")
                if isinstance(p, str) and p.startswith("_export_root."):  # export wraps the model under this name
                    p = p[len("_export_root."):]
                if isinstance(p, str) and p in paths and p not in found:
                    found.append(p)
            tb = tb.tb_next
        e = e.__cause__ or e.__context__
    return found


def _canon(n: fx.Node) -> fx.Node:
    for _ in range(32):
        a = alias_of(n)
        if a is None:
            return n
        n = a
    return n


def _is_aux(n: fx.Node) -> bool:
    return str(n.target) == _ASSERT or alias_of(n) is not None


def _fingerprint(n: fx.Node) -> Any:
    def f(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return ("attr", a.target) if a.op == "get_attr" else ("node", _canon(a).name)
        return ("const", repr(a))

    return pytree.tree_map(f, (n.args, n.kwargs), is_leaf=lambda a: isinstance(a, fx.Node))


def _leaves(fp: Any) -> list:
    return pytree.tree_leaves(fp, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str))


def stamp(gm: fx.GraphModule, ep: Any) -> None:
    """Stamp every node of the unlifted ``gm`` with its capture name and argument fingerprint and keep the
    signatures export recorded in ``gm.meta[SIGNATURES_META]``."""
    sigs = {e.fqn: e.signature for e in ep.module_call_graph if e.fqn and e.signature is not None}
    regions: dict[str, set[str]] = {}
    for n in gm.graph.nodes:
        n.meta[STAMP_META] = (n.name, _fingerprint(n))
        if n.op in ("call_function", "call_method") and not _is_aux(n):
            for key, v in (n.meta.get("nn_module_stack") or {}).items():
                if isinstance(v, tuple) and v and v[0] in sigs:
                    regions.setdefault(key, set()).add(n.name)
    gm.meta[SIGNATURES_META] = ModuleCallInfo(
        signatures=sigs, regions={k: frozenset(v) for k, v in regions.items()},
        canon={n.name: _canon(n).name for n in gm.graph.nodes}, dropped=ep.__dict__.get("_dr_dropped", ()))


def _name(n: Any) -> str | None:
    s = n.meta.get(STAMP_META) if isinstance(n, fx.Node) else None
    return s[0] if s else None


def _block_of(path: str, blocks: tuple[str, ...]) -> str | None:
    return next((b for b in blocks if path.startswith(b + ".")), None)


def _check(key: str, path: str, R: list[fx.Node], info: ModuleCallInfo, sig: Any, pos: dict,
           stack_paths: set[str], blocks: tuple[str, ...]) -> tuple | str:
    """``(inputs by signature name, outputs [(signature name, node)])`` for region ``R``, or why it stays inlined."""
    from torch.export.exported_program import ConstantArgument, TensorArgument

    canon = info.canon
    region = info.regions.get(key, frozenset())
    names = {_name(n) for n in R if not _is_aux(n)}
    if names != region:
        return f"region changed ({len(names & region)} of {len(region)} ops left, {len(names - region)} other)"
    if {b for b in blocks if b in stack_paths} != ({_block_of(path, blocks)} - {None}):
        return "called from another block than the one holding it"
    Rs = set(R)
    sig_in = {canon.get(a.name, a.name): a.name for a in sig.inputs if isinstance(a, TensorArgument)}
    internal = {canon.get(x, x) for x in region}
    bind: dict[str, fx.Node] = {}
    for n in R:
        if str(n.target) == _ASSERT:
            continue
        was = _leaves(n.meta[STAMP_META][1])
        now = pytree.tree_leaves((n.args, n.kwargs), is_leaf=lambda a: isinstance(a, fx.Node))
        if len(was) != len(now):
            return f"the arguments of {n.name} changed"
        for (kind, v), a in zip(was, now):
            if kind == "const":
                if isinstance(a, fx.Node) or repr(a) != v:
                    return f"a constant of {n.name} changed"
            elif kind == "attr":
                if not (isinstance(a, fx.Node) and a.op == "get_attr" and a.target == v):
                    return f"{n.name} reads another attribute"
            elif v in internal:
                c = _canon(a) if isinstance(a, fx.Node) else None
                if c is None or c not in Rs or canon.get(_name(c), _name(c)) != v:
                    return f"an internal input of {n.name} changed"
            elif isinstance(a, fx.Node) and isinstance(a.meta.get("val"), (torch.SymInt, int)):
                continue  # a size: the live module recomputes it from its tensor inputs
            elif v in sig_in:
                cur = _canon(a) if isinstance(a, fx.Node) else None
                if cur is None or bind.setdefault(sig_in[v], cur) is not cur:
                    return f"call input {v} is bound inconsistently"
            else:
                return f"{n.name} reads {v}, which is not an input of the module call"
    inputs: dict[str, Any] = {}
    for a in sig.inputs:
        if isinstance(a, TensorArgument):
            if a.name not in bind:
                return f"call input {a.name} is read by no op of the region"
            inputs[a.name] = bind[a.name]
        elif not isinstance(a, ConstantArgument):
            return f"call input {a} is not a tensor or a constant"
    first = min(pos[n] for n in R)
    if any(pos[x] > first for x in inputs.values()):
        return "a call input is computed after the region starts"
    outs = []
    for a in sig.outputs:
        if not isinstance(a, TensorArgument):
            return f"call output {a} is not a tensor"
        want = canon.get(a.name, a.name)
        src = [n for n in R if not _is_aux(n) and canon.get(_name(n), _name(n)) == want]
        if len(src) != 1:
            return f"call output {a.name} is not one op of the region"
        outs.append((a.name, src[0]))
    out_nodes = {o for _, o in outs}
    for n in R:
        if n not in out_nodes and any(u not in Rs for u in n.users):
            return f"{n.name} is read outside the module but is not a call output"
    return inputs, outs


def lower_module_calls(gm: fx.GraphModule, blocks: tuple[str, ...] = ()) -> tuple[fx.Graph, list[str], list[tuple[str, str]]]:
    """A copy of ``gm``'s (rewritten, flat) graph with a ``call_module`` of each intact candidate region; the node
    names of everything kept are ``gm``'s. Returns ``(graph, called paths, [(path, why) stayed inlined])``.
    ``blocks``: the block paths; a module is called only from inside the block that holds it (or from outside
    every block when no block holds it)."""
    info: ModuleCallInfo = gm.meta[SIGNATURES_META]
    graph = gm.graph
    pos = {n: i for i, n in enumerate(graph.nodes)}
    count: dict[str, int] = {}
    for n in graph.nodes:
        nm = _name(n)
        if nm is not None:
            count[nm] = count.get(nm, 0) + 1
    by_key: dict[str, tuple[str, list[fx.Node]]] = {}
    for n in graph.nodes:
        if n.op in ("call_function", "call_method"):
            for key, v in (n.meta.get("nn_module_stack") or {}).items():
                if isinstance(v, tuple) and v and v[0] in info.signatures:
                    by_key.setdefault(key, (v[0], []))[1].append(n)
    refused: list[tuple[str, str]] = list(info.dropped)
    plan: dict[fx.Node, tuple] = {}  # first node of a region -> (path, inputs, outs, stack)
    gone: set[fx.Node] = set()
    for key, (path, nodes) in sorted(by_key.items(), key=lambda kv: kv[1][0].count(".")):
        R = [n for n in nodes if n not in gone and role_of(n) is None and _name(n) is not None]
        if not R:
            continue
        if any(count[_name(n)] > 1 for n in R):
            refused.append((path, "its ops were copied by the rewrite"))
            continue
        stack = dict(R[0].meta.get("nn_module_stack") or {})
        keys = list(stack)
        parent = {k: stack[k] for k in keys[:keys.index(key)]} if key in stack else {}
        got = _check(key, path, R, info, info.signatures[path], pos, {v[0] for v in parent.values()}, blocks)
        if isinstance(got, str):
            refused.append((path, got))
            continue
        inputs, outs = got
        plan[min(R, key=pos.__getitem__)] = (path, inputs, outs, parent, key)
        gone.update(R)

    out = fx.Graph()
    out._codegen = graph._codegen
    env: dict[fx.Node, fx.Node] = {}
    called: list[str] = []
    for n in graph.nodes:
        if n in plan:
            path, inputs, outs, parent, key = plan[n]
            sig = info.signatures[path]
            flat = [env[inputs[a.name]] if a.name in inputs else a.value for a in sig.inputs]
            args, kwargs = pytree.tree_unflatten(flat, sig.in_spec)
            leaf = sig.out_spec.is_leaf()
            call = out.create_node("call_module", path, tuple(args), dict(kwargs),
                                   name=outs[0][1].name if leaf else None)
            call.meta["nn_module_stack"] = parent
            call.meta[CALL_META] = path
            results = [call] if leaf else _spec_outputs(out, call, sig.out_spec)
            if len(results) != len(outs):  # pragma: no cover - export's spec and outputs disagree
                raise AssertionError(f"module call {path}: {len(results)} outputs for {len(outs)} signature outputs")
            for r, (_, src) in zip(results, outs):
                r.meta.update({k: v for k, v in src.meta.items() if k in ("val", "tensor_meta", "stack_trace")})
                if r is not call:
                    r.meta["nn_module_stack"] = parent
                env[src] = r
            called.append(f"{path}@{key.rpartition('@')[2]}" if "@" in key else path)
        if n in gone:
            continue
        env[n] = out.node_copy(n, env.__getitem__)
    for n in [n for n in out.nodes if n.op == "get_attr" and not n.users]:  # the called modules' own weights
        out.erase_node(n)
    out.lint()
    return out, called, refused


def _spec_outputs(g: fx.Graph, call: fx.Node, spec: Any) -> list[fx.Node]:
    """The flat outputs of ``call`` by its pytree ``spec`` (tuples, lists and dicts)."""
    if spec.is_leaf():
        return [call]
    if spec.type not in (tuple, list, dict):
        raise ValueError(f"output container {spec.type.__name__}")
    keys = spec.context if spec.type is dict else range(spec.num_children)
    flat: list[fx.Node] = []
    for k, child in zip(keys, spec.children()):
        flat += _spec_outputs(g, g.call_function(operator.getitem, (call, k)), child)
    return flat
