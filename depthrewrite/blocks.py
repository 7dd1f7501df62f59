"""Blocks stay modules: a converted model's forward calls one module per transformer block.

A captured and rewritten graph (:mod:`depthrewrite.converted`) is flat: every block's operations inlined. To let the
tools people apply per block keep working — ``fully_shard(model.layers[i])``, activation checkpointing
(``activation_checkpointing_enable()``, ``checkpoint_wrapper``), ``torch.compile`` per block — the flat graph is
split (:func:`split_blocks`) into

* one **block program** per transformer block: the block's part of the graph, whose inputs are the values it reads
  from outside (the depth state: block summaries and partial sum, earlier sources, mHC's streams, MoDA's depth K/V,
  plus RoPE tables, the mask and the new parameters of its sites) and whose outputs are what later code reads;
* a **runner**: the rest of the graph (embedding, masks, final norm, head, loss) with one ``call_module`` per block
  at the block's original path (``model.layers.3``), passing the program first and then its inputs.

The block module is the user's own object, of a subclass of its class (:func:`converted_block_class`) whose
``forward(program, *inputs)`` runs the program with the block itself as ``self``: parameters are read from the block
at call time under their original names, so FSDP2's gathered parameters, a checkpoint wrapper around the block or a
compiled block are what runs. The runner reads every other parameter from the live model too (see
:meth:`depthrewrite.converted.ConvertedGraphModule.__getattr__`).

Blocks are found from dataflow: the module whose ``forward`` holds a sublayer's residual add, or its nearest
ancestor, that is an element of a ``ModuleList``/``ModuleDict``/``Sequential``. Where a model has none (its parent
adds the residuals itself) or the split would not be a sequence of block calls, the flat graph runs and the report
says why (:func:`split_blocks` returns the reason).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import operator
import types
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
import torch.nn as nn

from .converted import resolve_target
from .errors import DepthRewriteError
from .kernels.direct import direct_call, plain_eager
from .passes.lower.module_calls import autocast_blocks, is_dtensor, known_before_tracing, take_hooks_out

__all__ = [
    "BlockProgram",
    "BlockSplit",
    "block_paths",
    "converted_block_class",
    "split_blocks",
    "unwrap",
]

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
#: node.meta key of a call_module made by the module-call lowering (depthrewrite.passes.lower.module_calls.CALL_META)
_MODULE_CALL = "depthrewrite_module_call"
#: gm.meta key of the lowering's ``(graph, called, refused)`` (module_calls.LOWERED_META), split in place of gm.graph
_LOWERED = "depthrewrite_module_call_graph"
#: attributes under which module wrappers keep the module they wrap: torch's checkpoint_wrapper, torch.compile's
#: OptimizedModule
WRAPPER_ATTRS = ("_checkpoint_wrapped_module", "_orig_mod")


def unwrap(module: nn.Module) -> nn.Module:
    """The module inside wrappers that call it (``checkpoint_wrapper``'s CheckpointWrapper, ``torch.compile``'s
    OptimizedModule), or ``module`` itself."""
    seen = 0
    while seen < 8:
        inner = next((module.__dict__["_modules"].get(a) for a in WRAPPER_ATTRS if a in module.__dict__["_modules"]), None)
        if inner is None:
            return module
        module, seen = inner, seen + 1
    return module


def unwrapped_path(path: str) -> str:
    """``path`` without the segments module wrappers add (``_checkpoint_wrapped_module``, ``_orig_mod``)."""
    return ".".join(p for p in path.split(".") if p not in WRAPPER_ATTRS)


def get_path(root: nn.Module, path: str) -> nn.Module | None:
    mod = root
    for part in path.split(".") if path else ():
        mod = unwrap(mod)._modules.get(part)
        if mod is None:
            return None
    return unwrap(mod)


def _slot(root: nn.Module, path: str) -> nn.Module | None:
    """The module in ``path``'s container slot: the block itself, or a wrapper around it."""
    parent_path, _, name = path.rpartition(".")
    parent = get_path(root, parent_path)
    return None if parent is None else parent._modules.get(name)


def block_paths(model: nn.Module, chain: Any) -> tuple[tuple[str, ...], tuple[int, ...]] | str:
    """``(block paths in order, block index per sublayer)`` for ``chain`` (of a graph of ``model``), or the reason
    there are no block modules to keep."""
    per_site: list[str] = []
    for s in chain.sublayers:
        path = s.module
        found = None
        while path:
            parent = path.rpartition(".")[0]
            if isinstance(get_path(model, parent), _CONTAINERS):
                found = path
                break
            path = parent
        if found is None:
            return (f"sublayer {s.index}'s residual add is in {s.module or 'the model itself'!r}, which is not an "
                    "element of a ModuleList / ModuleDict / Sequential: no block module holds it")
        per_site.append(found)
    paths: list[str] = []
    for p in per_site:
        if not paths or paths[-1] != p:
            if p in paths:
                return f"the sublayers of block {p!r} are not consecutive in the chain"
            paths.append(p)
    return tuple(paths), tuple(paths.index(p) for p in per_site)


# ---- the block program --------------------------------------------------------------------------------------------


_UNSET = object()


class BlockProgram:
    """What one converted block runs for one captured graph: the block's part of it, with the block as ``self``
    (parameters read from the block by their original names). Passed to the block as its first argument."""

    __slots__ = ("path", "fn", "module", "inputs", "outputs", "checkpoint", "listed", "_direct")

    def __init__(self, path: str, module: fx.GraphModule, inputs: tuple[str, ...], outputs: tuple[str, ...],
                 checkpoint: Callable[[nn.Module], bool]):
        self.path = path
        self.module = module  # the program as a GraphModule, to read (print(program.module.code))
        self.fn = type(module).forward  # the generated code, called with the block as self
        self.inputs = inputs
        self.outputs = outputs
        self.checkpoint = checkpoint  # checkpoint(block): whether depthrewrite itself checkpoints it in this call
        self.listed: _Listed | None = None  # stacked: its first input is the stack of earlier depth sources
        self._direct: Any = _UNSET

    @property
    def direct(self) -> Callable[..., tuple] | None:
        """The code for a plainly eager call (no gradients: a decoding step), with the depth ops' bodies called
        directly (:mod:`depthrewrite.kernels.direct`); None when the program calls no depth op. Made on first use."""
        if self._direct is _UNSET:
            from .kernels.direct import direct_forward

            self._direct = direct_forward(self.module)
        return self._direct

    @property
    def graph(self) -> fx.Graph:
        return self.module.graph

    def __repr__(self) -> str:
        return f"BlockProgram({self.path}: {len(self.inputs)} inputs -> {len(self.outputs)} outputs)"

    def __reduce__(self):
        raise TypeError("a block program belongs to a captured graph and is not pickled: the converted model "
                        "recaptures on first use after a copy")


def _block_forward(self, program: BlockProgram, *inputs: Any) -> tuple:
    if not isinstance(program, BlockProgram):
        raise DepthRewriteError(
            f"{type(self).__name__} is a block of a model converted by depthrewrite: it runs inside the converted "
            "model's forward (which passes the depth state between blocks) and cannot be called on its own. Call the "
            "converted model, or keep an unconverted copy (convert(..., inplace=False)) to run blocks directly."
        )
    if program.listed is not None and isinstance(inputs[0], list):  # the runner traced by Dynamo: sources apart
        fn: Callable = program.listed.call
    else:
        fn = program.fn
    if self.training and torch.is_grad_enabled() and program.checkpoint(self):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(fn, self, *inputs, use_reentrant=False)
    if fn is not program.fn:
        return fn(self, *inputs)
    if plain_eager():
        direct = program.direct
        if direct is not None:
            return direct(self, *inputs)
    return program.fn(self, *inputs)


_BLOCK_CLASSES: dict[type, type] = {}


class ConvertedBlock(nn.Module):
    """Base of converted block classes (``isinstance(m, ConvertedBlock)``)."""

    def __reduce_ex__(self, protocol):
        # the class is made per original class at run time: rebuild it, then nn.Module.__setstate__ (its
        # __getstate__ leaves out a compiled call, as for any module)
        return _new_block, (original_block_class(type(self)),), self.__getstate__()

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """``nn.Module.compile`` (what torchtitan's ``apply_compile`` and torchtune's ``compile_model`` call on each
        block), with one compiled entry point per block program: :class:`CompiledPerProgram`."""
        self._compiled_call_impl = CompiledPerProgram(self, args, kwargs)


