"""Quality at small scale: every scheme against the vanilla model, at matched steps and tokens, on real text.

    python -m bench.quality                      # the committed study: writes docs/results.md and its plot
    python -m bench.quality --jobs 3             # the same, one process per seed
    python -m bench.quality --quick --out DIR    # a smoke test of the whole pipeline (CI), a few steps
    python -m bench.quality --preset depth       # the depth study: 12 layers, 1M tokens, compiled (quality_depth.py)

The model is the demo's built-in Llama (random init, byte-level); the corpus is the running interpreter's standard
library source (train/validation split by file, see depthrewrite/demo/corpus.py). Every variant of a seed starts from the
same original weights and sees the same batches in the same order. Validation loss is in nats per byte on fixed
windows of the held-out files.

Sized for well under 30 minutes on an idle 2-core CPU (7 variants x 3 seeds x 150 steps); not run in CI (the
``--quick`` mode is). Raw per-run numbers go next to the report as ``results_runs.json``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from depthrewrite.demo.corpus import Corpus
from depthrewrite.errors import ConfigError, DepthRewriteError
from depthrewrite.demo.train import VARIANTS, RunResult, TrainConfig, parse_variants, tiny_llama, train_variant

#: the MSAR paper's 10B-token ablation (validation loss), for the ordering comparison only
PAPER = {"vanilla": 1.898, "mhc": 1.871, "attnres": 1.867, "msar": 1.847}
PAPER_LABEL = {"vanilla": "Vanilla", "mhc": "mHC", "attnres": "AttnRes", "msar": "MSAR"}

FULL = dict(steps=150, batch=16, seq=128, layers=4, hidden=64, seeds=3, eval_batches=16)
QUICK = dict(steps=3, batch=2, seq=32, layers=2, hidden=32, seeds=1, eval_batches=2)
#: every variant of every registered scheme (``Scheme.variants``), after the original
DEFAULT_SCHEMES = ",".join(VARIANTS)


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def run(args: argparse.Namespace, after_seed=None) -> dict[str, list[RunResult]]:
    """Train every variant for every seed; ``after_seed(results)`` is called when a seed is complete."""
    variants = parse_variants(args.schemes)
    cfg = TrainConfig(steps=args.steps, batch=args.batch, seq=args.seq, lr=args.lr, warmup=max(1, args.steps // 20),
                      eval_batches=args.eval_batches)
    corpus = Corpus.stdlib(max_bytes=args.max_bytes)
    print(corpus, flush=True)
    results: dict[str, list[RunResult]] = {v.name: [] for v in variants}
    seeds = [args.seed_only] if args.seed_only is not None else range(args.seeds)
    for seed in seeds:
        for v in variants:
            t0 = time.perf_counter()
            r = train_variant(lambda s: tiny_llama(s, args.layers, args.hidden), v, corpus, cfg, seed=seed)
            results[v.name].append(r)
            if args.save_runs is not None:  # a --jobs worker saves after every run: an interrupted job keeps its runs
                args.save_runs.write_text(json.dumps(_to_json(results)))
            init = "" if r.init_error is None else f"  init Δ {r.init_error:.1e}"
            print(
                f"seed {seed}  {v.name:<14} val {r.final_val:.4f}  train {r.final_train:.4f}  "
                f"step {1000 * r.step_time:.0f} ms{init}  ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
        if after_seed is not None:
            after_seed(results)
    return results


def _ordering_text(summary: dict[str, tuple[float, float]], results: dict[str, list[RunResult]]) -> list[str]:
    """What the numbers say about the paper's ordering: paired differences against vanilla, by seed."""
    lines = []
    ours = [k for k in PAPER if k in summary]
    if len(ours) < 2:
        return ["(the paper's variants were not all run; no ordering comparison)"]
    paper_order = sorted(ours, key=PAPER.get)
    our_order = sorted(ours, key=lambda k: summary[k][0])
    lines.append(
        "| | " + " | ".join(PAPER_LABEL[k] for k in ours) + " |\n|---|" + "---|" * len(ours) + "\n"
        "| paper, 10B tokens (val loss) | " + " | ".join(f"{PAPER[k]:.3f}" for k in ours) + " |\n"
        "| here (val loss, mean of seeds) | " + " | ".join(f"{summary[k][0]:.4f}" for k in ours) + " |"
    )
    lines.append("")
    lines.append(f"- Paper ordering (best first): {' < '.join(PAPER_LABEL[k] for k in paper_order)}.")
    lines.append(f"- Ordering here (best first): {' < '.join(PAPER_LABEL[k] for k in our_order)}"
                 + (" — the same." if our_order == paper_order else " — not the same."))
    if "vanilla" in results:
        base = {r.seed: r.final_val for r in results["vanilla"]}
        for k in ours:
            if k == "vanilla":
                continue
            diffs = [r.final_val - base[r.seed] for r in results[k] if r.seed in base]
            if not diffs:
                continue
            m, s = _mean_std(diffs)
            same_sign = all(d < 0 for d in diffs) or all(d > 0 for d in diffs)
            if len(diffs) == 1:
                verdict = "one seed only"
            elif same_sign:
                verdict = f"{'lower' if m < 0 else 'higher'} than vanilla in every seed"
            else:
                verdict = "not consistently different from vanilla across seeds"
            lines.append(f"- {PAPER_LABEL[k]} − Vanilla, paired by seed: {m:+.4f} ± {s:.4f} ({verdict}; paper: "
                         f"{PAPER[k] - PAPER['vanilla']:+.3f}).")
    return lines


