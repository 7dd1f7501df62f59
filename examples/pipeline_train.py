"""Train a Block AttnRes Llama with pipeline parallelism: 2 stages, 2 gloo processes on CPU, Schedule1F1B.

    torchrun --nproc_per_node=2 examples/pipeline_train.py     # the documented launcher
    python examples/pipeline_train.py [--out DIR]              # spawns its own 2 processes (file rendezvous)

Every rank converts the same model (same seed), takes its stage from depthrewrite.pipeline.stages() and trains it
with its own optimiser; rank 0 feeds the micro-batches, the last rank computes the loss. What crosses the boundary
(the completed block summaries and the open partial sum) is printed from the conversion report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def train(rank: int, world: int, args) -> None:
    import depthrewrite as dr
    from depthrewrite import pipeline as pp
    from depthrewrite.demo.zoo import hf_model
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same weights on every rank
    conv = dr.convert(hf_model("llama", layers=args.layers, hidden=args.hidden), "attnres", blocks=args.layers,
                      pipeline_stages=world)
    if rank == 0:
        print(conv.report().pipeline, flush=True)
    n_mb, mb = args.microbatches, args.microbatch
    g = torch.Generator().manual_seed(1)
    mods = pp.stages(conv, world, (torch.zeros(mb, args.seq, dtype=torch.long),))  # static micro-batch shape
    stage = PipelineStage(mods[rank], rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=n_mb, loss_fn=loss_fn)
    opt = torch.optim.AdamW(mods[rank].parameters(), lr=3e-3)
    history = []
    for step in range(args.steps):
        # a learnable toy task: predict the next token of a repeating sequence
        start = torch.randint(0, 256, (n_mb * mb, 1), generator=g)
        seq = (start + torch.arange(args.seq + 1)) % 256
        x, y = seq[:, :-1], seq[:, 1:]
        opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        opt.step()
        if rank == world - 1:
            loss = torch.stack(losses).mean().item()
            history.append(loss)
            print(f"step {step}: loss {loss:.4f}", flush=True)
    if rank == world - 1 and args.out:
        with open(os.path.join(args.out, "pipeline_train.json"), "w") as f:
            json.dump(dict(losses=history, report=conv.report().pipeline.to_dict()), f, indent=1)
    dist.barrier()


def _worker(rank: int, world: int, init: str | None, args) -> None:
    if init is None:  # torchrun: env:// rendezvous
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    else:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        train(rank, world, args)
    finally:
        dist.destroy_process_group()


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The module docstring as the description, and every option's default in --help."""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    p.add_argument("--out", default=None, help="directory for pipeline_train.json (None: nothing is written)")
    p.add_argument("--steps", type=int, default=8, help="pipeline training steps")
    p.add_argument("--layers", type=int, default=2, help="Llama blocks")
    p.add_argument("--hidden", type=int, default=32, help="hidden size")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step")
    p.add_argument("--microbatch", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--seq", type=int, default=16, help="tokens per sequence")
    p.add_argument("--timeout", type=float, default=110.0, help="seconds before the spawned processes are stopped")
    args = p.parse_args()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        _worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, args)
        return 0
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rdzv')}"
        ctx = mp.start_processes(_worker, args=(world, init, args), nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + args.timeout
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    print(f"pipeline_train: the {world} processes did not finish in {args.timeout:.0f} s", file=sys.stderr)
                    return 1
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
