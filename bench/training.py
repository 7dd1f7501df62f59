"""Training at scale, per block: activation memory with checkpointing, and torch.compile whole-model vs per block.

    python -m bench.training memory  [--layers 16 32] [--hidden 256] [--seq 256]
    python -m bench.training compile [--layers 4] [--hidden 256] [--seq 256] [--batch 2]

``memory``: bytes autograd saves for backward in one training step (``loss = model(ids, labels=ids).loss``),
counted with ``torch.autograd.graph.saved_tensors_hooks`` (deterministic, no timing noise), for the original Llama
and every scheme, without and with activation checkpointing (HF's ``activation_checkpointing_enable()``: the
converted model calls its blocks as modules, so the same switch recomputes each block in backward). Counted: every
storage a saved tensor uses plus the inputs of every block call (a checkpointed block keeps its inputs to recompute
itself; autograd's hooks do not see those), each storage once however often it is saved (a block summary that every
later block reads is one tensor); parameters are not counted (they are kept anyway).

``compile``: ``torch.compile`` of the whole model (the converted one with ``backend="depthrewrite"``) against
``.compile()`` on each block module, for the original and every scheme: the first training step (compile included)
and the best of 5 later steps, every row in the same run; Dynamo is reset between rows and inductor's caches are off
(every compile is cold).
"""

from __future__ import annotations

import argparse
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
            out.append((v.label, v.key, dict(v.options)))
    return out


def _build(layers: int, hidden: int, seq: int, key: str | None, options: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    model = hf_model("llama", layers=layers, hidden=hidden, max_position_embeddings=seq + 8,
                     attention_dropout=0.0).train()
    if key is None:
        return model
    ids = torch.randint(3, model.config.vocab_size, (1, seq))
    return dr.convert(model, key, example_inputs=(ids,), **options)


def saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """Bytes saved for backward by one ``model(ids, labels=ids).loss`` (warmed up first: captures happen there)."""
    model(ids, labels=ids).loss.backward()
    storages: dict[tuple, int] = {}
    params = {(p.untyped_storage().data_ptr(), p.device) for p in model.parameters()}

    def keep(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            key = (s.data_ptr(), t.device)
            if key not in params:  # parameters exist anyway: activations only
                storages[key] = s.nbytes()
        return t

    def block_inputs(module, args):  # what a checkpointed block keeps to recompute itself (its inputs)
        for a in args:
            keep(a)

    hooks = [blk.register_forward_pre_hook(block_inputs) for blk in model.model.layers]
    try:
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            loss = model(ids, labels=ids).loss
    finally:
        for h in hooks:
            h.remove()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def memory_rows(layers: tuple[int, ...], hidden: int, seq: int) -> list[list]:
    rows = []
    for L in layers:
        base = {}
        for label, key, options in _variants():
            model = _build(L, hidden, seq, key, options)
            ids = torch.randint(3, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(1))
            plain = saved_bytes(model, ids)
            model.activation_checkpointing_enable()
            ckpt = saved_bytes(model, ids)
            if key is None:
                base = dict(plain=plain, ckpt=ckpt)
            rows.append([L, label, f"{plain / 2**20:.1f}", f"{plain / base['plain']:.2f}", f"{ckpt / 2**20:.1f}",
                         f"{ckpt / base['ckpt']:.2f}"])
            print(*rows[-1], flush=True)
    return rows


def _step(model: torch.nn.Module, ids: torch.Tensor) -> float:
    t = time.perf_counter()
    model(ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t


def compile_rows(layers: int, hidden: int, seq: int, batch: int, repeats: int = 5) -> list[list]:
    import torch._dynamo

    import torch._inductor.config

    torch._dynamo.config.recompile_limit = max(64, torch._dynamo.config.recompile_limit)  # one variant per program
    torch._inductor.config.force_disable_caches = True  # cold compiles: no FX graph or kernel cache from earlier runs
    torch.compile(lambda x: (x * 2).sum())(torch.randn(4))  # inductor's one-time start-up, outside every row
    rows = []
    base: dict[str, float] = {}
    for label, key, options in _variants():
        for how in ("whole", "per block"):
            torch._dynamo.reset()
            model = _build(layers, hidden, seq, key, options)
            ids = torch.randint(3, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
            if key is not None:
                _step(model, ids)  # capture the training graph outside the timing
            backend = "inductor" if key is None else "depthrewrite"
            if how == "whole":
                run = torch.compile(model, backend=backend)
            else:
                for blk in model.model.layers:
                    blk.compile(backend=backend)
                run = model
            first = _step(run, ids)
            best = min(_step(run, ids) for _ in range(repeats))
            if key is None:
                base[how] = best
            rows.append([label, how, f"{first:.1f}", f"{1e3 * best:.1f}", f"{best / base[how]:.2f}"])
            print(*rows[-1], flush=True)
    return rows


def main() -> None:
    from tabulate import tabulate

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("memory", "compile"))
    p.add_argument("--layers", type=int, nargs="+", default=None)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    head = (f"{date.today()}, {platform.machine()} {platform.processor() or ''}, torch {torch.__version__}, "
            f"{a.threads} thread(s), hidden {a.hidden}, sequence {a.seq}")
    if a.what == "memory":
        rows = memory_rows(tuple(a.layers or (16, 32)), a.hidden, a.seq)
        print(head)
        print(tabulate(rows, headers=["layers", "model", "MiB saved", "ratio", "MiB saved, ckpt", "ratio, ckpt"],
                       tablefmt="github"))
    else:
        rows = compile_rows((a.layers or [4])[0], a.hidden, a.seq, a.batch)
        print(head + f", batch {a.batch}, {(a.layers or [4])[0]} layers")
        print(tabulate(rows, headers=["model", "compile", "first step s", "step ms", "ratio to original"],
                       tablefmt="github"))


if __name__ == "__main__":
    main()