#: block program function -> a copy of ``nn.Module._call_impl`` with a code object of its own (see CompiledPerProgram)
_CALL_IMPLS: "weakref.WeakKeyDictionary[Callable, Callable]" = weakref.WeakKeyDictionary()
_CALL_IMPL_NUMBERS = itertools.count()


def _call_impl_for(fn: Callable) -> Callable:
    impl = _CALL_IMPLS.get(fn)
    if impl is None:
        # a code object of its own, outside torch/nn (Dynamo skips a frame of torch.nn's files and compiles the first
        # one below it: the block's forward, or transformers' checkpointing wrapper around it, shared by every
        # block), with a file name of its own (Dynamo's automatic-dynamic memory is keyed by file, line and name:
        # shared, every program after the first would compile with dynamic sizes)
        base = nn.Module._call_impl
        n = next(_CALL_IMPL_NUMBERS)
        code = base.__code__.replace(co_qualname=f"Module._call_impl#{n}",
                                     co_filename=f"<nn.Module._call_impl for depthrewrite block program #{n}>")
        impl = types.FunctionType(code, base.__globals__, "_call_impl", base.__defaults__, base.__closure__)
        impl.__kwdefaults__ = base.__kwdefaults__
        _CALL_IMPLS[fn] = impl
    return impl


class CompiledPerProgram:
    """A converted block's compiled call (``block.compile(...)``): ``torch.compile`` of ``nn.Module._call_impl`` (hooks
    and all, as ``nn.Module.compile`` does), one copy of it per block program. Dynamo keeps its compiled graphs, and
    counts recompilations against ``recompile_limit`` (8), per code object; ``nn.Module.compile`` compiles the one
    ``_call_impl`` every module shares, so blocks whose programs differ (Full AttnRes reads one more source per
    block, Block AttnRes one more summary per block) each took one of its 8 entries, and a deeper model's later
    blocks ran uncompiled. Here each program function gets a ``_call_impl`` with a code object of its own, shared by
    every block that runs that function (blocks of one kind still compile once). The choice is made in Python before
    the compiled call, from the program the model passes."""

    def __init__(self, block: nn.Module, args: tuple, kwargs: dict) -> None:
        self._block = weakref.ref(block)
        self._args, self._kwargs = args, kwargs
        self._compiled: dict[Callable, Callable] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        block = self._block()
        program = args[0] if args else None
        fn = program.fn if isinstance(program, BlockProgram) else nn.Module._call_impl
        compiled = self._compiled.get(fn)
        if compiled is None:
            known_before_tracing(block)
            impl = nn.Module._call_impl if fn is nn.Module._call_impl else _call_impl_for(fn)
            compiled = self._compiled[fn] = torch.compile(types.MethodType(impl, block), *self._args, **self._kwargs)
        if isinstance(program, BlockProgram) and program.listed is not None and len(args) > 1:
            torch._dynamo.maybe_mark_dynamic(args[1], 0)  # one graph for every number of stacked sources
        return compiled(*args, **kwargs)

    def __repr__(self) -> str:
        return f"CompiledPerProgram({len(self._compiled)} programs compiled)"


def _new_block(original: type) -> nn.Module:
    return object.__new__(converted_block_class(original))


def converted_block_class(original: type) -> type:
    """A subclass of ``original`` (same name and module) whose ``forward(program, *inputs)`` runs a block program.
    Subclassing keeps ``isinstance`` checks (``apply_activation_checkpointing``'s check_fn, FSDP policies) and HF's
    per-layer activation checkpointing, which wraps ``forward`` in every subclass of its checkpointing layer."""
    cls = _BLOCK_CLASSES.get(original)
    if cls is None:
        def forward(self, program, *inputs):
            return _block_forward(self, program, *inputs)

        forward.__qualname__ = f"{original.__qualname__}.forward"
        cls = type(original.__name__, (ConvertedBlock, original), {
            "forward": forward, "__module__": original.__module__, "__qualname__": original.__qualname__,
            "__doc__": original.__doc__, "_dr_original": original,
        })
        _BLOCK_CLASSES[original] = cls
    return cls


def original_block_class(cls: type) -> type:
    """The original class of a converted block class or of a subclass of one (FSDP2's ``FSDP<Block>``)."""
    for c in cls.__mro__:
        if "_dr_original" in c.__dict__:
            return c.__dict__["_dr_original"]
    return cls


def convert_blocks(model: nn.Module, paths: tuple[str, ...]) -> list[nn.Module]:
    """Give each block at ``paths`` its converted class (in place; idempotent); returns the block objects."""
    out = []
    for p in paths:
        blk = get_path(model, p)
        if blk is None:
            raise DepthRewriteError(f"depthrewrite: block {p!r} not found in {type(model).__name__}")
        if not isinstance(blk, ConvertedBlock):
            cls = converted_block_class(type(blk))
            blk.__class__ = cls
            if "_old_forward" in blk.__dict__:  # accelerate's hook (device_map) calls _old_forward: the new forward
                blk.__dict__["_dr_old_forward"] = blk.__dict__["_old_forward"]
                blk.__dict__["_old_forward"] = types.MethodType(cls.forward, blk)
        out.append(blk)
    return out


def restore_blocks(model: nn.Module) -> None:
    """Give every converted block in ``model`` its original class back (a conversion that failed)."""
    for m in model.modules():
        if isinstance(m, ConvertedBlock):
            m.__class__ = original_block_class(type(m))
            if "_dr_old_forward" in m.__dict__:
                m.__dict__["_old_forward"] = m.__dict__.pop("_dr_old_forward")


# ---- splitting a flat graph ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class BlockSplit:
    """The result of :func:`split_blocks`: the runner graph and one program per block."""

    graph: fx.Graph  # the runner: glue nodes plus a call_module per block
    programs: dict[str, BlockProgram]  # runner attribute name -> program
    attrs: dict[str, Any]  # everything the runner's get_attr nodes read that is not the live model's


def _stack_paths(n: fx.Node) -> set[str]:
    stack = n.meta.get("nn_module_stack") or {}
    return {v[0] for v in stack.values() if isinstance(v, tuple) and v and isinstance(v[0], str)}


def split_problem(gm: fx.GraphModule, paths: tuple[str, ...], graph: fx.Graph,
                  live: Callable[[str], bool] = lambda target: True) -> str | None:
    """Why :func:`split_blocks` would refuse the module-call lowering's ``graph`` of ``gm`` (then the flat graph runs,
    calling no module), or None. Asked before the lowering is trusted: modules whose hooks were taken out for the
    capture must then be checked as inlined."""
    _functionalise_fresh_writes(graph)
    placed = _placement(gm, graph, paths, live, True)
    return placed if isinstance(placed, str) else None


def _placement(gm: fx.GraphModule, graph: fx.Graph, paths: tuple[str, ...], live: Callable[[str], bool],
               lowered: bool) -> tuple[list[fx.Node], dict[fx.Node, int], dict[fx.Node, int]] | str:
    """``(nodes, block of each block node, place of each glue node)`` for :func:`split_blocks`, or why not."""
    index = {p: i for i, p in enumerate(paths)}
    prefixes = [(p + ".", i) for i, p in enumerate(paths)]
    nodes = list(graph.nodes)
    block: dict[fx.Node, int] = {}
    for n in nodes:
        if n.op == "get_attr":
            b = next((i for pre, i in prefixes if n.target.startswith(pre)), None) if live(n.target) else None
        elif n.op in ("call_function", "call_method") or (n.op == "call_module" and _MODULE_CALL in n.meta):
            hits = [index[p] for p in _stack_paths(n) if p in index]
            b = max(hits) if hits else None
        else:
            b = None
        if b is not None:
            block[n] = b
    for n in nodes:  # a buffer of one module shared by several blocks (torchtune's one RoPE module): a side input
        if (n.op == "get_attr" and n in block and any(block.get(u, block[n]) != block[n] for u in n.users)
                and not isinstance(resolve_target(gm, n.target), nn.Parameter)):  # a parameter stays its block's (FSDP2)
            del block[n]
    if not block:
        return "no operation of the graph runs inside a block module"
    missing = [p for i, p in enumerate(paths) if i not in block.values()]
    if missing:
        return f"no operation of the graph runs inside block {missing[0]!r}"

    # glue nodes between one block's operations (no module stack) join the block; a glue node that needs a later
    # block and feeds an earlier one cannot be placed
    for _ in range(4):
        after = _after(nodes, block)
        before = _before(nodes, block)
        moved = False
        for n in nodes:
            if n in block or n.op in ("placeholder", "output", "get_attr"):
                continue
            a, b = after[n], before[n]
            if b is None or a < b:
                continue
            if a == b:
                block[n] = a
                moved = True
            else:
                return f"`{n.name}` reads block {paths[a]!r} and is read by the earlier block {paths[b]!r}"
        if not moved:
            break
    _move_to_readers(nodes, block)
    _final_mix_to_runner(nodes, block, len(paths) - 1)
    for n, b in block.items() if lowered else ():  # a module call runs with its block as self: its own module
        if n.op == "call_module" and not n.target.startswith(paths[b] + "."):
            return f"`{n.name}` calls {n.target!r} inside block {paths[b]!r}, which does not hold it"
    after = _after(nodes, block)
    for n, b in block.items():
        for x in n.all_input_nodes:
            if x in block and block[x] > b:
                return f"block {paths[b]!r} reads `{x.name}` of the later block {paths[block[x]]!r}"

    level = _glue_levels(nodes, block, after)
    if isinstance(level, str):
        return level
    why = _place_autocast_blocks(nodes, block, level)
    if why is not None:
        return why
    return nodes, block, level


