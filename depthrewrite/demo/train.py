"""A small, deterministic training loop shared by ``depthrewrite demo`` and ``python -m bench.quality``.

It trains a byte-level causal LM (any model whose output is logits or has ``.logits``) on a :class:`~depthrewrite.demo.corpus.Corpus`,
original or converted, with AdamW, warmup + cosine decay and gradient clipping, and records the losses and step time::

    variants = parse_variants("vanilla,attnres,mhc")
    result = train_variant(lambda: hf_model("llama", seed=0), variants[1], corpus, TrainConfig(steps=100), seed=0)
"""

from __future__ import annotations

import copy
import math
import os
import statistics
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ConfigError, TrainingError
from ..passes.rewrite.registry import schemes

__all__ = [
    "tiny_llama", "Variant", "VANILLA", "VARIANTS", "default_variants", "parse_variants", "TrainConfig", "RunResult",
    "StepTiming", "train_variant", "time_steps", "time_interleaved", "StepTimer", "logits_of", "evaluate",
]


def tiny_llama(seed: int = 0, layers: int = 4, hidden: int = 64) -> nn.Module:
    """The built-in model of the demo and the quality benchmark: a Hugging Face ``LlamaForCausalLM`` from a small
    config (byte vocabulary 256, ``layers`` blocks = 2·layers sublayers, GQA with hidden/16 heads), random weights
    drawn from ``seed``. Nothing is downloaded."""
    from ..zoo import hf_model

    return hf_model("llama", layers=layers, hidden=hidden, seed=seed)


@dataclass(frozen=True)
class Variant:
    """One model to train: the original (``scheme=None``) or a conversion with its options."""

    name: str  # command-line name, e.g. "block-attnres"
    label: str  # table label, e.g. "Block AttnRes (4 blocks)"
    scheme: str | None
    options: dict[str, Any] = field(default_factory=dict)
    #: tolerance of the init-equivalence check (max|Δlogits| / max|logits|), None where the scheme is not
    #: function-preserving with these options
    init_tol: float | None = 1e-5
    note: str = ""


VANILLA = Variant("vanilla", "Vanilla (PreNorm residual)", None, init_tol=None)


class _Variants(Mapping):
    """Every variant the demo and the quality benchmark know, in table order: the original model, then each
    registered scheme's ``Scheme.variants`` in registration order. Read from the registry on every lookup, so a scheme
    registered after import is here too."""

    def _all(self) -> dict[str, Variant]:
        out = {VANILLA.name: VANILLA}
        for s in schemes().values():
            for v in s.variants:
                out[v.key] = Variant(v.key, v.label, s.name, dict(v.options), init_tol=v.init_tol, note=v.note)
        return out

    def __getitem__(self, name: str) -> Variant:
        return self._all()[name]

    def __iter__(self):
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())

    def __repr__(self) -> str:
        return f"VARIANTS({', '.join(self)})"


#: every variant the demo and the quality benchmark know, in table order (see :class:`_Variants`)
VARIANTS: Mapping[str, Variant] = _Variants()


def default_variants() -> str:
    """The variants ``depthrewrite demo`` trains unless told otherwise: the original, then every registered variant
    with ``demo=True`` (comma-separated, for ``--schemes``)."""
    return ",".join([VANILLA.name] + [v.key for s in schemes().values() for v in s.variants if v.demo])


