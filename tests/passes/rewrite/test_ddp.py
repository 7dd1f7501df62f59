"""A converted model trains under DistributedDataParallel: 2 processes, gloo on CPU, file rendezvous, torn down."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, init_file: str, result_file: str, scheme: str) -> None:
    import depthrewrite as dr
    from depthrewrite.testing import nanogpt

    torch.manual_seed(0)  # same weights on both ranks
    conv = dr.convert(nanogpt(n_layer=2, n_embd=32), scheme)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(conv)
        torch.manual_seed(rank)  # different data per rank
        idx = torch.randint(0, 256, (2, 8))
        loss = ddp(idx).float().pow(2).mean()
        loss.backward()
        g = torch.cat([p.grad.flatten() for n, p in conv.named_parameters() if n.startswith("depthrewrite.")])
        gathered = [torch.zeros_like(g) for _ in range(world)]
        dist.all_gather(gathered, g)
        if rank == 0:
            torch.save(gathered, result_file)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("scheme", ["attnres", "msar", "mhc", "moda"])
def test_ddp_two_processes(tmp_path, scheme):
    init_file, result_file = str(tmp_path / "rdzv"), str(tmp_path / "grads.pt")
    mp.start_processes(_worker, args=(2, init_file, result_file, scheme), nprocs=2, join=True, start_method="spawn")
    g0, g1 = torch.load(result_file)
    torch.testing.assert_close(g0, g1)  # gradients were all-reduced
    assert g0.abs().sum() > 0
