"""Multi-process tests on gloo: start ``nprocs`` spawned workers and wait for them, killing any left after a deadline
(tests/test_blocks.py, test_tensor_parallel.py, frameworks/test_fsdp_recipes.py)."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch.multiprocessing as mp


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