def parse_variants(text: str | list[str] | tuple[str, ...]) -> list[Variant]:
    """``"vanilla,attnres"`` (or ``"all"``) -> variants, in the order given; unknown names raise :class:`ConfigError`."""
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    if names == ["all"]:
        return list(VARIANTS.values())
    if not names:
        raise ConfigError(f"no schemes given; choose from: {', '.join(VARIANTS)} (or 'all')")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ConfigError(f"unknown scheme(s) {', '.join(map(repr, unknown))}; choose from: {', '.join(VARIANTS)} (or 'all')")
    if len(set(names)) != len(names):
        raise ConfigError(f"scheme listed twice in {','.join(names)}")
    return [VARIANTS[n] for n in names]


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 150
    batch: int = 16
    seq: int = 128
    lr: float = 3e-3
    warmup: int = 10  # linear warmup steps, then cosine decay to lr * min_lr_ratio
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    eval_every: int = 0  # validation loss every N steps (0: only at the end)
    eval_batches: int = 8
    #: the step time: after training, ``time_warmup`` untimed then ``timed_steps`` timed steps on one batch, weights and
    #: optimizer state restored afterwards (so every variant is timed warm, and training is unchanged)
    time_warmup: int = 3
    timed_steps: int = 10
    #: torch threads while timing (None: as set). One thread by default: on a shared or busy CPU, multi-threaded ops
    #: stall on their busiest thread and the times jump by several times from one variant to the next
    time_threads: int | None = 1
    #: train through ``torch.compile`` (the ``depthrewrite`` backend for a converted model, inductor for the original);
    #: each training step's seconds are kept (``RunResult.train_step_times``), the first one includes the compile
    compile: bool = False

    def __post_init__(self):
        for name in ("steps", "batch", "seq", "eval_batches", "timed_steps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.time_threads is not None and (not isinstance(self.time_threads, int) or self.time_threads < 1):
            raise ConfigError(f"time_threads must be None or an integer >= 1, got {self.time_threads!r}")
        if not isinstance(self.time_warmup, int) or self.time_warmup < 0:
            raise ConfigError(f"time_warmup must be an integer >= 0, got {self.time_warmup!r}")

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        t = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


@dataclass(frozen=True)
class StepTiming:
    """How a step time was measured: median of ``timed`` training steps (forward, backward, clip, AdamW) of
    ``batch`` x ``seq`` after ``warmup`` untimed ones, on ``device`` with ``threads`` torch threads."""

    warmup: int
    timed: int
    batch: int
    seq: int
    threads: int
    device: str = "cpu"
    load: float | None = None  # 1-minute load average when timed (None: unknown)
    interleaved: bool = False  # several models timed in turns, one step each per round

    def describe(self) -> str:
        load = f", load average {self.load:.1f}" if self.load is not None else ""
        return (f"median of {self.timed} timed training steps (forward, backward, AdamW) of {self.batch} x {self.seq} "
                f"after {self.warmup} untimed warm-up steps, {self.device}, {self.threads} torch threads{load}")


@dataclass
class RunResult:
    variant: Variant
    seed: int
    new_params: int
    model_params: int
    init_error: float | None  # max|Δlogits| / max|logits| against the original at init (None for vanilla)
    step_time: float  # median seconds per eager training step, measured warm (see ``timing``)
    train_losses: list[float]
    val_points: list[tuple[int, float]]  # (step, validation loss)
    convert_time: float = 0.0
    tokens: int = 0
    model: nn.Module | None = field(default=None, repr=False)  # the trained model, with keep_model=True
    timing: StepTiming | None = None  # how step_time was measured (None: loaded from an older record)
    timer: StepTimer | None = field(default=None, repr=False)  # with time_later=True, until the caller has timed it
    #: median seconds per training step of ``torch.compile(model)`` (inductor; a converted model with the
    #: ``depthrewrite`` backend), timed like ``step_time`` with the compile in the warm-up; None: not timed
    compiled_step_time: float | None = None
    #: seconds of every training step, in order (the first ones include captures and, with ``TrainConfig.compile``,
    #: the compile); empty in older records
    train_step_times: list[float] = field(default_factory=list)

    @property
    def final_train(self) -> float:
        """Mean training loss over the last 10% of steps (at least one)."""
        k = max(1, len(self.train_losses) // 10)
        return statistics.fmean(self.train_losses[-k:])

    @property
    def final_val(self) -> float:
        return self.val_points[-1][1]

    @property
    def init_ok(self) -> bool | None:
        tol = self.variant.init_tol
        if tol is None or self.init_error is None:
            return None
        return self.init_error <= tol


def logits_of(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = logits_of(model(x))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean cross-entropy (nats per byte) over ``batches``, in eval mode; restores the previous mode."""
    was = model.training
    model.eval()
    try:
        return statistics.fmean(_loss(model, x, y).item() for x, y in batches)
    finally:
        model.train(was)


def time_steps(step: Callable[[], Any], warmup: int, timed: int) -> list[float]:
    """Call ``step()`` ``warmup`` times untimed (first-call costs: allocator, thread pools, caches), then ``timed``
    times; the seconds of each timed call."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(timed):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return times


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # pragma: no cover - not on every platform
        return None


def _progress(total: int, desc: str, enabled: bool | None):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the viz/dev extras
        return None
    # disable=None: a bar on a terminal, nothing when stderr is not a TTY (CI logs)
    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True, disable=None if enabled is None else not enabled)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, clip: float) -> torch.Tensor:
    loss = _loss(model, x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return loss


class StepTimer:
    """Times training steps of one trained model on one batch; :meth:`close` restores its weights and optimizer state,
    so the timed steps do not change the result of training."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, cfg: TrainConfig,
                 run: nn.Module | None = None):
        self.model, self.opt, self.x, self.y, self.cfg = model, opt, x, y, cfg
        self.run = model if run is None else run  # what a step calls (a compiled wrapper of ``model``)
        self.weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.state = copy.deepcopy(opt.state_dict())

    def compiled(self, backend: str) -> "StepTimer":
        """A timer of the same model, batch and optimizer whose steps call ``torch.compile(model, backend=backend)``
        (the first step compiles: keep it in the warm-up)."""
        return StepTimer(self.model, self.opt, self.x, self.y, self.cfg, run=torch.compile(self.model, backend=backend))

    def step(self) -> float:
        t = time.perf_counter()
        _train_step(self.run, self.opt, self.x, self.y, self.cfg.grad_clip)
        return time.perf_counter() - t

    def close(self) -> None:
        self.model.load_state_dict(self.weights)
        self.opt.load_state_dict(self.state)
        self.opt.zero_grad(set_to_none=True)


def time_interleaved(timers: list[StepTimer], cfg: TrainConfig) -> tuple[list[float], StepTiming]:
    """Median step time of every timer, measured warm and in turns: ``time_warmup`` untimed steps each, then
    ``timed_steps`` rounds of one timed step per model, on ``time_threads`` threads. Taking turns spreads a change of
    the machine's load over every model, instead of landing on whichever was being timed (the first steps of a process
    or a model pay one-off costs; with several threads on a busy CPU, ops stall on their slowest thread)."""
    threads = torch.get_num_threads()
    times: list[list[float]] = [[] for _ in timers]
    try:
        if cfg.time_threads:
            torch.set_num_threads(cfg.time_threads)
        used = torch.get_num_threads()
        for timer in timers:
            time_steps(timer.step, cfg.time_warmup, 0)
        for _ in range(cfg.timed_steps):
            for i, timer in enumerate(timers):
                times[i].append(timer.step())
    finally:
        torch.set_num_threads(threads)
        for timer in timers:
            timer.close()
    x = timers[0].x if timers else torch.empty(0, 0)
    device = next((p.device.type for p in timers[0].model.parameters()), "cpu") if timers else "cpu"
    timing = StepTiming(warmup=cfg.time_warmup, timed=cfg.timed_steps, batch=x.shape[0], seq=x.shape[1],
                        threads=used, device=device, load=_load(), interleaved=len(timers) > 1)
    return [statistics.median(t) for t in times], timing


def train_variant(
    build: Callable[[int], nn.Module],
    variant: Variant,
    corpus,
    cfg: TrainConfig,
    seed: int = 0,
    progress: bool | None = None,
    keep_model: bool = False,
    time_later: bool = False,
) -> RunResult:
    """Build the model with ``build(seed)``, convert it (unless vanilla), check init equivalence, train and evaluate.

    Every variant with the same ``seed`` starts from the same original weights and sees the same batches in the same
    order: the comparison is at matched steps and tokens.
    """
    from .. import api

    torch.manual_seed(seed)
    original = build(seed)
    eval_set = corpus.eval_batches(cfg.eval_batches, cfg.batch, cfg.seq)
    init_error = None
    t0 = time.perf_counter()
    if variant.scheme is None:
        model, new_params = original, 0
    else:
        torch.manual_seed(seed)  # schemes with random init (mHC's phi) draw the same numbers for every run of a seed
        model = api.convert(original, variant.scheme, inplace=False, **variant.options)
        new_params = model.report().new_params
        original.eval()
        model.eval()
        with torch.no_grad():
            x = eval_set[0][0][:4]
            ref, out = logits_of(original(x)), logits_of(model(x))
            init_error = ((out - ref).abs().max() / ref.abs().max()).item()
    convert_time = time.perf_counter() - t0
    model_params = sum(p.numel() for p in original.parameters())

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(10_000 + seed)
    model.train()
    run = model
    if cfg.compile:
        run = torch.compile(model, backend="inductor" if variant.scheme is None else "depthrewrite")
    losses: list[float] = []
    step_times: list[float] = []
    val_points: list[tuple[int, float]] = []
    bar = _progress(cfg.steps, variant.name if seed == 0 else f"{variant.name} (seed {seed})", progress)
    try:
        for step in range(cfg.steps):
            x, y = corpus.batch("train", cfg.batch, cfg.seq, gen)
            for group in opt.param_groups:
                group["lr"] = cfg.lr_at(step)
            t_step = time.perf_counter()
            loss = _train_step(run, opt, x, y, cfg.grad_clip)
            losses.append(loss.item())
            step_times.append(time.perf_counter() - t_step)
            if not math.isfinite(losses[-1]):
                raise TrainingError(
                    f"training {variant.name} (seed {seed}) diverged: the loss became {losses[-1]} at step {step + 1} of "
                    f"{cfg.steps} (learning rate {cfg.lr_at(step):.2g}, peak {cfg.lr:g}). Try a lower learning rate "
                    "(TrainConfig.lr; bench.quality --lr), a longer warmup, or fewer steps",
                    variant=variant.name, step=step + 1,
                )
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
                val_points.append((step + 1, evaluate(model, eval_set)))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    finally:
        if bar is not None:
            bar.close()
    timer = StepTimer(model, opt, x, y, cfg)
    if time_later:  # the caller times every variant in turns (time_interleaved) and fills in step_time
        step_time, timing = float("nan"), None
    else:
        (step_time,), timing = time_interleaved([timer], cfg)
        timer = None
    val_points.append((cfg.steps, evaluate(model, eval_set)))
    return RunResult(
        variant=variant,
        seed=seed,
        new_params=new_params,
        model_params=model_params,
        init_error=init_error,
        step_time=step_time,
        timing=timing,
        train_losses=losses,
        val_points=val_points,
        convert_time=convert_time,
        tokens=cfg.steps * cfg.batch * cfg.seq,
        model=model if keep_model else None,
        timer=timer,
        train_step_times=step_times,
    )