def split_blocks(gm: fx.GraphModule, paths: tuple[str, ...], checkpoint: Callable[[nn.Module], bool],
                 live: Callable[[str], bool] = lambda target: True, graph: fx.Graph | None = None) -> BlockSplit | str:
    """Split the flat rewritten graph ``gm`` into a runner and one :class:`BlockProgram` per block at ``paths``; or
    the reason it cannot be (then the flat graph runs). ``live(target)``: whether a ``get_attr`` target is the live
    model's (a block reads those itself; others, such as export's lifted constants, are passed in). ``graph``: the
    graph to split in place of ``gm.graph`` (the module-call lowering's copy, whose ``call_module`` nodes of
    called modules are placed by their module stack like operations; ``gm`` still resolves attributes)."""
    lowered = graph is not None
    graph = graph if lowered else gm.graph
    if _functionalise_fresh_writes(graph) and not lowered:
        gm.recompile()
    placed = _placement(gm, graph, paths, live, lowered)
    if isinstance(placed, str):
        return placed
    nodes, block, level = placed

    members: list[list[fx.Node]] = [[] for _ in paths]
    for n in nodes:
        if n in block:
            members[block[n]].append(n)
    out = fx.Graph()
    out._codegen = graph._codegen
    env: dict[fx.Node, fx.Node] = {}
    programs: dict[str, BlockProgram] = {}
    attrs: dict[str, Any] = {}
    code: dict[str, Callable] = {}
    stacks = _SourceStacks(members) if STACK_SOURCES else None

    def glue(at: int) -> None:
        for n in nodes:
            if n not in block and n.op != "output" and level[n] == at and not _is_pipe_split(n):
                if stacks is not None and stacks.filled and _stack_rows(n, stacks.index) == stacks.filled \
                        and n.target is not torch.ops.depthrewrite.moda_attn_slots.default:
                    # the final mix after the last block: the stack's rows, not every source again (kept twice)
                    env[n] = _stacked_site(out, n, stacks.last, stacks.filled, env.__getitem__, runner=True)
                else:
                    env[n] = out.node_copy(n, env.__getitem__)

    glue(-1)
    for b, path in enumerate(paths):
        mine = set(members[b])
        ins: list[fx.Node] = []
        seen: set[fx.Node] = set()
        for n in members[b]:
            for x in n.all_input_nodes:
                if x not in mine and x not in seen:
                    seen.add(x)
                    ins.append(x)
        outs = [n for n in members[b] if any(u not in mine for u in n.users)]
        rows = stacks.rows[b] if stacks is not None else 0
        stacked = stacks.slots[:rows] if rows else []
        in_stack = set(_flat_parts(stacked))
        rest = [x for x in ins if x not in in_stack]
        prog_gm = _program(gm, path, members[b], rest, outs, stacked)
        name = f"_dr_block_{b}"
        prog = BlockProgram(path, prog_gm, tuple(x.name for x in ins), tuple(o.name for o in outs), checkpoint)
        if rows:
            prog.listed = _Listed(gm, path, members[b], ins, outs, stacked, rest, code)
        prog.fn = code.setdefault(prog_gm.code, prog.fn)  # one function per distinct code: compiled once per block kind
        programs[name] = prog
        attrs[name] = prog
        p_node = out.get_attr(name)
        head = (stacks.runner_stack(out, env, rows),) if rows else ()
        call = out.call_module(path, (p_node, *head, *(env[x] for x in rest)))
        call.meta["depthrewrite_block"] = path
        for j, o in enumerate(outs):
            g = out.call_function(operator.getitem, (call, j))
            g.meta.update({k: v for k, v in o.meta.items() if k in ("val", "tensor_meta", "nn_module_stack")})
            env[o] = g
        glue(b)
    for n in nodes:
        if n.op == "output":
            env[n] = out.node_copy(n, env.__getitem__)
    out.lint()
    return BlockSplit(out, programs, attrs)


def _move_to_readers(nodes: list[fx.Node], block: dict[fx.Node, int]) -> None:
    """Move an operation whose results only a later block reads into that block, when every value it reads from its
    own block crosses to the later block anyway: the crossing shrinks by its result. This is where the mix that
    feeds a block's first sublayer goes (it reads the block summaries and partial sum, which cross anyway): a block
    then receives the depth state, not the state plus the mixed input, and activation checkpointing keeps one
    tensor per block less (the depth state in place of the original's hidden states)."""
    written = {n.args[0] for n in nodes if n.op == "call_function" and _mutates(n) and n.args}
    for _ in range(4):
        moved = False
        for n in reversed(nodes):
            b = block.get(n)
            if b is None or n.op not in ("call_function", "call_method") or not n.users or n.is_impure() \
                    or _mutates(n) or any(x in written for x in n.all_input_nodes):
                continue
            readers = {block.get(u) for u in n.users}
            if len(readers) != 1:
                continue
            c = readers.pop()
            if c is None or c <= b:
                continue
            if all(block.get(x) != b or any(block.get(u) == c for u in x.users if u is not n)
                   for x in n.all_input_nodes):
                block[n] = c
                moved = True
        if not moved:
            return


def _final_mix_to_runner(nodes: list[fx.Node], block: dict[fx.Node, int], last: int) -> None:
    """The depth ops of the last block that only operations after it read (the mix for the final norm, mHC's
    collapse of its streams) run in the runner after that block: its program is then the same as the blocks' before
    it (one compile for all of them). Not where the graph keeps a ``torch.autocast`` block (the op could be inside
    it: :func:`_place_autocast_blocks` keeps such a region whole)."""
    if any(n.op == "call_function" and n.target is torch.amp._enter_autocast for n in nodes):
        return
    final = [n for n in nodes if block.get(n) == last and n.op == "call_function" and n.users
             and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "depthrewrite"
             and all(u not in block for u in n.users)]
    for n in final:  # only those: what they read stays in the block (as in the blocks before it)
        del block[n]


def _glue_levels(nodes: list[fx.Node], block: dict[fx.Node, int], after: dict[fx.Node, int]) -> dict | str:
    """Per glue node, the block call it runs after (-1: before all): the latest block it depends on. Splitting
    reorders operations by their data only, so a graph that writes a tensor in place that anything else reads
    (directly or through a view) cannot be split: the reason string. A write to a tensor nothing else reads (export's
    ``detach_`` of a fresh constant) goes anywhere."""
    for n in nodes:
        if n.op != "call_function" or not _mutates(n):
            continue
        written = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        if written is None or set(written.users) != {n}:
            return (f"`{n.name}` ({n.target}) writes a tensor in place that other operations read: splitting at the "
                    "blocks reorders operations by their data only, which would move reads across the write")
    return {n: after[n] for n in nodes if n not in block}


