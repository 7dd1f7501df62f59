"""Train a converted model the torchtitan way: FSDP2 per block, activation checkpointing, compile per block.

    torchrun --nproc-per-node 2 examples/train_fsdp.py            # 2 processes on CPU (gloo)
    torchrun --nproc-per-node 2 examples/train_fsdp.py --compile  # and torch.compile on each block
    python examples/train_fsdp.py                                 # one process (a world of one)

A converted model calls one module per transformer block (``model.model.layers[i]``: the same objects, holding the
same parameters under the same names), so the per-block recipes apply to it unchanged: checkpoint each block, compile
each block, ``fully_shard`` each block and then the root. The depth state (Block AttnRes: the block summaries and the
partial sum) crosses the block calls as explicit inputs and outputs. See docs/training.md.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import depthrewrite as dr
from depthrewrite.demo.zoo import hf_model


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The module docstring as the description, and every option's default in --help."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    p.add_argument("--scheme", default="block-attnres", help="scheme name or alias, as depthrewrite.convert takes")
    p.add_argument("--layers", type=int, default=4, help="Llama blocks")
    p.add_argument("--steps", type=int, default=3, help="training steps")
    p.add_argument("--compile", action="store_true", help="torch.compile each block (backend='depthrewrite')")
    p.add_argument("--out", help=argparse.SUPPRESS)  # the examples test passes an output folder; nothing is written
    a = p.parse_args()

    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo")
    else:  # plain `python`: a world of one
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)

    torch.manual_seed(0)  # the same initial weights on every rank
    model = dr.convert(hf_model("llama", layers=a.layers, hidden=64).train(), a.scheme)

    # 1. activation checkpointing: each block recomputes itself in backward (HF's switch; torch's
    #    apply_activation_checkpointing on the block modules, or convert(..., checkpoint=True), work as well)
    model.activation_checkpointing_enable()
    # 2. compile each block: blocks of the same structure share their code
    if a.compile:
        for block in model.model.layers:
            block.compile(backend="depthrewrite")
    # 3. FSDP2: every block, then the root (embedding, final norm, head and the new depthrewrite parameters)
    for block in model.model.layers:
        fully_shard(block)
    fully_shard(model)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for step in range(a.steps):
        ids = torch.randint(0, model.config.vocab_size, (2 * world, 32), generator=g).chunk(world)[rank]
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            print(f"step {step}: loss {total.item() / world:.4f}")
    if rank == 0:
        print(model.report())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
