"""``depthrewrite demo``: the whole pipeline on an embedded default, with nothing to download.

A small Llama (Hugging Face ``LlamaForCausalLM`` from a built-in config, random weights) is inspected, converted into
every scheme, checked for init equivalence where the scheme preserves the function, and trained byte-level on the
Python standard library's own source files for a fixed number of steps. The demo prints the chain and a results
table, and writes into the output folder:

* ``results.md``       the table (scheme, new parameters, step time, final train and validation loss, init check)
* ``loss_curves.png``  training and validation loss of every variant (matplotlib, Agg)
* ``rewritten_<scheme>.svg`` / ``.png`` / ``.txt``  the rewritten graph of one scheme (drawn by Graphviz when it is
  installed, else by matplotlib; ``.dot`` only when neither is)
* ``chain.txt``, ``chain.svg`` (or ``chain.dot``)  the detected chain of the original model
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tabulate import tabulate

from .. import api
from .corpus import Corpus
from ..errors import ConfigError
from ..passes.rewrite.registry import schemes
from .train import (RunResult, TrainConfig, Variant, default_variants, parse_variants, time_interleaved, tiny_llama,
                    train_variant)

__all__ = ["DEMO_SCHEMES", "DemoConfig", "run_demo", "results_table", "timing_note"]

#: the default variants: the original, then every registered variant marked ``demo`` (``SchemeVariant.demo``; MSAR
#: as Block MSAR only, the cheaper of the two on CPU); all of them: --schemes all
DEMO_SCHEMES = default_variants()


def _draw_preference() -> list[str]:
    """The variants whose rewritten graph may be drawn, best first: schemes in registration order, and within a
    scheme its Block form first (its graph shows the block sums as well as the mixing sites)."""
    ranked = [(i, "blocks" not in v.options, k, v.key)
              for i, s in enumerate(schemes().values()) for k, v in enumerate(s.variants)]
    return [key for *_, key in sorted(ranked)]


@dataclass
class DemoConfig:
    out: Path = Path("depthrewrite-demo")
    steps: int = 120
    schemes: str = DEMO_SCHEMES
    batch: int = 16
    seq: int = 128
    layers: int = 4
    hidden: int = 64
    lr: float = 3e-3
    seed: int = 0
    eval_every: int = 30
    eval_batches: int = 4
    progress: bool | None = None  # None: a progress bar when stderr is a terminal
    corpus_dir: Path | None = None  # default: the standard library
    #: which step times the table shows: "compiled" (torch.compile; what a user training the model would run),
    #: "eager", or "both" (the default: two labelled columns)
    timing: str = "both"
    written: list[Path] = field(default_factory=list)


def _init_check(r: RunResult) -> str:
    v = r.variant
    if v.scheme is None:
        return "— (original)"
    if v.init_tol is None:
        return f"Δ {r.init_error:.1e}: not function-preserving ({v.note or 'by design'})"
    mark = "✓" if r.init_ok else "✗ FAILED"
    what = "same function" if v.init_tol <= 1e-5 else "close"
    return f"{mark} {what} (Δ {r.init_error:.1e} ≤ {v.init_tol:.0e})"


TIMINGS = ("both", "compiled", "eager")


def _compiled_cells(results: list[RunResult]) -> bool:
    return any(r.compiled_step_time is not None for r in results)


def timing_note(results: list[RunResult]) -> str:
    """The conditions of the table's step times, as one footnote line."""
    timings = [r.timing for r in results if r.timing is not None]
    if not timings:
        return "* step (ms): median training step time on this machine (conditions not recorded)"
    eager = any(r.step_time == r.step_time for r in results)  # NaN: not timed eagerly
    which = ("* eager / compiled (ms)" if eager and _compiled_cells(results) else
             "* compiled (ms)" if _compiled_cells(results) else "* step (ms), eager")
    compiled = (" Compiled: `torch.compile(model)` (inductor; the converted models with `backend='depthrewrite'`), "
                "the compile in the first warm-up step, not timed." if _compiled_cells(results) else
                " Eager only: a compiled step costs less, most for the schemes with the most small ops (mHC, MSAR).")
    t = timings[0]
    loads = [x.load for x in timings if x.load is not None]
    load = "" if not loads else (f", load average {min(loads):.1f}" if max(loads) - min(loads) < 0.05
                                 else f", load average {min(loads):.1f}-{max(loads):.1f}")
    return (f"{which}: median of {t.timed} timed training steps (forward, backward, AdamW) of {t.batch} x {t.seq} "
            f"tokens after {t.warmup} untimed warm-up steps, "
            + ("the variants timed in turns (one step each per round) after training; " if t.interleaved
               else "every variant timed the same way after its training; ")
            + f"{t.device}, {t.threads} torch thread{'s' if t.threads != 1 else ''}{load}.{compiled} Times are this "
            "machine's, and move with its load.")