def _place_autocast_blocks(nodes: list[fx.Node], block: dict[fx.Node, int], level: dict[fx.Node, int]) -> str | None:
    """A ``torch.autocast`` block kept as its ``_enter_autocast`` / ``_exit_autocast`` nodes (one holding a module call,
    :func:`~depthrewrite.passes.lower.module_calls._autocast_regions_kept`) must run around the same operations after
    the split: all inside one block's program, or all glue at one place between block calls (the two nodes, and
    anything inside that reads nothing, get that place; by their data alone they would run first). One around
    operations of a block and of the runner (a model running its blocks inside ``torch.autocast``), or around glue at
    two places, cannot be split: the reason string (the flat graph then runs, in its order)."""
    from .passes.meta import role_of

    for enter, inside, n in autocast_blocks(nodes):
        # an attribute read runs the same anywhere; so does what the rewrite made (the depth mixing, whose inputs the
        # original computed before the block: the final mix ahead of a head under autocast(enabled=False))
        body = [x for x in inside if x.op not in ("placeholder", "output", "get_attr") and role_of(x) is None]
        where = {block.get(x) for x in (enter, *body, n)}
        if len(where) == 1 and None not in where:
            continue  # inside one block's program
        if where != {None}:
            return (f"the torch.autocast block `{enter.name}` .. `{n.name}` runs around operations of "
                    f"{'blocks and of the model around them' if None in where else 'more than one block'}: splitting "
                    "at the blocks would move them out of it")
        fed = [x for x in body if x.all_input_nodes]
        at = max((level[x] for x in fed), default=-1)
        late = [x for x in body if not x.all_input_nodes
                and any((block[u] if u in block else level.get(u, at + 1)) <= at for u in x.users if u not in body)]
        if any(level[x] != at for x in fed) or late:
            return (f"the torch.autocast block `{enter.name}` .. `{n.name}` runs around operations the split would "
                    "place at two points between the blocks")
        for x in (enter, *body, n):
            level[x] = at
    return None


def _functionalise_fresh_writes(graph: fx.Graph) -> int:
    """Turn an in-place write into its out-of-place form where nothing can tell: ``op_(x, ...)`` on a tensor ``x``
    made in the graph by an operation that returns a new tensor, when every other reader of ``x`` comes before the
    write and is no view of it (litgpt's ``mask = ones(T, T).triu(1); mask.masked_fill_(mask.bool(), -inf)``): the
    readers before see ``x`` as it was, the readers after read the write's result already. Returns how many were
    turned; the graph keeps its order, so the block split may then move reads freely."""
    from torch.multiprocessing.reductions import StorageWeakRef

    unknown = object()  # a value whose storage cannot be read (a vmap-batched one, transformers' mask functions)

    def storage(v: Any):
        if not isinstance(v, torch.Tensor):
            return None
        try:
            return StorageWeakRef(v.untyped_storage())
        except RuntimeError:
            return unknown

    def may_alias(u: fx.Node, sx: Any) -> bool:
        su = storage(u.meta.get("val"))
        return su is unknown or su == sx

    order = {n: i for i, n in enumerate(graph.nodes)}
    turned = 0
    for n in list(graph.nodes):
        if n.op != "call_function" or not _mutates(n) or not n.args or not isinstance(n.args[0], fx.Node):
            continue
        x = n.args[0]
        schema = getattr(n.target, "_schema", None)
        make = getattr(x.target, "_schema", None)
        if x.op != "call_function" or make is None or make.is_mutable or any(r.alias_info for r in make.returns):
            continue  # not a fresh tensor: an input, a parameter, a view, or itself written in place
        if schema is None or not schema.name.endswith("_") or sum(a.alias_info is not None and a.alias_info.is_write
                                                                   for a in schema.arguments) != 1:
            continue
        packet = getattr(torch.ops.aten, schema.name.split("::")[-1][:-1], None)
        functional = getattr(packet, n.target._overloadname, None) if packet is not None else None
        if functional is None or functional._schema.is_mutable:
            continue
        sx = storage(x.meta.get("val"))
        if sx is None or sx is unknown or any(order[u] > order[n] or may_alias(u, sx) for u in x.users if u is not n):
            continue
        n.target = functional
        turned += 1
    return turned


