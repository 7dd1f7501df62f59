"""Multi-process tests on gloo: start ``nprocs`` spawned workers and wait for them, killing any left after a deadline
(tests/test_blocks.py, test_tensor_parallel.py, frameworks/test_fsdp_recipes.py)."""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch.multiprocessing as mp


def grad_gaps(pairs: Any) -> tuple[float, float]:
    """Over ``(got, want)`` gradient pairs (a DTensor gathered whole): the largest absolute difference, and the largest
    difference relative to its reference's largest magnitude. Many gradients of these tiny models are ~1e-5 (a norm's
    weight), so an absolute bound alone passes a gradient that is a partial sum or counted twice."""
    worst, rel = 0.0, 0.0
    for got, want in pairs:
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        d = (got - want).abs().max().item()
        worst, rel = max(worst, d), max(rel, d / max(want.abs().max().item(), 1e-12))
    return worst, rel


def record_cases(cases: dict[str, Callable[[], Any]], rank: int, out_dir: str, max_text: int | None = None) -> None:
    """In a worker: run each case (name -> no-argument callable) in this rank's process group, its result or its error
    (type and text, cut to ``max_text`` characters) recorded for the tests, with a barrier after each, and save them
    to ``out_dir/rank{rank}.pt``; the process group is destroyed after."""
    import torch
    import torch.distributed as dist

    results: dict[str, Any] = {}
    try:
        for name, run in cases.items():
            try:
                results[name] = run()
            except Exception as e:  # noqa: BLE001 - recorded, asserted by the tests
                results[name] = dict(error=type(e).__name__, text=str(e)[:max_text])
            dist.barrier()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn_ranks(worker: Callable[..., None], args: tuple, nprocs: int, timeout_s: float, what: str) -> None:
    """Run ``worker(rank, *args)`` in ``nprocs`` spawned processes; ``TimeoutError`` naming ``what`` if they take
    longer than ``timeout_s``. A worker's exception re-raises here (``ProcessRaisedException``)."""
    ctx: Any = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not finish within {timeout_s:g} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
