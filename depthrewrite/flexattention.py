"""FlexAttention's ``BlockMask`` as an input of a captured call, and FlexAttention's operator in captured graphs.

torchtitan builds its language models with FlexAttention by default: the model takes the ``BlockMask`` as a forward
argument (``attention_masks``), built once per batch outside the model. ``torch.export`` takes only tensors, numbers
and registered containers as inputs, and this torch does not register ``BlockMask``. Here it is registered (on first
sight of one) as a pytree node with ``BlockMask``'s own flatten, which puts its index tensors *and what its
``mask_mod`` closes over* (a document mask's ids, a window size) among the leaves: tensors are graph inputs, so a
later call with another mask runs the same graph with its own tensors; other values are part of the call's
structure by value, as the mask function's code and closure structure are (the tree's context). A call with another
mask function, window or sequence length gets its own graph, never another mask's.

While capturing (:func:`capturing`), ``flex_attention`` is traced as its operator (not through the ``torch.compile``
it wraps itself in outside one, which export cannot take), with the closure tensors as the operator's operands (its
trace outside Dynamo would keep them as constants), and without its refusal of CPU inputs that require grad. The
captured graphs call :func:`flex_attention`, the operator with explicit operands, or under Dynamo (the depthrewrite
backend) in the 7-operand form Dynamo takes. The operator's own backward runs, on CPU too.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Iterator

import torch
import torch.utils._pytree as pytree

__all__ = ["is_block_mask", "is_block_mask_type", "has_block_mask", "register_block_mask", "register_block_mask_for",
           "capturing", "flex_attention", "retarget"]

try:
    import torch.nn.attention.flex_attention as _flex
    from torch.nn.attention.flex_attention import BlockMask
except ImportError:  # pragma: no cover - every supported torch has it
    _flex = None
    BlockMask = None

#: the parts of this torch the registration uses (torch >= 2.10 has them; without them BlockMask stays unsupported)
_SUPPORTED = _flex is not None and all(
    hasattr(_flex, n) for n in ("_MaskModWrapper", "_StrippedClosure", "_StrippedPartial", "_PlainFunction",
                                "_CallableLeaf", "_extract_callable_pytree", "_reconstruct_closure_fn", "_validate_device",
                                "flex_attention_hop", "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG")
) and all(hasattr(BlockMask, n) for n in ("_flatten", "_flatten_with_keys", "_unflatten"))


def is_block_mask(x: Any) -> bool:
    return BlockMask is not None and isinstance(x, BlockMask)


def is_block_mask_type(t: Any) -> bool:
    """Whether ``t`` is ``BlockMask``: a value object (attention reads it, nothing updates it in place), so a module
    call may take one rebuilt from its tensors, unlike a KV cache."""
    return BlockMask is not None and t is BlockMask


def has_block_mask(values: Any) -> bool:
    """Whether a ``BlockMask`` is among ``values`` or in a list, tuple or dict among them (torchtitan passes one, or
    a dict of them by layer kind)."""
    for v in values:
        if is_block_mask(v):
            return True
        if isinstance(v, (list, tuple)) and has_block_mask(v):
            return True
        if isinstance(v, dict) and has_block_mask(v.values()):
            return True
    return False


class _MaskMod(_flex._MaskModWrapper if _SUPPORTED else object):  # type: ignore[misc]
    """The mask function in the tree's context: ``BlockMask``'s own equality (code and closure structure), with a
    short ``repr`` (a call's structure is keyed by the tree spec's text; the stripped closure's own repr prints the
    function's globals)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"mask_mod({_describe(self.fn)}, {self.callable_spec})"


def _describe(fn: Any) -> str:
    """Text that differs wherever ``BlockMask``'s equality of mask functions does (it may differ where that equality
    does not: a call then gets a graph of its own, never another mask's): code by name, place and content hash,
    nested functions in the closure likewise, the closure's other values as ``*`` (they are leaves)."""

    def code(c: Any) -> str:
        return f"{c.co_qualname}@{c.co_filename}:{c.co_firstlineno}#{hash(c) & 0xFFFFFFFF:08x}"

    def entries(es: tuple) -> str:
        return ", ".join(f"{_describe(e.stripped)}:{e.callable_spec}" if isinstance(e, _flex._CallableLeaf) else "*"
                         for e in es)

    if isinstance(fn, _flex._StrippedClosure):
        return f"{code(fn.code)}[{entries(fn.leaf_entries)}]"
    if isinstance(fn, _flex._StrippedPartial):
        return f"partial[{entries(fn.leaf_entries)}]"
    if isinstance(fn, _flex._PlainFunction):
        return code(fn.fn.__code__)
    if hasattr(fn, "__code__"):
        return code(fn.__code__)
    return repr(fn)


@contextlib.contextmanager
def _not_compiling() -> Iterator[None]:
    # BlockMask's flatten leaves the mask function's closure alone while torch.compile or export traces (Dynamo
    # lifts closures itself); export's input tree is built inside its trace, a call's outside: the same flatten in both
    old = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = False
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old


def _with_short_repr(context: tuple) -> tuple:
    return tuple(_MaskMod(c.fn, c.callable_spec) if type(c) is _flex._MaskModWrapper else c for c in context)


# Dynamo would trace these with torch.compiler.is_compiling() true (BlockMask's flatten then keeps the closure): run
# eagerly, they flatten a mask under torch.compile as a captured graph's input spec expects
@torch.compiler.disable
def _flatten(mask: Any) -> tuple[Any, Any]:
    with _not_compiling():
        leaves, context = mask._flatten()
    return list(leaves), _with_short_repr(context)


@torch.compiler.disable
def _flatten_with_keys(mask: Any) -> tuple[Any, Any]:
    with _not_compiling():
        leaves, context = mask._flatten_with_keys()
    return list(leaves), _with_short_repr(context)


def _unflatten(leaves: Any, context: Any) -> Any:
    return BlockMask._unflatten(tuple(leaves), context)


def register_block_mask() -> bool:
    """Register ``BlockMask`` as a pytree node (once; nothing if this torch registers it itself). False where this
    torch lacks what the registration uses: a ``BlockMask`` input is then refused by the capture."""
    if not _SUPPORTED:
        return False
    if BlockMask not in pytree.SUPPORTED_NODES:
        pytree.register_pytree_node(BlockMask, _flatten, _unflatten, flatten_with_keys_fn=_flatten_with_keys,
                                    serialized_type_name="torch.nn.attention.flex_attention.BlockMask")
    return True


def register_block_mask_for(values: Any) -> None:
    """:func:`register_block_mask` when a ``BlockMask`` is among a call's ``values`` (:func:`has_block_mask`), before
    the call is flattened (its key, its capture); once registered, nothing is looked at."""
    if _SUPPORTED and BlockMask not in pytree.SUPPORTED_NODES and has_block_mask(values):
        register_block_mask()


def _lift(fn: Any) -> tuple[Any, tuple]:
    """``(fn', tensors)``: ``fn`` with the tensors its closure holds taken out as trailing arguments. The operator's
    trace outside Dynamo keeps a closure's tensors as constants of the mask graph (export's fake tensors, nothing a
    later call could feed); as the operator's ``*_other_buffers`` they are edges from the graph's inputs."""
    with _not_compiling():
        leaves, spec, stripped = _flex._extract_callable_pytree(fn)
    at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    if not at:
        return fn, ()

    def lifted(*a: Any) -> Any:
        values = list(leaves)
        for i, t in zip(at, a[len(a) - len(at):]):
            values[i] = t
        return _flex._reconstruct_closure_fn(stripped, values, spec)(*a[: len(a) - len(at)])

    return lifted, tuple(leaves[i] for i in at)


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """While export captures a model: ``flex_attention`` traced as its operator (not through the ``torch.compile``
    it wraps itself in outside one, whose fake tensors export cannot take), with the score and mask functions'
    closure tensors as the operator's operands, and its refusal of CPU inputs that require grad off (export traces
    with the parameters' ``requires_grad``). Only FlexAttention's calls are affected."""
    if not _SUPPORTED:
        yield
        return
    debug, validate, hop = _flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG, _flex._validate_device, _flex.flex_attention_hop
    _flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True  # the operator itself, not torch.compile(operator)

    def validate_device(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        validate(query.detach(), key.detach(), value.detach())  # the refusal reads requires_grad; device checks stay

    def flex_attention_hop(query, key, value, score_mod, block_mask, scale, kernel_options,
                           score_mod_other_buffers=(), mask_mod_other_buffers=()):
        score_mod, s = _lift(score_mod)
        mask_mod, m = _lift(block_mask[-1])
        return hop(query, key, value, score_mod, (*block_mask[:-1], mask_mod), scale, kernel_options,
                   (*score_mod_other_buffers, *s), (*mask_mod_other_buffers, *m))

    _flex._validate_device, _flex.flex_attention_hop = validate_device, flex_attention_hop
    try:
        yield
    finally:
        _flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG, _flex._validate_device = debug, validate
        _flex.flex_attention_hop = hop


def flex_attention(query, key, value, score_mod, block_mask, scale, kernel_options, score_mod_other_buffers=(),
                   mask_mod_other_buffers=()):
    """The captured graphs' call of FlexAttention's operator (:func:`retarget`): the operator itself, with the score
    and mask functions' tensors as explicit operands, except under Dynamo (``torch.compile``, the depthrewrite
    backend), which takes the operator with 7 operands only and lifts what the functions close over itself: there the
    operands are closed over."""
    hop = _flex.flex_attention_hop
    if not torch.compiler.is_dynamo_compiling():
        return hop(query, key, value, score_mod, block_mask, scale, kernel_options, score_mod_other_buffers,
                   mask_mod_other_buffers)
    score, mask = score_mod, block_mask[-1]
    if score_mod_other_buffers:
        def score(s, b, h, q, kv):
            return score_mod(s, b, h, q, kv, *score_mod_other_buffers)
    if mask_mod_other_buffers:
        def mask(b, h, q, kv):
            return block_mask[-1](b, h, q, kv, *mask_mod_other_buffers)
    return hop(query, key, value, score, (*block_mask[:-1], mask), scale, kernel_options)


def _autograd_function(cls: Any) -> Any:
    if isinstance(cls, str):  # export stores the class by its qualified name
        module, _, name = cls.rpartition(".")
        cls = getattr(importlib.import_module(module), name, None)
    return cls if isinstance(cls, type) and issubclass(cls, torch.autograd.Function) else None


def _unwrap_flat_applies(sub: Any) -> int:
    """In a score or mask graph, each ``flat_apply`` of an autograd Function (export's form of the ``ModIndex`` a
    tensor index ``doc[b, q]`` traces to) becomes a call of that Function's ``apply``: the same computation, which
    Dynamo traces (it refuses the ``flat_apply`` form there)."""
    from torch.export.custom_ops import _call_custom_autograd_function_in_pre_dispatch as by_name

    flat_apply = getattr(torch.ops.higher_order, "flat_apply", None)
    n = 0
    for node in list(sub.graph.nodes):
        if node.op != "call_function" or node.target is not flat_apply or len(node.args) < 2:
            continue
        func, spec = (getattr(sub, a.target, None) if isinstance(a, torch.fx.Node) and a.op == "get_attr" else a
                      for a in node.args[:2])
        if not (isinstance(func, pytree.TreeSpec) and isinstance(spec, pytree.TreeSpec)):
            continue
        fn = getattr(pytree.tree_unflatten([], func), "func", None)
        args, kwargs = pytree.tree_unflatten(list(node.args[2:]), spec)
        cls = _autograd_function(args[0]) if fn is by_name and args else None
        if cls is None:
            continue
        node.target, node.args, node.kwargs = cls.apply, tuple(args[1:]), dict(kwargs)
        n += 1
    if n:
        sub.graph.eliminate_dead_code()
        sub.recompile()
    return n


def retarget(gm: Any) -> int:
    """Make each call of FlexAttention's operator in ``gm`` (an ``fx.GraphModule`` export captured) a call of
    :func:`flex_attention`, with the same operands, and its score and mask graphs ones Dynamo traces
    (:func:`_unwrap_flat_applies`); how many calls."""
    op = getattr(torch.ops.higher_order, "flex_attention", None)
    n = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and op is not None and node.target is op:
            node.target = flex_attention
            n += 1
            for a in (node.args[3], node.args[4][-1]):
                if isinstance(a, torch.fx.Node) and a.op == "get_attr":
                    _unwrap_flat_applies(gm.get_submodule(a.target))
    if n:
        gm.recompile()
    return n
