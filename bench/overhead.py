"""A physical floor for every scheme: what a converted training step must cost at least, next to what it costs.

    python -m bench.overhead [--layers 8] [--hidden 256] [--batch 2] [--seq 256] [--threads 1] [--rep 7]
                             [--no-compile] [--schemes KEY ...] [--json PATH] [--device cpu|cuda] [--dtype fp32|bf16]

For the original tiny Llama and every scheme variant of the registry (plus mHC at the peer's Sinkhorn iteration
count, and the x-transformers hyper-connections peer against its own vanilla), one forward + backward training step
(``loss = model(ids, labels=ids).loss; loss.backward()``, gradients zeroed) is

* counted (:mod:`depthrewrite.kernels.cost`, eager, once per model): FLOPs per token (torch's matmul/attention
  registry plus our formulas for every depth op) and unfused bytes per token (every op reads its inputs and writes
  its outputs once; a depth op is one fused op); ``+FLOPs`` and ``+bytes`` are the converted model's extra as a
  fraction of the vanilla model's, and the floor is ``1 + max(+FLOPs, +bytes)``, the bound named beside it: what
  the converted step costs relative to vanilla at least when the step is bound by that resource and nothing is
  fused that the unfused count charges for (a CPU step bound by its matmuls can come in below a bytes floor);
* timed, eager and compiled (``torch.compile(original)`` against ``torch.compile(converted, backend="depthrewrite")``),
  the converted and the vanilla step alternating in one loop (the order flipped every repetition) so that drift hits
  both; the ratio is the median of the per-pair ratios, after 2 warm-up steps each;
* measured for peak memory (eager), the model's parameters and buffers included: on a GPU
  ``torch.cuda.max_memory_allocated`` above what was allocated before the step (the other models stay on the
  device); on CPU the peak of the live storages that the step's ops allocate (a dispatch mode with a finalizer per
  storage; what a depth op's reference allocates inside itself is not seen, as the fused kernel would not allocate
  it).

The measured ratio should approach the floor from above as the implementation gets better. Prints a Markdown table
(with machine, torch, date, threads) and, with ``--json``, writes the rows.
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import statistics
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import depthrewrite as dr
from depthrewrite.demo.zoo import hf_model
from depthrewrite.kernels.cost import StepCost, count_step
from depthrewrite.kernels.cost import lm_step as cost_lm_step

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: Sinkhorn iterations of x-transformers' hyper-connections when its source cannot be read (its default, 2.31.10)
PEER_SINKHORN_ITERS = 5
PEER = "x-transformers"

Step = Callable[[torch.nn.Module, torch.Tensor], None]


# -- the models --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    """One row: ``key`` selects it with ``--schemes``; ``scheme`` and ``options`` go to ``depthrewrite.convert``."""

    key: str
    label: str
    scheme: str | None
    options: dict = field(default_factory=dict)


def peer_sinkhorn_iters() -> int | None:
    """The Sinkhorn iteration count x-transformers' ``Decoder(num_residual_streams=n)`` uses by default (read from
    its signature), or None when x-transformers does not import."""
    try:
        from x_transformers.x_transformers import AttentionLayers
    except ImportError:
        return None
    param = inspect.signature(AttentionLayers.__init__).parameters.get("hyper_conn_sinkhorn_iters")
    return int(param.default) if param is not None else PEER_SINKHORN_ITERS


def variants(peer_iters: int | None) -> list[Variant]:
    """The original, every registered scheme variant, and mHC at the peer's Sinkhorn iteration count."""
    out = [Variant("original", "original", None)]
    for rec in dr.schemes().values():
        out += [Variant(v.key, v.label, rec.name, dict(v.options)) for v in rec.variants]
    k = peer_iters or PEER_SINKHORN_ITERS
    out.append(Variant("mhc@peer", f"mHC (n=4), {k} Sinkhorn iters", "mhc", {"sinkhorn_iters": k}))
    return out


def build(v: Variant, a: argparse.Namespace) -> torch.nn.Module:
    """The tiny Llama of ``a`` (seeded), converted to ``v`` unless it is the original; in training mode."""
    torch.manual_seed(0)
    model = hf_model("llama", layers=a.layers, hidden=a.hidden, max_position_embeddings=a.seq + 8,
                     attention_dropout=0.0).train()
    model = model.to(device=a.device, dtype=DTYPES[a.dtype])
    if v.scheme is None:
        return model
    ids = torch.randint(3, model.config.vocab_size, (1, a.seq), device=a.device)
    return dr.convert(model, v.scheme, example_inputs=(ids,), **v.options)