def _mutates(n: fx.Node) -> bool:
    """An operation that writes one of its inputs in place (its order relative to other readers matters)."""
    schema = getattr(n.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def _is_pipe_split(n: fx.Node) -> bool:
    """A pipeline stage marker (``torch.ops.pippy._pipe_split``): a no-op when the graph runs; left out of a runner
    (the flat graph keeps it for pipelining's tracer and for :func:`depthrewrite.pipeline.stages`)."""
    return n.op == "call_function" and str(n.target) == "pippy._pipe_split.default"


def _after(nodes: list[fx.Node], block: dict[fx.Node, int]) -> dict[fx.Node, int]:
    """Per node: the latest block it depends on (-1: none); for a block's node, that block."""
    out: dict[fx.Node, int] = {}
    for n in nodes:
        if n in block:
            out[n] = block[n]
        else:
            out[n] = max((out[x] for x in n.all_input_nodes), default=-1)
    return out


def _before(nodes: list[fx.Node], block: dict[fx.Node, int]) -> dict[fx.Node, int | None]:
    """Per node: the earliest block that depends on it (None: none); for a block's node, that block."""
    out: dict[fx.Node, int | None] = {}
    for n in reversed(nodes):
        if n in block:
            out[n] = block[n]
            continue
        vals = [out[u] for u in n.users if out.get(u) is not None]
        out[n] = min(vals) if vals else None
    return out


def _own_output(g: fx.Graph, node: fx.Node) -> fx.Node:
    """``node`` as a program output that is no autograd view (:func:`~depthrewrite.passes.meta.unsafe_view_of`).

    A block output that is a view (a sublayer's linear, ``view`` of ``addmm``'s product, passed on through
    ``dropout(p=0)`` as a depth source) makes FSDP2 warn and copy, and keeps the view's base alive. Every tensor
    output: the traced value does not tell (``dropout(p=0)`` traces as a fresh tensor and runs as its input), and the
    op costs no copy."""
    from .passes.analyse.ops import tensor_val
    from .passes.meta import unsafe_view_of

    return node if tensor_val(node) is None else unsafe_view_of(g, node)


# ---- the earlier depth sources of a block as one stacked tensor ------------------------------------------------------
#
# A block's depth ops read the sources of every earlier block (Full AttnRes: all sublayer outputs so far; Block
# AttnRes: the completed block summaries), one more per block: as separate inputs, every block is a program of its
# own (its own compile, Dynamo's recompile limit). Instead, the runner writes each such source once into a buffer
# made per forward (`new_source_storage`) and passes each block the rows filled so far as one tensor
# (`source_stack`: a tensor over the buffer's first n rows; its backward hands each source its row of the gradient);
# the block's depth ops read it (`depthrewrite::depth_attn_stack`, `msar_mix_stack`; MoDA's attention reads its
# earlier key and value slots as rows of one buffer, a key and a value per row: `moda_attn_slots_stack`). Blocks that
# differ only in n then share one
# program, compiled once with n a dynamic size. A source gets a row if blocks read it at one position of their
# depth ops' source lists (the same position in every block; per position the source read by the most blocks):
# Block AttnRes's open partial sum, a different tensor per block, stays a separate input. Rows are written once and
# never again in a forward, so what an earlier block saved for its backward stays valid.

#: stack the earlier depth sources of each block (False: every source a separate input; the tests compare both)
STACK_SOURCES = True


def _bound(n: fx.Node) -> dict[str, Any]:
    """The arguments of the op call ``n`` by name (defaults not filled in)."""
    out = dict(zip((a.name for a in n.target._schema.arguments), n.args))
    out.update(n.kwargs)
    return out


def _stackable_sources(n: fx.Node) -> list | None:
    """The sources of a depth op that has a stacked form (``depth_attn``; ``msar_mix`` without left context;
    ``moda_attn_slots`` whose key and value slots have one shape and dtype: its (key, value) pairs), else None."""
    if n.op != "call_function":
        return None
    if n.target is torch.ops.depthrewrite.moda_attn_slots.default:
        a = _bound(n)
        pairs = list(zip(a["slots_k"], a["slots_v"]))
        return pairs if pairs and _one_layout(pairs) else None
    if n.target is torch.ops.depthrewrite.depth_attn.default:
        return list(n.args[0])
    if n.target is torch.ops.depthrewrite.msar_mix.default and _bound(n).get("left") is None:
        return list(n.args[0])
    return None


def _one_layout(pairs: list[tuple]) -> bool:
    """Whether MoDA's key and value slots have one shape and dtype (they can share a row of the stack). MoDA's rewrite
    gives every key slot one shape and every value slot one (``ConfigError`` otherwise), so the pairs whose traced
    values are known (an attention's own slots; an FFN's ``kv_proj`` slots have none) decide for all."""
    from .passes.analyse.ops import tensor_val

    known = []
    for k, v in pairs:
        vk, vv = (tensor_val(x) if isinstance(x, fx.Node) else None for x in (k, v))
        if vk is not None and vv is not None:
            known.append(vk.shape == vv.shape and vk.dtype == vv.dtype)
    return bool(known) and all(known)


def _parts(x: Any) -> tuple:
    """The nodes of one row of the stack: a source, or MoDA's (key, value) pair."""
    return x if isinstance(x, tuple) else (x,)


def _flat_parts(rows: list) -> list:
    """The nodes of the stack's ``rows`` in order, row by row (the order ``source_stack`` writes and lists them)."""
    return [c for x in rows for c in _parts(x)]


def _stack_rows(n: fx.Node, rows: dict[Any, int]) -> int:
    """How many leading sources of the depth op ``n`` are rows 0, 1, ... of the stack (``rows``: source -> row)."""
    sources = _stackable_sources(n)
    k = 0
    for x in sources or ():
        if rows.get(x) != k:
            break
        k += 1
    return k


def _stacked_site(g: fx.Graph, n: fx.Node, stack: fx.Node, k: int, arg: Callable[[fx.Node], Any],
                  runner: bool = False) -> fx.Node:
    """``n`` (a depth op whose first ``k`` sources are the stack's rows) as its stacked form in ``g``
    (``depth_attn_stack`` / ``msar_mix_stack``; in the runner through :func:`runner_depth_op`)."""
    ops = torch.ops.depthrewrite
    a = _bound(n)
    opt = lambda x: None if x is None else arg(x)  # noqa: E731
    if n.target is ops.moda_attn_slots.default:  # the keys and values: parts 0 and 1 of each row
        keys, values = (g.call_function(torch.ops.aten.select.int, (stack, 1, i)) for i in (0, 1))
        new = g.call_function(ops.moda_attn_slots_stack.default, (
            arg(a["q"]), arg(a["k"]), arg(a["v"]), opt(a["attn_mask"]), keys, values,
            [arg(x) for x in a["slots_k"][k:]], [arg(x) for x in a["slots_v"][k:]], opt(a["depth_weight"]),
            a["scale"], a["is_causal"], a["dropout_p"], opt(a["seed"]), a["softcap"]))
        new.meta = dict(n.meta)
        return new
    sources = a["sources"]
    per_source = float(a["scale"]) == float(len(sources))  # mix_scale="count": the scale is the source count
    scale = 1.0 if per_source else a["scale"]
    extra = [arg(x) for x in sources[k:]]
    if n.target is ops.depth_attn.default:
        op = ops.depth_attn_stack.default
        args = (stack, extra, arg(a["query"]), arg(a["gain"]), a["eps"], scale, per_source)
    else:
        op = ops.msar_mix_stack.default
        args = (stack, extra, arg(a["query"]), arg(a["gain"]), [arg(w) for w in a["conv"]], opt(a["phi"]),
                opt(a["bias"]), opt(a["alpha"]), a["eps"], scale, per_source, a["conv_values"], a["sigmoid_mixer"],
                a.get("eps_mix", 1e-6))
    new = g.call_function(runner_depth_op, (op, *args)) if runner else g.call_function(op, args)
    new.meta = dict(n.meta)
    return new


def runner_depth_op(op: Callable, stack: Any, extra: list, *args: Any) -> torch.Tensor:
    """A stacked depth op the runner runs (the final mix after the last block) on the runner's stack. While Dynamo
    traces the whole model that stack is a list of the sources (:func:`source_stack`): the op on the sources apart,
    as the blocks then run theirs (the compile backend's passes batch those)."""
    if not isinstance(stack, list):
        return (direct_call(op) if plain_eager() else op)(stack, extra, *args)  # a decoding step: the op's body
    ops = torch.ops.depthrewrite
    sources = [*stack, *extra]
    if op is ops.depth_attn_stack.default:
        query, gain, eps, scale, per_source = args
        return ops.depth_attn.default(sources, query, gain, eps, scale * len(sources) if per_source else scale)
    query, gain, conv, phi, bias, alpha, eps, scale, per_source, conv_values, sigmoid_mixer, eps_mix = args
    return ops.msar_mix.default(sources, query, gain, conv, phi, bias, alpha, eps,
                                scale * len(sources) if per_source else scale, conv_values, sigmoid_mixer, eps_mix)


class _SourceStacks:
    """Which sources get a row (:data:`slots`, in row order) and the runner's stack nodes, made as the runner is."""

    def __init__(self, members: list[list[fx.Node]]) -> None:
        from collections import Counter

        prefixes = [self._prefix([n for n in m if _stackable_sources(n) is not None], set(m)) for m in members]
        self.slots: list[fx.Node] = []
        for i in range(max(map(len, prefixes), default=0)):
            votes = Counter(p[i] for p in prefixes if len(p) > i and p[:i] == self.slots[:i])
            pick = max(votes, key=votes.__getitem__, default=None)
            if pick is None or pick in self.slots:
                break
            self.slots.append(pick)
        self.index = {x: i for i, x in enumerate(self.slots)}
        self.rows = [self._fit(p) for p in prefixes]
        filled = 0
        for b, k in enumerate(self.rows):  # rows are appended in block order: a block reading fewer stacks none
            self.rows[b] = k if k >= max(filled, 1) else 0
            filled = max(filled, self.rows[b])
        self.cap = max(self.rows, default=0)
        self.storage: fx.Node | None = None
        self.last: fx.Node | None = None
        self.filled = 0

    @staticmethod
    def _prefix(sites: list[fx.Node], mine: set[fx.Node]) -> list[fx.Node]:
        """The earlier sources all ``sites`` read first, in order (each read from outside the block)."""
        common: list[fx.Node] | None = None
        for n in sites:
            lead = list(itertools.takewhile(
                lambda x: all(isinstance(c, fx.Node) and c not in mine for c in _parts(x)), _stackable_sources(n)))
            common = lead if common is None else common[: _shared(common, lead)]
        return common or []

    def _fit(self, prefix: list[fx.Node]) -> int:
        return _shared(prefix, self.slots)

    def runner_stack(self, out: fx.Graph, env: dict[fx.Node, fx.Node], k: int) -> fx.Node:
        """The runner's stack of the first ``k`` rows (writing the rows not written yet)."""
        if k == self.filled and self.last is not None:
            return self.last
        if self.storage is None:
            first = _parts(self.slots[0])
            self.storage = out.call_function(new_source_storage, (env[first[0]], max(self.cap, k), len(first)))
        self.last = out.call_function(source_stack, (self.last, self.storage,
                                                     *(env[c] for c in _flat_parts(self.slots[self.filled:k]))))
        self.filled = k
        return self.last


def _shared(a: list, b: list) -> int:
    """The length of the common prefix of ``a`` and ``b`` (by identity; a pair by the identity of its nodes)."""
    return sum(1 for _ in itertools.takewhile(lambda xy: _parts(xy[0]) == _parts(xy[1]), zip(a, b)))


def new_source_storage(like: torch.Tensor, rows: int, width: int = 1) -> torch.Tensor:
    """The buffer of one forward's stacked sources: ``rows`` rows shaped like ``like``, or with ``width`` > 1 rows of
    ``width`` such parts (MoDA: a key and a value slot) (uninitialised: a row is read only after it is written)."""
    return like.new_empty((rows, *like.shape) if width == 1 else (rows, width, *like.shape))


def _write_rows(prev: torch.Tensor | None, storage: torch.Tensor, new: tuple,
                own: bool = True) -> tuple[torch.Tensor, int, tuple]:
    """Write ``new`` as the rows after ``prev``'s into ``storage``: ``(stack, start, part shape)``. With ``own`` the
    stack is a tensor of its own over the buffer's first rows, not a view of it: rows written later do not change
    its version, so an op that saved it for backward still finds it valid (its rows never change); without (nothing
    is saved at a no-grad call), a view."""
    start = 0 if prev is None else prev.shape[0]
    width = storage.shape[1] if new and storage.dim() == new[0].dim() + 2 else 1  # parts per row
    part, added = storage.shape[1 + (width > 1):], len(new) // width
    with torch.no_grad():
        flat = storage if width == 1 else storage.view(-1, *part)  # a row's parts in order (MoDA: key, value)
        for j, x in enumerate(new, start=start * width):
            if x.shape != part:  # copy_ would broadcast
                raise DepthRewriteError(
                    f"depthrewrite: a stacked depth source has shape {tuple(x.shape)} where its row holds "
                    f"{tuple(part)} (a bug in the block split: please report it; depthrewrite.blocks.STACK_SOURCES = "
                    "False before converting passes the sources apart)")
            flat[j].copy_(x)
    if not own:
        return storage[: start + added], start, part
    out = torch.empty(0, dtype=storage.dtype, device=storage.device)
    out.set_(storage.untyped_storage(), storage.storage_offset(), (start + added, *storage.shape[1:]), storage.stride())
    return out, start, part


class _SourceStack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, prev: torch.Tensor | None, storage: torch.Tensor, *new: torch.Tensor) -> torch.Tensor:
        out, ctx.start, ctx.part = _write_rows(prev, storage, new)
        ctx.chained = prev is not None
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        return (grad[: ctx.start] if ctx.chained else None), None, *grad[ctx.start:].reshape(-1, *ctx.part).unbind(0)