def _caveat(summary: dict[str, tuple[float, float]], results: dict[str, list[RunResult]], r0: RunResult) -> str:
    """The limits of the study, with the numbers that set them."""
    import math

    means = [m for m, _ in summary.values()]
    stds = [s for _, s in summary.values() if s > 0]
    gap = max(means) - min(means)
    noise = statistics.fmean(stds) if stds else float("nan")
    orders = math.log10(10e9 / max(1, r0.tokens))
    text = (
        f"Each run sees {r0.tokens / 1e6:.2f}M tokens (about {orders:.0f} orders of magnitude fewer than the paper's 10B) "
        f"on a {r0.model_params / 1e3:.0f}K-parameter model; depth-mixing schemes are motivated by deep models, and this "
        f"one is shallow. The spread between the variants' mean validation losses is {gap:.4f}"
    )
    if stds:
        text += f", against a typical seed-to-seed standard deviation of {noise:.4f} ({gap / noise:.1f}×)."
    else:
        text += " (one seed: no estimate of the seed-to-seed spread)."
    text += (
        " Read the table as: every conversion trains stably on real text at matched steps and tokens, with these "
        "measured costs (new parameters, step time with the reference ops on CPU), landing where it lands at this "
        "scale. It neither confirms nor refutes the paper's ranking at 10B tokens."
    )
    return text


def write_report(results: dict[str, list[RunResult]], args: argparse.Namespace, wall: float, load: tuple | None,
                 out: Path) -> None:
    """Write the Markdown report; ``load`` is the load average at the start and the end of the runs (None: unknown)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    plot = out.with_name(out.stem + "_quality.png")
    summary = {k: _mean_std([r.final_val for r in rs]) for k, rs in results.items()}
    rows = []
    for k, rs in results.items():
        v = rs[0].variant
        vm, vs = summary[k]
        tm, ts = _mean_std([r.final_train for r in rs])
        step = statistics.fmean(r.step_time for r in rs)
        init = [r.init_error for r in rs if r.init_error is not None]
        init_s = "—" if not init else f"{max(init):.1e}" + ("" if v.init_tol is not None else " (not preserving)")
        rows.append(
            f"| {v.label} | **{vm:.4f} ± {vs:.4f}** | {tm:.4f} ± {ts:.4f} | {rs[0].new_params:,} "
            f"({100 * rs[0].new_params / rs[0].model_params:.2f}%) | {1000 * step:.0f} | {init_s} |"
        )
    r0 = next(iter(results.values()))[0]
    n_seeds = len(next(iter(results.values())))
    _plot(results, plot)
    cpu = platform.processor() or platform.machine()
    text = f"""# Results: quality at small scale

Generated by `python -m bench.quality` ({_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}); do not edit by hand.

**Setup.** The demo's built-in Llama (`LlamaForCausalLM`, {args.layers} blocks = {2 * args.layers} sublayers, hidden
{args.hidden}, {r0.model_params:,} parameters, random init), byte-level (vocabulary 256), trained on the Python
{sys.version_info.major}.{sys.version_info.minor} standard library's source files; validation on held-out files (split by
file, see `depthrewrite/demo/corpus.py`), {args.eval_batches} fixed windows of {args.batch} × {args.seq} bytes. Every variant: {args.steps} steps of
{args.batch} × {args.seq} bytes ({r0.tokens:,} tokens), AdamW (lr {args.lr}, β = (0.9, 0.95), no weight decay),
warmup then cosine decay, gradient clipping 1.0; {n_seeds} seed(s): seed s gives every variant the same original
weights and the same batches. Losses are nats per byte.

| variant | val loss (mean ± std) | train loss, last 10% | new params | step time (ms) | init max\\|Δ\\|/max\\|ref\\| |
|---|---|---|---|---|---|
""" + "\n".join(rows) + f"""

![validation loss and training curves]({plot.name})

