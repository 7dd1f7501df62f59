"""Training at scale, per block: activation memory with checkpointing, and torch.compile whole-model vs per block.

    python -m bench.training memory  [--configs zoo issue issue-nocache] [--layers 16 32] [--hidden 256] [--seq 256]
    python -m bench.training memory  --breakdown [--configs issue]       # what each saved tensor is, largest first
    python -m bench.training memory  --sources apart stacked              # blocks' earlier sources apart vs stacked
    python -m bench.training compile [--layers 4] [--hidden 256] [--seq 256] [--batch 2] [--sources stacked apart]
                                     [--modes whole "per block"] [--opaque] [--schemes KEY|LABEL ...]
    python -m bench.training recompile [--layers 16 64] [--hidden 64] [--seq 64]   # per-block compile, default limit

``memory``: bytes autograd saves for backward in one training step (``loss = model(ids, labels=ids).loss``),
counted with ``torch.autograd.graph.saved_tensors_hooks`` (deterministic, no timing noise), for the original Llama
and every scheme, without and with activation checkpointing (HF's ``activation_checkpointing_enable()``: the
converted model calls its blocks as modules, so the same switch recomputes each block in backward). Counted: every
storage a saved tensor uses plus the inputs of every block call (a checkpointed block keeps its inputs to recompute
itself; autograd's hooks do not see those), each storage once however often it is saved (a block summary that every
later block reads is one tensor); parameters are not counted (they are kept anyway). Separately ("returned"): the
storages the step's output holds beyond those (a returned KV cache, alive while a training loop keeps the output).

One row group per model config (:data:`CONFIGS`): ``zoo`` is the zoo's Llama (head_dim 16, no KV cache in its
config), ``issue`` a Llama with head_dim 32 whose config turns the KV cache on (as ``transformers.LlamaConfig`` does
by default), ``issue-nocache`` the same with the cache off. ``--breakdown`` prints, per config and model (with
checkpointing), the counted storages grouped by what kept them: the op that saved them (with the line of the block
program or runner that ran it) or the block call they are an input of, with their shapes.

``compile``: ``torch.compile`` of the whole model (the converted one with ``backend="depthrewrite"``) against
``.compile()`` on each block module, for the original and every scheme: the first training step (compile included)
and the best of 5 later steps, every row in the same run; Dynamo is reset between rows and inductor's caches are off
(every compile is cold).
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import time
from datetime import date

import torch

import depthrewrite as dr
from depthrewrite.demo.zoo import hf_model


def _variants() -> list[tuple[str, str | None, dict]]:
    out: list[tuple[str, str | None, dict]] = [("original", None, {})]
    for rec in dr.schemes().values():
        for v in rec.variants:
            out.append((v.label, rec.name, dict(v.options)))
    return out


#: model configs of the memory table: the zoo's Llama (``hf_model("llama", hidden=d)``: d/16 heads of 16, half as many
#: KV heads, intermediate 2d, vocab 256, ``use_cache`` off) with overrides. ``issue`` is the config the 1.75x report came
#: from (HF Llama, hidden 128, 4 heads of 32, 2 KV heads, intermediate 256, 8 layers, sequence 128) with its
#: config's KV cache on, as ``transformers.LlamaConfig`` defaults to (a training call then returns a cache and
#: captures a cached graph); ``issue-nocache`` the same with it off.
CONFIGS: dict[str, dict] = {
    "zoo": dict(layers=(16, 32), hidden=256, seq=256, overrides={}),
    "issue": dict(layers=(8,), hidden=128, seq=128, overrides=dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256, use_cache=True)),
    "issue-nocache": dict(layers=(8,), hidden=128, seq=128, overrides=dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256, use_cache=False)),
}


def _build(layers: int, hidden: int, seq: int, key: str | None, options: dict,
           overrides: dict | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = hf_model("llama", layers=layers, hidden=hidden, max_position_embeddings=seq + 8,
                     attention_dropout=0.0, **(overrides or {})).train()
    if key is None:
        return model
    ids = torch.randint(3, model.config.vocab_size, (1, seq))
    return dr.convert(model, key, example_inputs=(ids,), **options)


def _tensors(obj, depth: int = 0):
    """The tensors an output holds: its fields, and a KV cache's per-layer keys and values."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, depth + 1)
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v, depth + 1)
    elif depth < 4 and hasattr(obj, "layers"):  # transformers' Cache
        for layer in obj.layers:
            for name in ("keys", "values"):
                yield from _tensors(getattr(layer, name, None), depth + 1)


