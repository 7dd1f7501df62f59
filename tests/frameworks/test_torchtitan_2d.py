"""torchtitan's own 2-D recipe on a converted model (issue #24 item 2): its ``parallelize_llama`` (the function its
trainer calls: the model's TP plan over the ``tp`` mesh axis, its activation checkpointing, then
``apply_fsdp_to_decoder`` over ``fsdp``) on 4 gloo ranks (dp_shard 2 × tp 2), ``spmd_backend="partial_dtensor"``.
Each data-parallel group runs half the batch; the sum of the groups' losses and every gathered gradient equal one
process on the whole batch."""

from __future__ import annotations

import copy
import importlib.util
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import depthrewrite as dr

from ..distributed import grad_gaps, record_cases, spawn_ranks

WORLD = 4
SCHEMES = ("attnres", "block-msar", "mhc", "moda")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                                reason="needs torchtitan (the `frameworks` extra)")


def _case(scheme: str) -> dict:
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.models.llama3.parallelize import parallelize_llama

    from tests.frameworks.models import build, example_inputs

    parallel_dims.device_type = "cpu"  # torchtitan picks "cuda" when it finds no accelerator
    dims = parallel_dims.ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=1, world_size=WORLD,
                                      spmd_backend="partial_dtensor")
    dims.build_mesh()
    torch.manual_seed(0)
    model, _, _ = build("torchtitan", "llama3", sharding="tp")
    model.train()
    (ids,), _ = example_inputs(model)
    full = torch.randint(0, int(ids.max()) + 1, (4, ids.shape[1]), generator=torch.Generator().manual_seed(1))
    conv = dr.convert(model, scheme, example_inputs=(full.chunk(2)[0],))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in conv.depthrewrite.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    ref = copy.deepcopy(conv)
    parallelize_llama(conv, parallel_dims=dims,
                      training=TrainingConfig(mixed_precision_param="float32", mixed_precision_reduce="float32"),
                      parallelism=ParallelismConfig(data_parallel_shard_degree=2, tensor_parallel_degree=2,
                                                    enable_sequence_parallel=False, spmd_backend="partial_dtensor"),
                      compile_config=CompileConfig(enable=False, components=[]), ac_config=FullAC.Config(),
                      dump_folder="")
    for m in conv.modules():  # gloo has no PREMUL_SUM: plain sums, the loss below is each group's share of the mean
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
            m.set_gradient_divide_factor(1.0)
    fsdp = dims.get_mesh("fsdp")
    out = conv(full.chunk(2)[fsdp.get_local_rank()])
    out = out.full_tensor() if hasattr(out, "full_tensor") else out  # its output plan shards the vocabulary
    loss = out.float().pow(2).sum() / (out.numel() * 2)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=fsdp.get_group())
    want = ref(full).float().pow(2).mean()
    want.backward()
    grads = dict(ref.named_parameters())
    worst, rel = grad_gaps((p.grad, grads[n.replace("_checkpoint_wrapped_module.", "")].grad)
                           for n, p in conv.named_parameters())
    checkpointed = sum("_checkpoint_wrapped_module" in n for n, _ in conv.named_modules())
    return dict(loss=total.item(), ref=want.item(), grad=worst, grad_rel=rel, checkpointed=checkpointed,
                dtensors=sum(type(p).__name__ == "DTensor" for p in conv.parameters()),
                module_calls=conv.__dict__["_depthrewrite"].module_calls)


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    record_cases({scheme: (lambda s=scheme: _case(s)) for scheme in SCHEMES}, rank, out_dir, max_text=2000)


def test_torchtitans_own_2d_recipe_trains_as_one_process(tmp_path):
    spawn_ranks(_worker, (str(tmp_path / "rdzv"), str(tmp_path)), WORLD, 480, "torchtitan 2-D workers")
    for r in range(WORLD):
        res = torch.load(tmp_path / f"rank{r}.pt")
        for scheme in SCHEMES:
            got = res[scheme]
            assert "error" not in got, (r, scheme, got)
            assert abs(got["loss"] - got["ref"]) <= 1e-5, (r, scheme, got)
            assert got["grad"] <= 1e-5 and got["grad_rel"] <= 1e-2, (r, scheme, got)
            assert got["module_calls"] is True and got["checkpointed"] > 0 and got["dtensors"] > 0, (r, scheme, got)