def _ms(t: float | None) -> str:
    return "—" if t is None or t != t else f"{1000 * t:.0f}"


def results_table(results: list[RunResult], fmt: str = "simple") -> str:
    """The results table, with the footnote that says how the step times were measured."""
    eager = any(r.step_time == r.step_time for r in results)  # NaN: not timed eagerly
    compiled = _compiled_cells(results)
    times = ([("eager (ms)*", lambda r: r.step_time)] if eager else []) + (
        [("compiled (ms)*", lambda r: r.compiled_step_time)] if compiled else [])
    if len(times) == 1 and not compiled:
        times = [("step (ms)*", lambda r: r.step_time)]
    rows = [
        [r.variant.name, f"{r.new_params:,}", *(_ms(get(r)) for _, get in times), f"{r.final_train:.3f}",
         f"{r.final_val:.3f}", _init_check(r)]
        for r in results
    ]
    headers = ["scheme", "new params", *(h for h, _ in times), "train loss", "val loss", "init check"]
    table = tabulate(rows, headers=headers, tablefmt=fmt, disable_numparse=True)
    return f"{table}\n\n{timing_note(results)}"


def _plot_losses(results: list[RunResult], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, r in enumerate(results):
        colour = f"C{i}"
        losses = r.train_losses
        w = max(1, len(losses) // 25)
        smooth = [sum(losses[max(0, j - w + 1): j + 1]) / len(losses[max(0, j - w + 1): j + 1]) for j in range(len(losses))]
        ax.plot(range(1, len(losses) + 1), smooth, color=colour, lw=1.3, label=f"{r.variant.name} (train)")
        steps, vals = zip(*r.val_points)
        ax.plot(steps, vals, "o--", color=colour, ms=4, lw=0.8, label=f"{r.variant.name} (val)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    best = min(r.final_train for r in results)
    ax.set_ylim(best - 0.3, min(6.0, best + 2.5))
    ax.set_title("depthrewrite demo: tiny Llama on the Python standard library")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _save_chain(report, out: Path, say: Callable[[str], None]) -> list[Path]:
    written = [out / "chain.txt"]
    (out / "chain.txt").write_text(str(report) + "\n")
    try:
        written.append(report.save(out / "chain.svg"))
    except ConfigError as e:
        written.append(report.save(out / "chain.dot"))
        say(f"(chain diagram as .dot: {e})")
    return written


def _save_rewritten(model, name: str, out: Path, say: Callable[[str], None]) -> list[Path]:
    from ..views.draw import save_rewritten

    written = [save_rewritten(model, out / f"rewritten_{name}.txt")]
    try:  # Graphviz when installed, else matplotlib
        for suffix in (".svg", ".png"):
            written.append(save_rewritten(model, out / f"rewritten_{name}{suffix}"))
    except ConfigError as e:
        written.append(save_rewritten(model, out / f"rewritten_{name}.dot"))
        say(f"(rewritten graph as text and .dot: {e})")
    return written


def run_demo(cfg: DemoConfig, say: Callable[[str], None] = print) -> list[RunResult]:
    """Run the demo; ``say`` receives every line of the console report. Returns one result per variant."""
    start = time.perf_counter()
    if cfg.timing not in TIMINGS:
        raise ConfigError(f"timing must be one of {', '.join(TIMINGS)}, got {cfg.timing!r}")
    variants: list[Variant] = parse_variants(cfg.schemes)
    train_cfg = TrainConfig(
        steps=cfg.steps, batch=cfg.batch, seq=cfg.seq, lr=cfg.lr, warmup=max(1, min(10, cfg.steps // 10)),
        eval_every=cfg.eval_every, eval_batches=cfg.eval_batches,
    )
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def build(seed: int):
        return tiny_llama(seed, cfg.layers, cfg.hidden)

    model = build(cfg.seed)
    report = api.inspect(model)
    say(f"== the model: a {type(model).__name__} from a built-in config ({sum(p.numel() for p in model.parameters()):,} "
        "parameters, random init, byte vocabulary) ==")
    say(str(report))
    written += _save_chain(report, out, say)

    corpus = Corpus.from_dir(cfg.corpus_dir) if cfg.corpus_dir is not None else Corpus.stdlib()
    say("")
    say(f"== the corpus: {corpus} ==")
    say(f"== training {len(variants)} variants for {cfg.steps} steps of {cfg.batch} x {cfg.seq} bytes each "
        f"(same init, same batches) ==")

    # only the variant whose rewritten graph is drawn keeps its trained model (until it is drawn)
    draw = next((name for name in _draw_preference() for v in variants if v.name == name), None)
    results: list[RunResult] = []
    for v in variants:
        r = train_variant(build, v, corpus, train_cfg, seed=cfg.seed, progress=cfg.progress, keep_model=v.name == draw,
                          time_later=True)
        results.append(r)
        what = "original model" if v.scheme is None else f"{v.label}: {r.new_params:,} new parameters, {_init_check(r)}"
        say(f"  {v.name:<14} {what}; val loss {r.final_val:.3f}")

    # every variant's step time, measured in turns: a change of the machine's load lands on all of them alike
    timers = [r.timer for r in results]
    if cfg.timing in ("both", "eager"):
        times, timing = time_interleaved(timers, train_cfg)
        for r, t in zip(results, times):
            r.step_time, r.timing = t, timing
    if cfg.timing in ("both", "compiled"):
        say(f"== compiling {len(results)} variants for their compiled step times (torch.compile: tens of seconds "
            "each on a CPU) ==")
        import torch._dynamo

        # every variant is one more compile of the same forward code (and Block schemes one per block program):
        # above Dynamo's recompile limit it would run eagerly and time the wrong thing, so raise it and fail instead
        strict = not torch._dynamo.config.suppress_errors  # Dynamo takes the two flags only one at a time
        if not strict:
            say("(torch._dynamo.config.suppress_errors is on: a variant Dynamo fails on runs eagerly in the compiled "
                "column)")
        try:
            compiled = [t.compiled("inductor" if r.variant.scheme is None else "depthrewrite")
                        for r, t in zip(results, timers)]
            with torch._dynamo.config.patch(recompile_limit=max(64, torch._dynamo.config.recompile_limit),
                                            fail_on_recompile_limit_hit=strict):
                times, timing = time_interleaved(compiled, train_cfg)  # the first warm-up step of each compiles
        except Exception as e:  # noqa: BLE001 - the trained results stand; the table says what is missing
            first = (str(e).strip().splitlines() or [""])[0][:300]
            say(f"(no compiled step times: torch.compile failed: {type(e).__name__}: {first})")
        else:
            for r, t in zip(results, times):
                r.compiled_step_time, r.timing = t, r.timing or timing
    for r in results:
        r.timer = None

    say("")
    table = results_table(results)
    say(table)
    md = results_table(results, fmt="github")
    plot = out / "loss_curves.png"
    plot.unlink(missing_ok=True)  # a plot left by an earlier run would be linked below as if it were this run's
    try:
        written.append(_plot_losses(results, plot))
    except ImportError:
        say("(matplotlib is not installed: no loss_curves.png; `pip install 'depthrewrite[viz]'`)")
    picture = f"\n\n![loss curves]({plot.name})" if plot.exists() else ""
    (out / "results.md").write_text(
        f"# depthrewrite demo\n\nTiny Llama ({cfg.layers} blocks, hidden {cfg.hidden}), {corpus}; {cfg.steps} steps of "
        f"{cfg.batch} x {cfg.seq} bytes per variant, seed {cfg.seed}. Losses in nats per byte.\n\n{md}{picture}\n"
    )
    written.append(out / "results.md")
    drawn = next((r for r in results if r.variant.name == draw), None)
    if drawn is not None:
        written += _save_rewritten(drawn.model, drawn.variant.name, out, say)
        drawn.model = None  # do not keep the model alive past the demo
    say("")
    say(f"wrote {', '.join(str(p) for p in written)}")
    say(f"demo finished in {time.perf_counter() - start:.0f} s")
    cfg.written = written
    return results