def _program_line() -> str:
    """The line of generated FX code (a block program, the runner) running now, for the breakdown."""
    import linecache
    import sys

    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith("<eval_with_key"):
            return linecache.getline(name, f.f_lineno).strip()
        f = f.f_back
    return ""


def saved_bytes(model: torch.nn.Module, ids: torch.Tensor, breakdown: list | None = None) -> int:
    """Bytes saved for backward by one ``model(ids, labels=ids).loss`` (warmed up first: captures happen there).
    ``breakdown``: a list that gets one ``(bytes, shape, dtype, kind, what)`` per storage counted (kind ``"saved"``: what
    = the op and program line that saved it; ``"block input"``: what = the block's path), then the storages the output
    holds beyond those (kind ``"returned"``)."""
    return step_bytes(model, ids, breakdown)[0]


def step_bytes(model: torch.nn.Module, ids: torch.Tensor, breakdown: list | None = None) -> tuple[int, int]:
    """``(saved, returned)``: :func:`saved_bytes`, and the bytes of the storages the step's output holds beyond the
    saved ones (a returned KV cache; parameters not counted)."""
    from torch.overrides import TorchFunctionMode

    model(ids, labels=ids).loss.backward()
    storages: dict[tuple, int] = {}
    params = {(p.untyped_storage().data_ptr(), p.device) for p in model.parameters()}
    current: list[str] = []

    class _Op(TorchFunctionMode):  # which op is saving (only while a breakdown is asked for)
        def __torch_function__(self, func, types, args=(), kwargs=None):
            current.append(str(getattr(func, "__name__", func)))
            try:
                return func(*args, **(kwargs or {}))
            finally:
                current.pop()

    def count(t, kind: str, what) -> bool:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return False
        s = t.untyped_storage()
        key = (s.data_ptr(), t.device)
        if key in params or key in storages:  # parameters exist anyway: activations only
            return False
        storages[key] = s.nbytes()
        if breakdown is not None:
            breakdown.append((s.nbytes(), tuple(t.shape), str(t.dtype).replace("torch.", ""), kind, what()))
        return True

    def keep(t):
        count(t, "saved", lambda: f"{current[-1] if current else '?'}  {_program_line()}".strip())
        return t

    def block_inputs(module, args):  # what a checkpointed block keeps to recompute itself (its inputs)
        path = getattr(args[0], "path", type(module).__name__) if args else type(module).__name__
        for a in args:
            count(a, "block input", lambda: path)

    hooks = [blk.register_forward_pre_hook(block_inputs) for blk in model.model.layers]
    mode = _Op() if breakdown is not None else contextlib.nullcontext()
    try:
        with mode, torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            out = model(ids, labels=ids)
    finally:
        for h in hooks:
            h.remove()
    saved = sum(storages.values())
    returned = 0
    for t in _tensors(out):
        if count(t, "returned", lambda: "the step's output"):
            returned += t.untyped_storage().nbytes()
    out.loss.backward()
    del out
    model.zero_grad(set_to_none=True)
    return saved, returned


def _configs(names: list[str] | None, layers: tuple[int, ...] | None, hidden: int | None,
             seq: int | None) -> list[tuple[str, int, int, int, dict]]:
    out = []
    for name in names or ["zoo", "issue"]:
        c = CONFIGS[name]
        for L in layers or c["layers"]:
            out.append((name, L, hidden or c["hidden"], seq or c["seq"], c["overrides"]))
    return out


