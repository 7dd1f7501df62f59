"""Kernel and whole-model benchmarks: ``python -m bench.kernels [--ops depth_attn,moda] [--dtype bf16] [--out DIR]``.

For every case in ``bench/kernel_cases/<op>.py`` it times, side by side in one run, the fused Triton kernel, the eager
PyTorch reference, ``torch.compile`` of the reference and any peer that is importable, forward and forward+backward,
and reports achieved bytes/s against this GPU's measured copy bandwidth (and FLOP/s where the case states FLOPs).
``--model`` adds a whole-model training step: each converted scheme against the vanilla model, tokens/s and peak
memory. Results are printed as Markdown and written as JSON + Markdown into ``--out``.

Needs a CUDA GPU; on a machine without one it says so and exits 0 (nothing is measured, nothing is claimed).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .kernel_cases import OPS, Case
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# -- timing ----------------------------------------------------------------------------------------------------------
def time_ms(fn: Callable[[], Any], warmup: int = 3, rep: int = 20, device: str = "cuda") -> float:
    """Median wall time of ``fn`` in milliseconds (CUDA events on a GPU, perf_counter elsewhere); the L2 cache is
    flushed before every timed call on a GPU so every kernel reads its inputs from HBM."""
    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")  # > H200's 60 MB L2
        for _ in range(rep):
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(rep):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbs(device: str = "cuda", nbytes: int = 2 << 30) -> float:
    """Measured device-to-device copy bandwidth (read + write bytes per second), the roofline we compare against."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device=device)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _compiled(fn: Callable[[], Any]) -> Callable[[], Any]:
    return torch.compile(fn, dynamic=False)