def source_stack(prev: Any, storage: torch.Tensor, *new: torch.Tensor) -> Any:
    """``prev`` (the stack the previous block read, or None) with the sources ``new`` as its next rows, written into
    ``storage``. While Dynamo traces the runner (the whole model under ``torch.compile``): the sources themselves, a
    list, and each block runs its program with separate sources (:class:`_Listed`), whose depth ops the compile
    backend's passes know; under another tracer or tensor subclass: the same values concatenated."""
    if torch.compiler.is_compiling():
        return [*(prev or ()), *new]
    if type(storage) is not torch.Tensor:
        rows = torch.stack(new).reshape(-1, *storage.shape[1:]) if new else storage[:0]
        return rows if prev is None else torch.cat([prev, rows])
    if not torch.is_grad_enabled():  # a decoding step: no autograd node to record, nothing saved
        return _write_rows(prev, storage, new, own=False)[0]
    return _SourceStack.apply(prev, storage, *new)


class _Listed:
    """A stacked block program's form with every source a separate input, for the whole model traced by Dynamo.
    ``call(block, stack_list, *rest)`` puts the stack's sources back in their places."""

    def __init__(self, gm, path, members, ins, outs, stacked, rest, code) -> None:
        self.module = _program(gm, path, members, ins, outs)  # now: the flat graph changes after the split
        self._fn = code.setdefault(self.module.code, type(self.module).forward)
        where = {c: j for j, c in enumerate(_flat_parts(stacked))}  # the list form: parts in order
        rank = {x: i for i, x in enumerate(rest)}
        self.order = tuple(("row", where[x]) if x in where else ("rest", rank[x]) for x in ins)

    def call(self, block: nn.Module, rows: list, *rest: Any) -> tuple:
        return self._fn(block, *((rows if k == "row" else rest)[i] for k, i in self.order))


def _program(gm: fx.GraphModule, path: str, members: list[fx.Node], ins: list[fx.Node],
             outs: list[fx.Node], stacked: list[fx.Node] = ()) -> fx.GraphModule:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    rows: dict[Any, int] = {x: j for j, x in enumerate(stacked)}
    part: dict[fx.Node, tuple] = {c: (j, i if isinstance(x, tuple) else None)
                                  for j, x in enumerate(stacked) for i, c in enumerate(_parts(x))}
    stack = g.placeholder("in_0") if stacked else None
    for i, x in enumerate(ins, start=1 if stacked else 0):
        p = g.placeholder(f"in_{i}")
        p.meta.update({k: v for k, v in x.meta.items() if k in ("val", "tensor_meta")})
        env[x] = p

    def arg(x: fx.Node) -> fx.Node:
        if x not in env:  # a stacked source read by something else than a depth op: its row (part) of the stack
            j, i = part[x]
            env[x] = g.call_function(torch.ops.aten.select.int, (stack, 0, j))
            if i is not None:
                env[x] = g.call_function(torch.ops.aten.select.int, (env[x], 0, i))
        return env[x]

    cut = len(path) + 1
    root: dict[str, Any] = {}
    for n in members:
        if n.op == "get_attr":
            rel = n.target[cut:]
            new = g.get_attr(rel)
            new.meta = dict(n.meta)
            root[rel] = _shell(resolve_target(gm, n.target))
        elif n.op == "call_module":  # a called module of the block: resolved on the block (self) at call time
            if not n.target.startswith(path + "."):
                raise DepthRewriteError(f"depthrewrite: block {path!r} calls {n.target!r}, which it does not hold "
                                        "(a bug in the module-call lowering: please report it)")
            rel = n.target[cut:]
            new = g.node_copy(n, arg)
            new.target = rel
            root[rel] = nn.Module()  # a stand-in: the program's code reads self.<rel> from the live block
        elif stacked and _stack_rows(n, rows) == len(stacked):
            new = _stacked_site(g, n, stack, len(stacked), arg)
        else:
            new = g.node_copy(n, arg)
        env[n] = new
    g.output(tuple(_own_output(g, env[o]) for o in outs))
    # names by position, so blocks of the same structure get the same code (torch.compile per block reuses it)
    for i, n in enumerate(g.nodes):
        if n.op in ("call_function", "call_method", "call_module"):
            n._rename(f"v{i}")
    g.lint()
    return _traced_with_meta(fx.GraphModule(root, g, class_name="BlockProgram"))


def _traced_with_meta(gm: fx.GraphModule) -> fx.GraphModule:
    """Let Dynamo copy ``gm``'s node metadata (the scheme tags the compile backend recognises a converted graph by)
    into the graph it traces from ``gm``'s generated code, as ``torch.compile(gm)`` arranges for a GraphModule."""
    try:
        import weakref

        from torch._dynamo import code_context

        code_context.get_context(type(gm).forward.__code__)["orig_graphmodule"] = weakref.ref(gm)
    except Exception:  # noqa: BLE001 - a Dynamo without it: only the tags are lost
        pass
    return gm


def traced_with_meta(runner: fx.GraphModule) -> None:
    """:func:`_traced_with_meta` for a runner and its programs, when Dynamo has forgotten them
    (``torch._dynamo.reset()`` clears its code contexts); one lookup otherwise (it runs before every compiled call)."""
    try:
        from torch._dynamo import code_context

        if "orig_graphmodule" in code_context.get_context(type(runner).forward.__code__):
            return
    except Exception:  # noqa: BLE001
        return
    _traced_with_meta(runner)
    for prog in runner.programs.values():
        _traced_with_meta(prog.module)
        if prog.listed is not None:
            _traced_with_meta(prog.listed.module)


def _shell(v: Any) -> Any:
    """What a program keeps of a tensor it reads from its block: shape and dtype only (the code reads the live block;
    holding the capture's tensor would keep replaced or FSDP-sharded weights, or a capture's stand-ins, alive)."""
    if isinstance(v, torch.Tensor):
        meta = torch.empty(v.shape, dtype=v.dtype, device="meta")
        return nn.Parameter(meta, requires_grad=False) if isinstance(v, nn.Parameter) else meta
    return v


def live_target(model: nn.Module) -> Callable[[str], bool]:
    """Whether a ``get_attr`` target names an attribute of the live ``model`` (through wrappers)."""

    def live(target: str) -> bool:
        obj: Any = model
        for part in target.split("."):
            obj = getattr(unwrap(obj) if isinstance(obj, nn.Module) else obj, part, None)
            if obj is None:
                return False
        return True

    return live


def stage_with_blocks(stage: fx.GraphModule, model: nn.Module, paths: tuple[str, ...],
                      checkpoint: Callable[[nn.Module], bool]) -> fx.GraphModule:
    """A pipeline stage module (:func:`depthrewrite.pipeline.stages`) that calls the block modules at ``paths``
    (blocks wholly inside the stage) instead of inlining them: the stage holds the same block objects, under their
    original names, as the converted model, and runs their programs. The stage itself when it cannot be split."""
    if not paths:
        return stage
    split = split_blocks(stage, paths, checkpoint, live_target(model))
    if isinstance(split, str):
        return stage
    root: dict[str, Any] = {}
    for n in split.graph.nodes:
        if n.op == "get_attr":
            root[n.target] = split.attrs[n.target] if n.target in split.attrs else resolve_target(stage, n.target)
        elif n.op == "call_module":
            root[n.target] = _slot(model, n.target)  # a checkpoint or compile wrapper around the block runs too
    out = fx.GraphModule(root, split.graph, class_name=type(stage).__name__)
    out.__dict__["_dr_programs"] = split.programs
    return out