def build_peer(a: argparse.Namespace, streams: int) -> torch.nn.Module:
    """x-transformers' decoder at the Llama's sizes (RMSNorm, rotary, SwiGLU of width 2·hidden, SDPA), with
    ``streams`` residual streams (1: plain residuals)."""
    from loguru import logger
    from x_transformers import Decoder, TransformerWrapper

    logger.disable("x_transformers")  # its advice on the rotary width of tiny heads, once per model
    torch.manual_seed(0)
    heads = max(1, a.hidden // 16)
    model = TransformerWrapper(
        num_tokens=256, max_seq_len=a.seq + 8,
        attn_layers=Decoder(dim=a.hidden, depth=a.layers, heads=heads, attn_dim_head=a.hidden // heads,
                            use_rmsnorm=True, rotary_pos_emb=True, ff_glu=True, ff_swish=True, ff_mult=2,
                            attn_flash=True, num_residual_streams=streams),
    )  # fmt: skip
    return model.to(device=a.device, dtype=DTYPES[a.dtype]).train()


def lm_step(model: torch.nn.Module, ids: torch.Tensor) -> None:
    """One training step of a Hugging Face causal LM (:func:`depthrewrite.kernels.cost.lm_step`), gradients cleared
    after."""
    cost_lm_step(model, ids)
    model.zero_grad(set_to_none=True)


def peer_step(model: torch.nn.Module, ids: torch.Tensor) -> None:
    """The same step for an x-transformers ``TransformerWrapper`` (it returns logits; the loss is shifted here)."""
    logits = model(ids)
    F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
    model.zero_grad(set_to_none=True)


# -- counting ----------------------------------------------------------------------------------------------------------
def step_cost(model: torch.nn.Module, ids: torch.Tensor, step: Step = lm_step) -> StepCost:
    """FLOPs and unfused bytes of one eager training step (after one uncounted warm-up step)."""
    return count_step(model, lambda: ids, step=step)


def extra(cost: StepCost, base: StepCost) -> tuple[float, float]:
    """(+FLOPs, +bytes) per token of ``cost`` as fractions of ``base``'s."""
    return (cost.flops_per_token / base.flops_per_token - 1, cost.bytes_per_token / base.bytes_per_token - 1)


def floor(dflops: float, dbytes: float) -> tuple[float, str]:
    """``1 + max(+FLOPs, +bytes)`` and which bound it is."""
    return (1 + dbytes, "bytes") if dbytes >= dflops else (1 + dflops, "FLOPs")


def breakdown(cost: StepCost, base: StepCost) -> dict[str, Any]:
    """Where the extra goes, as fractions of vanilla: depth ops forward / backward (bytes and FLOPs), every other op
    (the delta against vanilla), and the other op that adds most bytes."""
    depth = {n: c for n, c in cost.by_op.items() if n.startswith("depthrewrite.")}
    bwd = {n: c for n, c in depth.items() if n.endswith("_backward")}
    fwd = {n: c for n, c in depth.items() if n not in bwd}
    other = {n for n in set(cost.by_op) | set(base.by_op) if not n.startswith("depthrewrite.")}

    def delta(n: str, what: str) -> int:
        mine, theirs = cost.by_op.get(n), base.by_op.get(n)
        return (getattr(mine, what) if mine else 0) - (getattr(theirs, what) if theirs else 0)

    top = max(other, key=lambda n: delta(n, "bytes"), default=None)
    return {
        "bytes: depth fwd": sum(c.bytes for c in fwd.values()) / base.bytes,
        "bytes: depth bwd": sum(c.bytes for c in bwd.values()) / base.bytes,
        "bytes: other ops": sum(delta(n, "bytes") for n in other) / base.bytes,
        "bytes: top other op": f"{top} {delta(top, 'bytes') / base.bytes:+.1%}" if top else "-",
        "FLOPs: depth fwd": sum(c.flops for c in fwd.values()) / base.flops,
        "FLOPs: depth bwd": sum(c.flops for c in bwd.values()) / base.flops,
        "FLOPs: other ops": sum(delta(n, "flops") for n in other) / base.flops,
    }


# -- peak memory -------------------------------------------------------------------------------------------------------
class LiveStorageMode(TorchDispatchMode):
    """Tracks the bytes of the storages that ops allocate while active and their peak.

    A storage counts from the op that first returns it (an output whose storage none of that op's inputs has: views
    and in-place results are not allocations) until it is freed (``weakref.finalize`` on the storage, whose Python
    object lives as long as the storage does). Parameters, inputs and anything allocated before the mode are never
    counted; what an op allocates and frees inside itself (a depth op's reference temporaries) is not seen.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self._tracked.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "is_view", False):
            return out
        leaves = tree_flatten((args, kwargs))[0]
        inputs = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in inputs or key in self._tracked or storage.nbytes() == 0:
                continue
            self._tracked.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, storage.nbytes())
        return out


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (each storage once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()]}
    return sum(storages.values())


def peak_memory(model: torch.nn.Module, ids: torch.Tensor, step: Step = lm_step, warmup: bool = True) -> int:
    """Peak bytes of one eager training step (after a warm-up step, unless the model ran already), parameters and
    buffers included."""
    if warmup:
        step(model, ids)
    if ids.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()  # every model on the device, the vanilla one included
        step(model, ids)
        torch.cuda.synchronize()
        return resident_bytes(model) + torch.cuda.max_memory_allocated() - before
    with LiveStorageMode() as mode:
        step(model, ids)
    return resident_bytes(model) + mode.peak


# -- timing ------------------------------------------------------------------------------------------------------------
def _timed(fn: Callable[[], None], cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t


def paired_times(base: Callable[[], None], other: Callable[[], None], rep: int, warmup: int = 2,
                 cuda: bool = False) -> tuple[list[float], list[float]]:
    """Seconds per call of ``base`` and ``other``, alternating in one loop (the order flipped every repetition)."""
    for _ in range(warmup):
        base()
        other()
    tb, to = [], []
    for i in range(rep):
        if i % 2:
            to.append(_timed(other, cuda))
            tb.append(_timed(base, cuda))
        else:
            tb.append(_timed(base, cuda))
            to.append(_timed(other, cuda))
    return tb, to


def ratio(tb: list[float], to: list[float]) -> float:
    """The median of the per-pair ratios ``other / base``."""
    return statistics.median(o / b for b, o in zip(tb, to))


# -- one row -----------------------------------------------------------------------------------------------------------
@dataclass
class Pair:
    """A vanilla model, its compiled form (or None) and its training step, shared by the rows compared to it."""

    model: torch.nn.Module
    compiled: torch.nn.Module | None
    step: Step
    cost: StepCost
    peak: int
    eager_ms: list[float] = field(default_factory=list)
    compiled_ms: list[float] = field(default_factory=list)


def vanilla(model: torch.nn.Module, ids: torch.Tensor, step: Step, compile_it: bool) -> Pair:
    """Count and measure a vanilla model once; its compiled form compiles on its first timed step."""
    cost = step_cost(model, ids, step)
    peak = peak_memory(model, ids, step, warmup=False)  # counting ran a step already
    return Pair(model, torch.compile(model) if compile_it else None, step, cost, peak)


def measure(label: str, model: torch.nn.Module, ids: torch.Tensor, base: Pair, a: argparse.Namespace,
            backend: str = "depthrewrite", note: str = "") -> dict[str, Any]:
    """One row: counted extra FLOPs/bytes, the floor, eager and compiled step-time ratios, the peak memory ratio."""
    cuda = a.device == "cuda"
    t0 = time.perf_counter()
    cost = step_cost(model, ids, base.step)
    dflops, dbytes = extra(cost, base.cost)
    bound, which = floor(dflops, dbytes)
    row: dict[str, Any] = {"model": label, "+FLOPs": dflops, "+bytes": dbytes, "floor": bound, "bound": which}
    tb, to = paired_times(lambda: base.step(base.model, ids), lambda: base.step(model, ids), a.rep, cuda=cuda)
    base.eager_ms += [1e3 * t for t in tb]
    row["eager"] = ratio(tb, to)
    row["eager ms"] = 1e3 * statistics.median(to)
    row["compiled"] = row["compiled ms"] = None
    if base.compiled is not None:
        compiled = torch.compile(model) if backend == "inductor" else torch.compile(model, backend=backend)
        try:
            tb, to = paired_times(lambda: base.step(base.compiled, ids), lambda: base.step(compiled, ids), a.rep,
                                  cuda=cuda)
        except Exception as e:  # noqa: BLE001 - a compile failure is a result; the eager columns stand
            row["compiled error"] = _error(e)
        else:
            base.compiled_ms += [1e3 * t for t in tb]
            row["compiled"] = ratio(tb, to)
            row["compiled ms"] = 1e3 * statistics.median(to)
    peak = peak_memory(model, ids, base.step, warmup=False)
    row["peak mem"] = peak / base.peak
    row["peak MiB"] = peak / 2**20
    row.update(breakdown(cost, base.cost))
    row["note"] = note
    row["seconds"] = time.perf_counter() - t0
    print(f"  {label}: {_fmt_row(row)} ({row['seconds']:.0f} s)", flush=True)
    return row


# -- output ------------------------------------------------------------------------------------------------------------
def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _error(e: BaseException) -> str:
    """An exception in one line: its innermost cause (a compile failure wraps the backend's error), first line."""
    while getattr(e, "inner_exception", None) is not None or e.__cause__ is not None:
        e = getattr(e, "inner_exception", None) or e.__cause__
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    return f"{type(e).__name__}: {first[:240]}"


def _fmt_row(r: dict[str, Any]) -> str:
    return (f"+FLOPs {_pct(r['+FLOPs'])}, +bytes {_pct(r['+bytes'])}, floor {_x(r['floor'])} ({r['bound']}), "
            f"eager {_x(r['eager'])}, compiled {_x(r['compiled'])}, peak mem {_x(r['peak mem'])}")


MAIN_COLS = ("model", "+FLOPs/token", "+bytes/token", "floor", "eager ×", "compiled ×", "peak mem ×")
PART_COLS = ("model", "bytes: depth fwd", "bytes: depth bwd", "bytes: other ops", "bytes: top other op",
             "FLOPs: depth fwd", "FLOPs: depth bwd", "FLOPs: other ops")


def markdown(rows: list[dict[str, Any]]) -> str:
    """The main table (extra cost, floor, measured ratios) and the breakdown of the extra, as Markdown."""
    lines = ["| " + " | ".join(MAIN_COLS) + " |", "|" + "---|" * len(MAIN_COLS)]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['model']} | {r['error']} |" + " |" * (len(MAIN_COLS) - 2))
            continue
        comp = "failed¹" if r.get("compiled error") else _x(r["compiled"])
        lines.append(f"| {r['model']} | {_pct(r['+FLOPs'])} | {_pct(r['+bytes'])} | {_x(r['floor'])} ({r['bound']}) "
                     f"| {_x(r['eager'])} | {comp} | {_x(r['peak mem'])} |")
    failed = [r for r in rows if r.get("compiled error")]
    if failed:
        lines += ["", "¹ " + "; ".join(f"{r['model']}: {r['compiled error']}" for r in failed)]
    lines += ["", "Where the extra goes (each as a fraction of the vanilla step's bytes or FLOPs; other ops: the "
              "change in every non-depth op against vanilla):", ""]
    lines += ["| " + " | ".join(PART_COLS) + " |", "|" + "---|" * len(PART_COLS)]
    for r in rows:
        if not r.get("error"):
            cells = [r["model"]] + [r[c] if isinstance(r[c], str) else _pct(r[c]) for c in PART_COLS[1:]]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def environment(a: argparse.Namespace) -> dict[str, Any]:
    env = dict(date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), torch=torch.__version__,
               python=platform.python_version(), machine=f"{platform.machine()}, {_cpu_name()}", threads=a.threads,
               device=a.device, dtype=a.dtype)
    if a.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