def memory_rows(layers: tuple[int, ...] | None = None, hidden: int | None = None, seq: int | None = None,
                configs: list[str] | None = None, schemes: list[str] | None = None,
                sources: tuple[str, ...] = ("stacked",)) -> list[list]:
    """One row per config, model and way of passing the blocks' earlier depth sources (``sources``: "stacked", the
    default, one buffer; "apart", ``blocks.STACK_SOURCES = False``); the original's row once per config."""
    from unittest import mock

    from depthrewrite import blocks

    rows = []
    for name, L, d, T, overrides in _configs(configs, layers, hidden, seq):
        base = {}
        for (label, key, options), how in [(v, s) for v in _variants() for s in (sources if v[1] else ("-",))]:
            if schemes and key is not None and key not in schemes and label not in schemes:
                continue
            with mock.patch.object(blocks, "STACK_SOURCES", how != "apart"):  # read when a graph is captured
                model = _build(L, d, T, key, options, overrides)
                ids = torch.randint(3, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(1))
                plain, _ = step_bytes(model, ids)
                model.activation_checkpointing_enable()
                ckpt, returned = step_bytes(model, ids)
            if key is None:
                base = dict(plain=plain, ckpt=ckpt)
            rows.append([name, L, label, *([how] if len(sources) > 1 else []), f"{plain / 2**20:.2f}",
                         f"{plain / base['plain']:.2f}", f"{ckpt / 2**20:.2f}", f"{ckpt / base['ckpt']:.2f}",
                         f"{returned / 2**20:.2f}"])
            print(*rows[-1], flush=True)
    return rows


def memory_breakdown(layers: tuple[int, ...] | None = None, hidden: int | None = None, seq: int | None = None,
                     configs: list[str] | None = None, schemes: list[str] | None = None, top: int = 12) -> str:
    """Per config and model, with checkpointing: the counted storages grouped by (kind, op or block, shape, dtype)."""
    import collections

    lines = []
    for name, L, d, T, overrides in _configs(configs, layers, hidden, seq):
        for label, key, options in _variants():
            if key is not None and (key not in (schemes or ["block-attnres", "block-msar"])
                                    and label not in (schemes or ())):
                continue
            model = _build(L, d, T, key, options, overrides)
            ids = torch.randint(3, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(1))
            model.activation_checkpointing_enable()
            rows: list = []
            saved, returned = step_bytes(model, ids, rows)
            groups: dict = collections.defaultdict(lambda: [0, 0, ""])
            for nbytes, shape, dtype, kind, what in rows:
                op = what.split("  ")[0] if kind == "saved" else ("block call" if kind == "block input" else what)
                g = groups[(kind, op, shape, dtype)]
                g[0] += nbytes
                g[1] += 1
                g[2] = g[2] or what
            lines.append(f"{name}, {L} layers, {label}, ckpt: {saved / 2**20:.3f} MiB saved + block inputs in "
                         f"{sum(k != 'returned' for *_, k, _ in rows)} storages; {returned / 2**20:.3f} MiB returned")
            for (kind, op, shape, dtype), (nbytes, n, what) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
                example = f"  e.g. {what[:100]}" if kind == "saved" and "  " in what else ""
                lines.append(f"  {nbytes / 2**20:8.3f} MiB  {n:3d} x {kind:11s} {op:28s} {str(list(shape)):16s} "
                             f"{dtype}{example}")
    return "\n".join(lines)