def read_live(gm: fx.GraphModule, model: nn.Module) -> None:
    """Make ``gm`` read every submodule, parameter and buffer that the live ``model`` has from the model, at call
    time (:meth:`~depthrewrite.converted.ConvertedGraphModule.__getattr__`): its own copies of them (export's
    unlifted module tree) are dropped, so it keeps no replaced, sharded or stand-in tensor alive; what only it has
    (export's lifted constants, higher-order ops' bodies) stays."""
    for k in [k for k in gm._modules if k in model._modules]:
        del gm._modules[k]
    own = (model._modules, model._parameters, model._buffers)
    for d in (gm._parameters, gm._buffers):
        for k in [k for k in d if any(k in x for x in own)]:
            del d[k]
    gm.__dict__["_dr_live"] = model


def share_live(gm: fx.GraphModule, model: nn.Module) -> None:
    """Make the flat graph ``gm`` hold the live model's own top-level submodules, parameters and buffers in place of
    export's copies of them: it keeps no replaced, sharded or stand-in tensor alive, reads what the model holds now,
    and stays an ordinary module (``parameters()``, ``state_dict()``, ``torch.export`` of it see the model's
    parameters)."""
    for k in [k for k in gm._modules if k in model._modules]:
        gm._modules[k] = model._modules[k]
    for mine, theirs in ((gm._parameters, model._parameters), (gm._buffers, model._buffers)):
        for k in [k for k in mine if k in theirs]:
            mine[k] = theirs[k]