NOTES = (
    "+FLOPs: torch's registry (matmuls, attention) plus our formulas for the depth ops (all their arithmetic); "
    "elementwise aten ops count 0 on both sides. +bytes: unfused traffic, every op reads its inputs and writes its "
    "outputs once, a depth op is one fused op (depthrewrite/kernels/cost.py).",
    "floor = 1 + max(+FLOPs, +bytes), the bound named: what the step costs at least if it is bound by that; a step "
    "bound by its matmuls (a CPU) can come in below a bytes floor.",
    "MoDA's depth op holds the layer's whole attention (its sequence part replaces SDPA), so its 'FLOPs: depth' "
    "include the sequence attention and 'FLOPs: other ops' lose the SDPA they replace.",
)


# -- main --------------------------------------------------------------------------------------------------------------
def run(a: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]], list[str]]:
    """Every selected row; returns (environment, rows, notes)."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(64, torch._dynamo.config.recompile_limit)  # one program per model
    compile_it = not a.no_compile
    peer_iters = peer_sinkhorn_iters()
    chosen = [v for v in variants(peer_iters) if not a.schemes or v.key in a.schemes or v.key == "original"]
    rows: list[dict[str, Any]] = []
    notes: list[str] = list(NOTES)
    orig = build(chosen[0], a)
    ids = torch.randint(3, orig.config.vocab_size, (a.batch, a.seq), device=a.device,
                        generator=torch.Generator(device=a.device).manual_seed(1))
    base = vanilla(orig, ids, lm_step, compile_it)
    print(f"vanilla: {base.cost.flops_per_token / 1e6:.2f} MFLOP/token, "
          f"{base.cost.bytes_per_token / 1e3:.1f} kB/token, peak {base.peak / 2**20:.1f} MiB", flush=True)
    for v in chosen[1:]:
        try:
            model = build(v, a)
            rows.append(measure(v.label, model, ids, base, a))
        except Exception as e:  # noqa: BLE001 - one failing row must not end the run
            rows.append({"model": v.label, "error": _error(e)})
            print(f"  {v.label}: {rows[-1]['error']}", flush=True)
        finally:
            model = None
    notes.append(f"vanilla step: {statistics.median(base.eager_ms):.1f} ms eager"
                 + (f", {statistics.median(base.compiled_ms):.1f} ms compiled" if base.compiled_ms else "")
                 + f"; {base.cost.flops_per_token / 1e6:.2f} MFLOP/token, {base.cost.bytes_per_token / 1e3:.1f} "
                 f"kB/token unfused, peak {base.peak / 2**20:.1f} MiB")
    if a.schemes is None or PEER in a.schemes:
        rows += peer_rows(a, compile_it, peer_iters, notes)
    return environment(a), rows, notes


def peer_rows(a: argparse.Namespace, compile_it: bool, iters: int | None, notes: list[str]) -> list[dict[str, Any]]:
    """x-transformers with 4 residual streams against itself with one (both compiled with inductor)."""
    label = f"{PEER} hyper-connections (n=4, {iters} Sinkhorn iters)"
    if iters is None:
        notes.append(f"{PEER}: not installed")
        return [{"model": f"{PEER} hyper-connections", "error": "not installed"}]
    try:
        plain = build_peer(a, 1)
        ids = torch.randint(0, 256, (a.batch, a.seq), device=a.device,
                            generator=torch.Generator(device=a.device).manual_seed(1))
        base = vanilla(plain, ids, peer_step, compile_it)
        row = measure(label, build_peer(a, 4), ids, base, a, backend="inductor",
                      note="against x-transformers without residual streams")
    except Exception as e:  # noqa: BLE001
        row = {"model": label, "error": _error(e)}
        print(f"  {label}: {row['error']}", flush=True)
        return [row]
    notes.append(
        f"{PEER} peer: its own HyperConnection (x_transformers.py, not the hyper-connections package): "
        f"Sinkhorn on H_res only, {iters} iterations (softmax over dim -2, then {iters}×(row, column) L1 "
        f"normalisations = {2 * iters} normalisations; ours does 2·K−1 = {2 * iters - 1} at K={iters}), so mHC's "
        "manifold constraint on the residual mix, but HC's (arXiv:2409.19606, Alg. 2) per-stream dynamic weights: "
        "LayerNorm of each stream @ [D, n+1] without HC's tanh, sigmoid H_pre, 2·sigmoid H_post; no projection of "
        "the flattened n·D state as in mHC. Its ratios are against x-transformers without residual streams "
        f"({statistics.median(base.eager_ms):.1f} ms eager"
        + (f", {statistics.median(base.compiled_ms):.1f} ms compiled" if base.compiled_ms else "") + ")."
    )
    return [row]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rep", type=int, default=7, help="timed pairs per measurement (median ratio reported)")
    p.add_argument("--no-compile", action="store_true", help="eager only (no torch.compile rows)")
    p.add_argument("--schemes", nargs="+", default=None,
                   help="row keys: registry variant keys (attnres, block-attnres, ...), mhc@peer, x-transformers")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench.overhead: --device cuda, but no CUDA device here; nothing measured.")
        return 0
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    env, rows, notes = run(a)
    env["wall s"] = round(time.perf_counter() - t0, 1)
    print(f"\n# bench.overhead — {env['date']}\n\n{env['machine']}, {env['device']} {env['dtype']}"
          + (f" ({env['gpu']})" if "gpu" in env else "") + f", torch {env['torch']}, {a.threads} thread(s); "
          f"Llama, {a.layers} layers, hidden {a.hidden}, batch {a.batch} × sequence {a.seq}, {a.rep} timed pairs; "
          f"{env['wall s']:.0f} s\n")
    print(markdown(rows))
    print("\n".join(f"- {n}" for n in notes))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(env=env, args=vars(a), notes=notes, rows=rows), f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