**Conditions of the step times.** {os.cpu_count()} CPU cores ({cpu}), torch {torch.__version__} with
{torch.get_num_threads()} thread(s), niceness {os.nice(0) if hasattr(os, "nice") else "n/a"}, the PyTorch reference ops (no Triton kernels on CPU). """ + _load_text(load) + " " + (args.note or f"""Seeds ran in {min(args.jobs, args.seeds)} parallel process(es); whole run:
{wall / 60:.1f} minutes (wall clock).""") + f"""

## Against the MSAR paper's 10B-token ablation

""" + "\n".join(_ordering_text(summary, results)) + f"""

**What this does and does not show.** """ + _caveat(summary, results, r0) + "\n"
    from bench.quality_depth import MARKER

    old = out.read_text() if out.exists() else ""
    if MARKER in old:  # the depth study's section (bench/quality_depth.py) stays as it is
        text += "\n" + MARKER + old.split(MARKER, 1)[1]
    out.write_text(text)
    print(f"wrote {out} and {plot}")


def _plot(results: dict[str, list[RunResult]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(results)
    means = [statistics.fmean(r.final_val for r in results[k]) for k in names]
    stds = [statistics.stdev([r.final_val for r in results[k]]) if len(results[k]) > 1 else 0.0 for k in names]
    ax1.bar(range(len(names)), means, yerr=stds, capsize=4, color="#6c9bd2")
    ax1.set_xticks(range(len(names)), names, rotation=30, ha="right")
    lo = min(m - s for m, s in zip(means, stds))
    hi = max(m + s for m, s in zip(means, stds))
    pad = max(1e-3, 0.5 * (hi - lo))
    ax1.set_ylim(lo - pad, hi + pad)
    ax1.set_ylabel("validation loss (nats/byte)")
    ax1.set_title("final validation loss, mean ± std over seeds")
    for k in names:
        if any(len(r.train_losses) < 2 for r in results[k]):
            continue  # merged from final numbers only: no curve
        curves = torch.tensor([r.train_losses for r in results[k]])
        mean = curves.mean(0)
        w = max(1, len(mean) // 40)
        if w > 1:
            mean = torch.nn.functional.avg_pool1d(mean[None, None], w, stride=1).flatten()
        ax2.plot(range(w - 1, w - 1 + len(mean)), mean.tolist(), label=k, lw=1.2)
    ax2.set_xlabel("step")
    ax2.set_ylabel("training loss (smoothed, mean of seeds)")
    ax2.set_title("training curves")
    last = [statistics.fmean(r.final_train for r in results[k]) for k in names]
    ax2.set_ylim(min(last) - 0.3, min(last) + 1.5)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _to_json(results: dict[str, list[RunResult]]) -> list[dict]:
    return [
        dict(variant=r.variant.name, seed=r.seed, new_params=r.new_params, model_params=r.model_params,
             init_error=r.init_error, step_time=r.step_time, train_losses=r.train_losses,
             val_points=[list(p) for p in r.val_points], convert_time=r.convert_time, tokens=r.tokens)
        for rs in results.values() for r in rs
    ]


def _from_json(rows: list[dict], order: list[str]) -> dict[str, list[RunResult]]:
    results: dict[str, list[RunResult]] = {name: [] for name in order}
    for d in sorted(rows, key=lambda d: d["seed"]):
        d = dict(d)
        name = d.pop("variant")
        d["val_points"] = [tuple(p) for p in d["val_points"]]
        results.setdefault(name, []).append(RunResult(variant=VARIANTS[name], **d))
    return {k: v for k, v in results.items() if v}


def _run_parallel(args: argparse.Namespace, argv: list[str]) -> dict[str, list[RunResult]]:
    """One subprocess per seed (at most --jobs at a time), each saving its runs as JSON; merged here."""
    import json
    import shutil
    import subprocess
    import tempfile

    base = [a for a in argv if a != "--jobs" and not a.startswith("--jobs=")]
    if "--jobs" in argv:  # drop the value that followed --jobs
        i = argv.index("--jobs")
        base = argv[:i] + argv[i + 2:]
    pending = list(range(args.seeds))
    running: list[subprocess.Popen] = []
    failed = []
    tmp = Path(tempfile.mkdtemp(prefix="bench-quality-"))
    done = False
    try:
        while pending or running:
            while pending and len(running) < args.jobs:
                seed = pending.pop(0)
                cmd = [sys.executable, "-m", "bench.quality", *base, "--seed-only", str(seed),
                       "--save-runs", str(tmp / f"seed{seed}.json")]
                running.append(subprocess.Popen(cmd))
            time.sleep(1.0)
            for p in [p for p in running if p.poll() is not None]:
                running.remove(p)
                if p.returncode != 0:
                    failed.append(p.args)
        if failed:
            raise DepthRewriteError(f"{len(failed)} seed job(s) failed: {failed}")
        rows = [row for f in sorted(tmp.glob("seed*.json")) for row in json.loads(f.read_text())]
        done = True
    finally:
        # Ctrl-C or an error: stop the workers still running, then keep what they saved (a worker saves after every
        # run) for --merge, or remove the folder
        for p in running:
            p.terminate()
        for p in running:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        saved = [] if done else sorted(tmp.glob("seed*.json"))
        if saved:
            print(f"bench.quality: the runs finished so far are kept in {tmp}; write a report from them with "
                  f"--merge {' '.join(map(str, saved))}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return _from_json(rows, [v.name for v in parse_variants(args.schemes)])


def _load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def _load_text(load: tuple | None) -> str:
    """The measured 1-minute load average at the start and the end of the run, against the core count."""
    import math

    if load is None:
        return "The load average was not measured (report merged from runs saved earlier)."
    if not all(math.isfinite(x) for x in load):
        return "The load average could not be read on this platform."
    cores = os.cpu_count() or 1
    text = (f"Load average (1 minute, this run's own processes included) {load[0]:.1f} at the start and "
            f"{load[1]:.1f} at the end, on {cores} core(s)")
    if max(load) > cores:
        return text + ": more runnable processes than cores, so step times are inflated and comparable only within this table."
    return text + ": step times are indicative and comparable only within this table."


def _preset(argv: list[str]) -> tuple[str, list[str]]:
    """``--preset NAME`` (or ``--preset=NAME``) out of ``argv``: (name, the other arguments)."""
    for i, a in enumerate(argv):
        if a == "--preset" and i + 1 < len(argv):
            return argv[i + 1], argv[:i] + argv[i + 2:]
        if a.startswith("--preset="):
            return a.split("=", 1)[1], argv[:i] + argv[i + 1:]
    return "small", argv


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few steps on a tiny model: the CI smoke test")
    ap.add_argument("--out", type=Path, default=None,
                    help="results Markdown file (default: docs/results.md; with --quick: bench-quality-quick/results.md)")
    ap.add_argument("--schemes", default=DEFAULT_SCHEMES, help=f"comma-separated (default: {DEFAULT_SCHEMES})")
    for k in FULL:
        ap.add_argument(f"--{k}", type=int, default=None, help=f"default {FULL[k]} ({QUICK[k]} with --quick)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: steadier step times on a shared machine)")
    ap.add_argument("--max-bytes", type=int, default=None, help="cap each corpus split (default: whole stdlib)")
    ap.add_argument("--jobs", type=int, default=1, help="seeds trained in parallel processes (default 1)")
    ap.add_argument("--merge", type=Path, nargs="+", default=None, metavar="RUNS.json",
                    help="write the report from runs saved earlier (results_runs.json or --save-runs files); no training")
    ap.add_argument("--note", default="", help="a sentence added to the report's conditions (how the runs were made)")
    ap.add_argument("--seed-only", type=int, default=None, help=argparse.SUPPRESS)  # a --jobs worker: one seed
    ap.add_argument("--save-runs", type=Path, default=None, help=argparse.SUPPRESS)  # ... saved as JSON, no report
    ap.add_argument("--preset", choices=("small", "depth"), default="small",
                    help="small: this study (default); depth: 12 layers, 1M tokens, compiled (bench/quality_depth.py, "
                         "its own options)")
    argv = list(sys.argv[1:] if argv is None else argv)
    preset, rest = _preset(argv)
    if preset == "depth":
        from bench import quality_depth

        return quality_depth.main(rest)
    args = ap.parse_args(argv)
    base = QUICK if args.quick else FULL
    for k, v in base.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.quick and args.max_bytes is None:
        args.max_bytes = 2_000_000
    if args.out is None:
        args.out = Path("bench-quality-quick/results.md") if args.quick else Path("docs/results.md")
    try:
        if args.seeds < 1:
            raise ConfigError(f"--seeds must be >= 1, got {args.seeds}")
        torch.set_num_threads(max(1, args.threads))
        start = time.perf_counter()
        load0 = _load()

        def report(results, measured=True):  # rewritten after every seed: an interrupted run still leaves its complete seeds
            load = (load0, _load()) if measured else None  # merged runs: their load was not measured here
            write_report(results, args, time.perf_counter() - start, load, args.out)
            args.out.with_name(args.out.stem + "_runs.json").write_text(json.dumps(_to_json(results)))

        if args.merge:
            rows = [row for f in args.merge for row in json.loads(f.read_text())]
            report(_from_json(rows, [v.name for v in parse_variants(args.schemes)]), measured=False)
        elif args.save_runs is not None:  # a --jobs worker
            args.save_runs.write_text(json.dumps(_to_json(run(args))))
        elif args.jobs > 1:
            report(_run_parallel(args, argv))
        else:
            run(args, after_seed=report)
    except DepthRewriteError as e:
        print(f"bench.quality: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