def run_case(case: Case, device: str, copy_gbs: float, rep: int) -> list[dict[str, Any]]:
    """Time every implementation of one case (forward, then forward+backward). One row per (impl, direction)."""
    rows = []
    for direction, impls, nbytes, flops in (
        ("fwd", dict(case.impls), case.bytes, case.flops),
        ("fwd+bwd", dict(case.impls_bwd), case.bytes_bwd, case.flops_bwd),
    ):
        if "reference" in impls and "compiled-reference" not in impls:
            impls["compiled-reference"] = _compiled(impls["reference"])
        for name, fn in impls.items():
            row: dict[str, Any] = dict(op=case.op, shape=case.shape, direction=direction, impl=name)
            try:
                ms = time_ms(fn, rep=rep, device=device)
            except Exception as e:  # noqa: BLE001 - one failing impl (OOM, a peer's limit) must not end the run
                row.update(ms=None, error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
                if device == "cuda":
                    torch.cuda.empty_cache()
                rows.append(row)
                continue
            row["ms"] = ms
            if nbytes:
                row["GB/s"] = nbytes / (ms * 1e-3) / 1e9
                row["% copy bw"] = 100 * row["GB/s"] / copy_gbs if copy_gbs else None
            if flops:
                row["TFLOP/s"] = flops / (ms * 1e-3) / 1e12
            rows.append(row)
        base = next((r["ms"] for r in rows if r["direction"] == direction and r["impl"] == "fused" and r.get("ms")), None)
        for r in rows:
            if r["direction"] == direction and r.get("ms") and base:
                r["x fused"] = r["ms"] / base  # > 1: slower than the fused kernel
    return rows


# -- whole-model step --------------------------------------------------------------------------------------------------
def model_step_rows(device: str, dtype: torch.dtype, rep: int, layers: int, hidden: int, tokens: int) -> list[dict]:
    """One training step (forward, backward, AdamW) of a Llama, vanilla vs each converted scheme, measured side by side."""
    import depthrewrite as dr
    from depthrewrite.demo.zoo import hf_model

    B, T = max(1, tokens // 2048), min(tokens, 2048)
    N = min(8, 2 * layers)
    # the demo's default variants of every registered scheme (SchemeVariant.demo), Block forms with N blocks
    schemes = [("vanilla", None, {})] + [
        (f"Block {s.title} (N={N})", s.name, {**v.options, "blocks": N}) if "blocks" in v.options
        else (v.label, s.name, v.options)
        for s in dr.schemes().values() for v in s.variants if v.demo
    ]
    rows = []
    heads = max(1, hidden // 128)
    for label, scheme, options in schemes:
        torch.manual_seed(0)
        base = hf_model(
            "llama", layers=layers, hidden=hidden, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
            intermediate_size=int(hidden * 8 / 3) // 64 * 64, vocab_size=32000,
        ).to(device=device, dtype=dtype)
        ids = torch.randint(0, 32000, (B, T), device=device)
        model = base if scheme is None else dr.convert(base, scheme, example_inputs=(ids[:, :64],), inplace=False, **options)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")

        def step():  # the loss outside the model: a converted model takes the inputs it was captured with
            logits = model(ids).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            ms = time_ms(step, warmup=2, rep=rep, device=device)
        except torch.OutOfMemoryError as e:  # a size limit is a result; any other error is a bug and is raised
            rows.append(dict(model=label, error=f"OutOfMemoryError: {str(e).splitlines()[0][:160]}"))
            continue
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
        rows.append(dict(model=label, ms=ms, **{"tokens/s": B * T / (ms * 1e-3), "peak GiB": peak}))
        del model, base, opt
        if device == "cuda":
            torch.cuda.empty_cache()
    v = next((r["ms"] for r in rows if r["model"] == "vanilla" and "ms" in r), None)
    for r in rows:
        if v and "ms" in r:
            r["x vanilla"] = r["ms"] / v
    return rows


# -- output --------------------------------------------------------------------------------------------------------------
def to_markdown(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of result rows (columns = union of keys, in first-seen order)."""
    if not rows:
        return "(no rows)\n"
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]

    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def environment(device: str) -> dict[str, Any]:
    import triton

    env = dict(
        date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
    )
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, sm=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1))
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.split("\n")[0])
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {OPS}")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--rep", type=int, default=20, help="timed repetitions per measurement (median reported)")
    ap.add_argument("--model", action="store_true", help="also time a whole-model training step per scheme")
    ap.add_argument("--model-layers", type=int, default=16)
    ap.add_argument("--model-hidden", type=int, default=2048)
    ap.add_argument("--model-tokens", type=int, default=8192)
    ap.add_argument("--out", default=None, help="directory for results.json and results.md")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.kernels: no CUDA device here; nothing measured (run bench/gpu.sh on a GPU machine).")
        return 0
    device, dtype = "cuda", DTYPES[args.dtype]
    ops = [o for o in args.ops.split(",") if o]
    bad = sorted(set(ops) - set(OPS))
    if bad:
        print(f"bench.kernels: unknown op(s) {bad}; choose from {OPS}", file=sys.stderr)
        return 2
    env = environment(device)
    env["copy GB/s"] = copy_bw = copy_bandwidth_gbs(device)
    print(f"# bench.kernels — {env.get('gpu')} — {env['date']}\n\ntorch {env['torch']}, triton {env['triton']}, "
          f"{args.dtype}; measured copy bandwidth {copy_bw:,.0f} GB/s\n", flush=True)
    rows: list[dict[str, Any]] = []
    for op in ops:
        try:
            cases = importlib.import_module(f"bench.kernel_cases.{op}").cases(device, dtype)
        except Exception as e:  # noqa: BLE001
            print(f"## {op}: cases failed to build: {type(e).__name__}: {e}\n", flush=True)
            continue
        for case in cases:
            got = run_case(case, device, copy_bw, args.rep)
            rows += got
            print(f"## {op} {case.shape}\n" + (f"\n{case.note}\n" if case.note else "") + "\n" + to_markdown(got), flush=True)
            del case
            torch.cuda.empty_cache()
    model_rows = []
    if args.model:
        model_rows = model_step_rows(device, dtype, max(3, args.rep // 4), args.model_layers, args.model_hidden, args.model_tokens)
        print(f"## whole-model training step (Llama, {args.model_layers} layers, d={args.model_hidden}, "
              f"{args.model_tokens} tokens/step)\n\n" + to_markdown(model_rows), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(dict(env=env, kernels=rows, model=model_rows), indent=1, default=str))
        (out / "results.md").write_text(to_markdown(rows) + "\n" + to_markdown(model_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