def _step(model: torch.nn.Module, ids: torch.Tensor) -> float:
    t = time.perf_counter()
    model(ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t


def compile_rows(layers: int, hidden: int, seq: int, batch: int, repeats: int = 5, schemes: list[str] | None = None,
                 apart: bool = False, opaque: bool = False, modes: tuple[str, ...] = ("whole", "per block")) -> list[list]:
    """Whole model and/or per block (``modes``), every variant (``schemes``: only these, and the original); ``apart``:
    also per block with the blocks' earlier depth sources as separate inputs (``blocks.STACK_SOURCES = False``);
    ``opaque``: also per block with the depth ops kept opaque (backend option ``decompose=False``: inductor calls
    the op instead of generating code for its reference); all in the same run. ``graphs``: the graphs Dynamo
    compiled in the first step (each one AOT-traced and code-generated forward and backward)."""
    from unittest import mock

    import torch._dynamo

    import torch._inductor.config
    from torch._dynamo.utils import counters

    from depthrewrite import blocks

    torch._dynamo.config.recompile_limit = max(64, torch._dynamo.config.recompile_limit)  # one variant per program
    torch._inductor.config.force_disable_caches = True  # cold compiles: no FX graph or kernel cache from earlier runs
    torch.compile(lambda x: (x * 2).sum())(torch.randn(4))  # inductor's one-time start-up, outside every row
    rows = []
    base: dict[str, float] = {}
    for label, key, options in _variants():
        if schemes and key is not None and key not in schemes and label not in schemes:
            continue
        hows = [m for m in ("whole", "per block") if m in modes]
        hows += [f"per block, {x}" for x, on in (("sources apart", apart), ("depth ops opaque", opaque))
                 if on and key is not None]
        for how in hows:
            torch._dynamo.reset()
            counters.clear()
            with mock.patch.object(blocks, "STACK_SOURCES", not how.endswith("apart")):  # read at capture
                model = _build(layers, hidden, seq, key, options)
                ids = torch.randint(3, model.config.vocab_size, (batch, seq),
                                    generator=torch.Generator().manual_seed(1))
                if key is not None:
                    _step(model, ids)  # capture the training graph outside the timing
            backend = "inductor" if key is None else "depthrewrite"
            kw = {"options": {"decompose": False}} if how.endswith("opaque") else {}
            if how == "whole":
                run = torch.compile(model, backend=backend)
            else:
                for blk in model.model.layers:
                    blk.compile(backend=backend, **kw)
                run = model
            first = _step(run, ids)
            graphs = counters["stats"]["unique_graphs"]
            best = min(_step(run, ids) for _ in range(repeats))
            if key is None:
                base[how] = best
            rows.append([label, how, graphs, f"{first:.1f}", f"{1e3 * best:.1f}",
                         f"{best / base[how.split(',')[0]]:.2f}"])
            print(*rows[-1], flush=True)
    return rows


def recompile_rows(layers: tuple[int, ...], hidden: int, seq: int, batch: int, backend: str = "eager") -> list[list]:
    """Per-block compile (each block's ``.compile()``) at Dynamo's default ``recompile_limit``: the original, Full and
    Block AttnRes and MoDA with their blocks' earlier depth sources (MoDA: slots) as separate inputs
    (``blocks.STACK_SOURCES = False``: each block reads more than the one before, so each is a program of its own) and
    as one stacked tensor (the default: one program for blocks that differ only in that count), and mHC (blocks of
    one kind already): distinct programs, graphs compiled, whether the limit was hit, and the first training step
    (compile included) against the original's."""
    import logging
    from unittest import mock

    import torch._dynamo
    from torch._dynamo.utils import counters

    from depthrewrite import blocks

    variants = [("original", None, "-"), ("Full AttnRes", "attnres", "apart"), ("Full AttnRes", "attnres", "stacked"),
                ("Block AttnRes (4 blocks)", "block-attnres", "apart"),
                ("Block AttnRes (4 blocks)", "block-attnres", "stacked"), ("mHC (n=4)", "mhc", "-"),
                ("MoDA (paper, λ≡1)", "moda", "apart"), ("MoDA (paper, λ≡1)", "moda", "stacked")]
    rows = []
    for n in layers:
        base = None
        for label, key, sources in variants:
            torch._dynamo.reset()
            counters.clear()
            with mock.patch.object(blocks, "STACK_SOURCES", sources != "apart"):
                model = _build(n, hidden, seq, key, {})
                ids = torch.randint(3, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
                _step(model, ids)  # capture the training graph outside the timing
            programs = 1
            if key is not None:
                used = max(model.__dict__["_depthrewrite"].entries(), key=lambda e: e.calls)  # the step's graph
                programs = len({p.fn for p in used.runner.programs.values()})
            for blk in model.model.layers:
                blk.compile(backend=backend)
            seen: list[str] = []
            handler = logging.Handler()
            handler.emit = lambda record: seen.append(record.getMessage())
            dynamo_log = logging.getLogger("torch._dynamo")
            dynamo_log.addHandler(handler)
            try:
                first = _step(model, ids)
            finally:
                dynamo_log.removeHandler(handler)
            base = first if key is None else base
            hit = any("recompile_limit" in m for m in seen)
            rows.append([n, label, sources, programs, counters["stats"]["unique_graphs"], "yes" if hit else "no",
                         f"{first:.1f}", f"{first / base:.2f}"])
            print(*rows[-1], flush=True)
    return rows


def main() -> None:
    from tabulate import tabulate

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("memory", "compile", "recompile"))
    p.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=None,
                   help="memory: the model configs (default: zoo issue)")
    p.add_argument("--schemes", nargs="+", default=None,
                   help="memory, compile: only these variants (keys or labels) and the original")
    p.add_argument("--breakdown", action="store_true", help="memory: what the saved tensors are, per model")
    p.add_argument("--sources", nargs="+", choices=("stacked", "apart"), default=["stacked"],
                   help="memory: the blocks' earlier depth sources in one buffer (default) and/or apart; compile: "
                        "'apart' adds per-block rows with them apart")
    p.add_argument("--modes", nargs="+", choices=("whole", "per block"), default=["whole", "per block"],
                   help="compile: torch.compile of the whole model and/or .compile() on each block")
    p.add_argument("--opaque", action="store_true",
                   help="compile: add per-block rows with the depth ops opaque (backend option decompose=False)")
    p.add_argument("--layers", type=int, nargs="+", default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    import transformers

    head = (f"{date.today()}, {platform.machine()} {platform.processor() or ''}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, {a.threads} thread(s)")
    if a.what == "memory":
        layers = tuple(a.layers) if a.layers else None
        if a.breakdown:
            print(memory_breakdown(layers, a.hidden, a.seq, a.configs, a.schemes))
            return
        rows = memory_rows(layers, a.hidden, a.seq, a.configs, a.schemes, tuple(a.sources))
        print(head)
        print(tabulate(rows, headers=["config", "layers", "model"] + (["sources"] if len(a.sources) > 1 else []) + [
                                      "MiB saved", "ratio", "MiB saved, ckpt",
                                      "ratio, ckpt", "MiB returned, ckpt"], tablefmt="github"))
    elif a.what == "recompile":
        hidden, seq = a.hidden or 64, a.seq or 64
        rows = recompile_rows(tuple(a.layers or [16, 64]), hidden, seq, a.batch)
        print(head + f", hidden {hidden}, sequence {seq}, batch {a.batch}, backend eager (Dynamo only)")
        print(tabulate(rows, headers=["layers", "model", "earlier sources", "programs in the step", "graphs compiled",
                                      "recompile limit hit", "first step s", "ratio to original"], tablefmt="github"))
    else:
        hidden, seq = a.hidden or 256, a.seq or 256
        rows = compile_rows((a.layers or [4])[0], hidden, seq, a.batch, schemes=a.schemes,
                            apart="apart" in a.sources, opaque=a.opaque, modes=tuple(a.modes))
        print(head + f", hidden {hidden}, sequence {seq}, batch {a.batch}, {(a.layers or [4])[0]} layers")
        print(tabulate(rows, headers=["model", "compile", "graphs", "first step s", "step ms", "ratio to original"],
                       tablefmt="github"))


if __name__ == "__main__":
    main()