class _ChainModule:
    """The module that holds the residual chain (HF's ``LlamaModel`` under ``LlamaForCausalLM``), for the runner's
    :func:`enter_module` / :func:`exit_module` nodes: a plain object, not a submodule (the runner would otherwise
    hold it, and a global hook would see a call of it)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module


@torch.fx.wrap
def enter_module(ref: _ChainModule) -> None:
    """Where the module holding the chain starts in the runner: the global forward pre-hooks (FlopCounterMode,
    ModuleTracker) run for it as when the original calls it (its inputs are keywords, which such hooks do not
    get). Nothing under a compiler."""
    pre = torch.nn.modules.module._global_forward_pre_hooks
    if not pre or torch.compiler.is_compiling():
        return
    for h in list(pre.values()):
        if h(ref.module, ()) is not None:
            raise _hook_changed_io(ref.module, "inputs")


@torch.fx.wrap
def exit_module(ref: _ChainModule, output: Any) -> None:
    """Where the module holding the chain ends (its last operation, the final norm's call): the global forward
    hooks run for it with that output."""
    post = torch.nn.modules.module._global_forward_hooks
    if not post or torch.compiler.is_compiling():
        return
    for h in list(post.values()):
        if h(ref.module, (), output) is not None:
            raise _hook_changed_io(ref.module, "output")


def _hook_changed_io(module: nn.Module, what: str) -> Exception:
    from .errors import ModuleTreeChangedError

    return ModuleTreeChangedError(
        f"a global module hook returned new {what} for {type(module).__name__}, the module that holds the residual "
        "chain: a converted model computes that module as its graphs, so it cannot take them. Register the hook on a "
        "module inside the blocks, or on the converted model itself.", module=None, change="global hook",
    )


def _mark_chain_modules(graph: fx.Graph, model: nn.Module, paths: tuple[str, ...], attrs: dict[str, Any]) -> None:
    """Put :func:`enter_module` before the first and :func:`exit_module` after the last node of each module above
    the blocks (not the root, which the caller calls itself, nor a container): their computation is the runner's
    glue, so a global module hook would otherwise never see them, as it does in the original."""
    if not paths:
        return
    parts = paths[0].split(".")
    chain = [p for p in (".".join(parts[:i]) for i in range(1, len(parts)))
             if all(q.startswith(p + ".") for q in paths) and not isinstance(get_path(model, p), _CONTAINERS)]
    nodes = list(graph.nodes)
    for i, path in enumerate(chain):
        inside = [n for n in nodes if (n.op == "call_module" and str(n.target).startswith(path + "."))
                  or any(isinstance(v, tuple) and v and v[0] == path
                         for v in (n.meta.get("nn_module_stack") or {}).values())]
        mod = get_path(model, path)
        if not inside or mod is None:
            continue
        name = f"_dr_chain_{i}"
        attrs[name] = _ChainModule(mod)
        with graph.inserting_before(inside[0]):
            ref = graph.get_attr(name)
            graph.call_function(enter_module, (ref,))
        with graph.inserting_after(inside[-1]):
            graph.call_function(exit_module, (ref, inside[-1]))


def build_runner(gm: fx.GraphModule, model: nn.Module, paths: tuple[str, ...],
                 checkpoint: Callable[[nn.Module], bool]) -> tuple[fx.GraphModule | None, str | None]:
    """``(runner, None)``: a module running ``gm``'s graph (a converted model's flat graph) as glue plus one call per
    block module of ``model`` at ``paths``; or ``(None, reason)`` when it cannot be split. The runner keeps only what
    the live model lacks (export's lifted constants, the programs); every other attribute it reads is the live
    model's (:meth:`~depthrewrite.converted.ConvertedGraphModule.__getattr__`), read at call time."""
    live = live_target(model)
    lowered = gm.meta.pop(_LOWERED, None)  # convert(..., module_calls=True)
    split = split_blocks(gm, paths, checkpoint, live, graph=lowered[0] if lowered is not None else None)
    if isinstance(split, str):
        return None, split
    root: dict[str, Any] = {}
    _mark_chain_modules(split.graph, model, paths, split.attrs)
    consts = 0
    for n in split.graph.nodes:
        if n.op == "get_attr" and n.target not in split.attrs and not live(n.target):
            value = resolve_target(gm, n.target)  # export's lifted constants: kept by the runner under a name of its own
            n.target = f"_dr_const_{consts}"
            consts += 1
            split.attrs[n.target] = value
        if n.op == "get_attr":
            root[n.target] = split.attrs[n.target] if n.target in split.attrs else resolve_target(gm, n.target)
        elif n.op == "call_module":
            root[n.target] = get_path(model, n.target)  # blocks and called modules: read from the live model
    runner = _traced_with_meta(fx.GraphModule(root, split.graph, class_name=type(gm).__name__))
    read_live(runner, model)  # the blocks and all else the model has are read from it; export's constants stay
    for a in ("_in_spec", "_out_spec", "range_constraints", "validate_inputs"):  # export's code and checks read them
        if a in gm.__dict__:
            runner.__dict__[a] = gm.__dict__[a]
    runner.meta.update(gm.meta)
    if lowered is not None:
        runner.meta["depthrewrite_module_calls"] = {"called": tuple(lowered[1]), "inlined": tuple(lowered[2])}
    runner.__dict__["_dr_programs"] = split.programs
    from .converted import bind_graph_inputs

    for k, h in gm._forward_pre_hooks.items():  # export's input checks (the runner's placeholders are gm's)
        if h is not bind_graph_inputs:
            runner.register_forward_pre_hook(h, with_kwargs=k in gm._forward_pre_hooks_with_kwargs)
    return runner, None


def hf_checkpointing_drops_cache(model: nn.Module) -> bool:
    """Whether HF's activation checkpointing turns the KV cache off in a call of ``model`` now: training, with
    gradients, and a module's ``gradient_checkpointing`` flag on (transformers' ``GradientCheckpointingLayer`` then
    passes ``use_cache=False, cache=None`` to its layers and ``merge_with_config_defaults`` sets ``use_cache=False``,
    so the original returns no cache). :func:`blocks_for_capture` turns those flags off while capturing, so a capture
    that should follow the original must be told (capture without the cache when this is True)."""
    if not (model.training and torch.is_grad_enabled()):
        return False
    return any(m.__dict__.get("gradient_checkpointing") is True for m in model.modules())


def _stand_in_buffer(v: torch.Tensor) -> torch.Tensor:
    """A plain tensor for a DTensor buffer while capturing: its local values where every rank holds the whole tensor
    (replicated), else zeros of its full shape (a capture reads shapes; the graph reads it only inside a module
    called live)."""
    if all(p.is_replicate() for p in v.placements):
        return v.to_local().detach().clone()
    return torch.zeros(v.shape, dtype=v.dtype, device=v.device)


@contextlib.contextmanager
def blocks_for_capture(model: nn.Module, paths: tuple[str, ...] | None) -> Iterator[None]:
    """While capturing: every block at ``paths`` is its original class in its container slot (wrappers such as
    ``checkpoint_wrapper`` or ``torch.compile``'s taken out), without the hooks that fire at run time around the
    block call (FSDP2's, a user's; transformers' output-recording hooks stay: they are traced), not compiled; every
    activation-checkpointing flag is off (the captured graph is plain; blocks are checkpointed at run time); and
    FSDP2-sharded parameters are stood in for by zeros of their full shape (a capture reads shapes only; the check
    capture runs compares like with like), DTensor buffers by :func:`_stand_in_buffer`. Everything is put back
    after."""
    undo: list[Callable[[], None]] = []
    try:
        for p in paths or ():
            parent_path, _, name = p.rpartition(".")
            parent = get_path(model, parent_path)
            if parent is None or name not in parent._modules:
                continue
            slot = parent._modules[name]
            blk = unwrap(slot)
            if slot is not blk:
                parent._modules[name] = blk
                undo.append(lambda d=parent._modules, k=name, v=slot: d.__setitem__(k, v))
            if isinstance(blk, ConvertedBlock):
                cls = type(blk)
                blk.__class__ = original_block_class(cls)
                undo.append(lambda m=blk, c=cls: setattr(m, "__class__", c))
                own = blk.__dict__.get("forward")
                if "_old_forward" in blk.__dict__:  # accelerate's hook: what it calls runs the original forward now
                    new = blk.__dict__["_old_forward"]
                    blk.__dict__["_old_forward"] = types.MethodType(original_block_class(cls).forward, blk)
                    undo.append(lambda m=blk, f=new: m.__dict__.__setitem__("_old_forward", f))
                elif own is not None and getattr(own, "__func__", None) is getattr(cls, "forward", None):
                    del blk.__dict__["forward"]  # a hook removed again left the converted forward on the instance
                    undo.append(lambda m=blk, f=own: m.__dict__.__setitem__("forward", f))
            take_hooks_out(blk, undo)
            if blk.__dict__.get("_compiled_call_impl") is not None:
                impl = blk.__dict__["_compiled_call_impl"]
                blk.__dict__["_compiled_call_impl"] = None
                undo.append(lambda m=blk, f=impl: m.__dict__.__setitem__("_compiled_call_impl", f))
        for m in model.modules():
            if m.__dict__.get("gradient_checkpointing") is True:
                m.__dict__["gradient_checkpointing"] = False
                undo.append(lambda m=m: m.__dict__.__setitem__("gradient_checkpointing", True))
            for k, v in list(m._parameters.items()):
                if v is not None and is_dtensor(v):
                    m._parameters[k] = nn.Parameter(torch.zeros(v.shape, dtype=v.dtype, device=v.device),
                                                    requires_grad=v.requires_grad)
                    undo.append(lambda d=m._parameters, k=k, v=v: d.__setitem__(k, v))
            for k, v in list(m._buffers.items()):  # torchtitan's parallelize makes its RoPE cache a replicated DTensor
                if v is not None and is_dtensor(v):
                    m._buffers[k] = _stand_in_buffer(v)
                    undo.append(lambda d=m._buffers, k=k, v=v: d.__setitem__(k, v))
        yield
    finally:
        for u in reversed(undo):
            u()


# ---- what the report shows ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockInfo:
    """One block module as the runner calls it: its sublayers and what crosses into and out of it (per token: the
    product of the dimensions other than batch and sequence, at the capture's shapes)."""

    path: str
    sublayers: tuple[int, ...]
    state_in: tuple[tuple[str, int], ...]  # (node, values per token): depth state from earlier blocks / the embedding
    side_in: tuple[str, ...]  # other inputs computed once at the top (RoPE tables, masks, sizes)
    params_in: int  # new parameters of its sites, passed in from model.depthrewrite
    state_out: tuple[tuple[str, int], ...]
    code: int = 0  # which distinct program code it runs (blocks with the same number share one compiled function)

    @property
    def state_in_per_token(self) -> int:
        return sum(v for _, v in self.state_in)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _numels(gm: fx.GraphModule, wanted: set[str]) -> dict[str, int]:
    """Element counts of the ``wanted`` nodes of ``gm`` on the inputs it was captured with (one forward without
    gradients: the rewrite's own nodes carry no shapes in their metadata)."""
    import torch.fx._pytree as fx_pytree

    out: dict[str, int] = {}

    class _Record(fx.Interpreter):
        def run_node(self, n):
            r = super().run_node(n)
            if n.name in wanted and isinstance(r, torch.Tensor):
                out[n.name] = r.numel()
            return r

    args, kwargs = gm.meta["depthrewrite_inputs"]
    flat = fx_pytree.tree_flatten_spec((tuple(args), dict(kwargs)), gm._in_spec)
    with torch.no_grad():
        _Record(gm).run(*flat)
    return out


def block_infos(gm: fx.GraphModule, programs: dict[str, BlockProgram], site_blocks: tuple[int, ...] | None,
                source: str) -> tuple[BlockInfo, ...]:
    """The report's block table for a runner made from ``gm`` (the flat graph; run once on its capture inputs)."""
    by_name = {n.name: n for n in gm.graph.nodes}
    derived: set[fx.Node] = set()  # computed from the stream source: the depth state and what is made of it
    for n in gm.graph.nodes:
        if n.name == source or any(x in derived for x in n.all_input_nodes):
            derived.add(n)
    wanted = {source} | {x for p in programs.values() for x in (*p.inputs, *p.outputs)}
    try:
        numel = _numels(gm, wanted)
    except Exception:  # noqa: BLE001 - the table is informative; a failure leaves its sizes at 0
        numel = {}
    v0 = by_name[source].meta.get("val")
    d = int(v0.shape[-1]) if isinstance(v0, torch.Tensor) and isinstance(v0.shape[-1], int) else 1
    tokens = max(1, numel.get(source, 0) // d)
    out = []
    codes: dict[int, int] = {}
    for b, prog in enumerate(programs.values()):
        state, side, params = [], [], 0
        for name in prog.inputs:
            n = by_name[name]
            if n.op == "get_attr":
                params += 1
            elif n in derived and name in numel:
                state.append((name, numel[name] // tokens))
            else:
                side.append(name)
        outs = tuple((name, numel.get(name, 0) // tokens) for name in prog.outputs)
        sites = tuple(k for k, blk in enumerate(site_blocks or ()) if blk == b)
        out.append(BlockInfo(prog.path, sites, tuple(state), tuple(side), params, outs,
                             codes.setdefault(id(prog.fn), len(codes))))
    return tuple(out)


def block_table(infos: tuple[BlockInfo, ...], hidden: int, cuts: tuple[int, ...] | None = None) -> str:
    """The report's block table; with pipeline ``cuts`` (sublayer indices where stages begin) a stage column, and
    a block a cut divides is marked."""
    from tabulate import tabulate

    def stage(i: BlockInfo) -> str:
        if not i.sublayers:
            return "-"
        first, last = (sum(c <= k for c in cuts) for k in (i.sublayers[0], i.sublayers[-1]))
        return str(first) if first == last else f"{first}-{last} (cut inside)"

    rows = [[i.path, ",".join(map(str, i.sublayers)), *([stage(i)] if cuts else []), len(i.state_in),
             f"{i.state_in_per_token:,} ({i.state_in_per_token / hidden:.1f}·d)", len(i.side_in), i.params_in,
             len(i.state_out), i.code] for i in infos]
    headers = ["block", "sublayers", *(["stage"] if cuts else []), "state in", "values/token", "side in", "params in",
               "out", "code"]
    return ("blocks (one module call each; what crosses into it: depth state from earlier blocks, side inputs "
            "computed once, new parameters; code: blocks with one number share one function, compiled once):\n"
            + tabulate(rows, headers=headers, tablefmt="simple"))
