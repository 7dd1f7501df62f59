"""The frameworks' own FSDP2 recipes on their own converted models (issue #24 item 4, #25 item 2), 2 gloo ranks:
torchtitan's ``apply_fsdp_to_decoder`` (embedding, each block, norm + output, root), torchtune's ``shard_model``
(each layer plus ``tok_embeddings`` and ``output`` by name) and OLMo-core's ``Transformer.apply_fsdp`` (its
``blocks`` strategy: each block and the embeddings; its ``full`` strategy, which also shards ``lm_head``, is a typed
refusal). They shard modules that are not blocks, so the converted model runs with module calls (docs/training.md): each sharded module is called as the
live module and its FSDP2 hooks gather its parameters. One forward/backward on half the batch per rank gives the
loss and the gradients of one process on the whole batch."""

from __future__ import annotations

import copy
import importlib.util
import os
import sys
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import depthrewrite as dr

from ..distributed import spawn_ranks

WORLD = 2
SCHEMES = ["attnres", "msar", "mhc", "moda"]
# (case, framework, model name, recipe)
CASES = [
    *[(f"torchtitan-{s}", "torchtitan", "llama3", "apply_fsdp_to_decoder", s) for s in SCHEMES],
    *[(f"torchtune-{s}", "torchtune", "llama3", "shard_model", s) for s in ("attnres", "mhc")],
    *[(f"olmo_core-{s}", "olmo_core", "llama_like", "apply_fsdp:blocks", s) for s in ("attnres", "msar")],
    # its "full" strategy also shards lm_head, whose forward takes a string (loss_reduction="mean"): export cannot
    # record that call's signature, so it cannot be called as a module, and its FSDP hooks could not run
    ("olmo_core-full-attnres", "olmo_core", "llama_like", "apply_fsdp:full", "attnres"),
]
REFUSED = {"olmo_core-full-attnres": "lm_head is sharded with FSDP (fully_shard): its parameters are gathered by hooks"}
_FRAMEWORKS = {c[1] for c in CASES}
pytestmark = pytest.mark.skipif(any(importlib.util.find_spec(f) is None for f in _FRAMEWORKS),
                                reason="needs torchtitan, torchtune and OLMo-core (the `frameworks` extra)")


def _shard(model, framework: str, recipe: str, mesh) -> None:
    from torch.distributed.fsdp import FSDPModule

    if framework == "torchtitan":
        from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

        apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False)
    elif framework == "torchtune":
        from functools import partial

        from torchtune import training

        training.shard_model(model, [partial(training.get_shard_conditions, names_to_match=["tok_embeddings",
                                                                                              "output"])],
                             cpu_offload=False, dp_mesh=mesh)
    else:
        from olmo_core.nn.transformer import TransformerDataParallelWrappingStrategy as Strategy

        strategy = recipe.partition(":")[2] or "full"
        model.apply_fsdp(dp_mesh=mesh, wrapping_strategy=Strategy(strategy))
    for m in model.modules():  # gloo has no PREMUL_SUM (torchtitan divides gradients by 1.0): plain sums
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
            m.set_gradient_divide_factor(1.0)


def _case(mesh, rank: int, framework: str, name: str, recipe: str, scheme: str) -> dict:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.frameworks.models import _stubbed, build

    with _stubbed(framework):
        model, args, kwargs = build(framework, name)
        conv = dr.convert(model, scheme, example_inputs=args or None, example_kwargs=kwargs or None)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in conv.depthrewrite.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        ref = copy.deepcopy(conv)
        _shard(conv, framework, recipe, mesh)
        full = torch.cat([args[0], args[0].flip(0)])
        mine = full.chunk(WORLD)[rank]

        def logits(out):
            return out.logits if hasattr(out, "logits") else out

        out = logits(conv(mine)).float()
        loss = out.pow(2).sum() / (out.numel() * WORLD)  # this rank's share of the whole batch's mean
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        want = logits(ref(full)).float().pow(2).mean()
        want.backward()
        worst = 0.0
        for p, q in zip(conv.parameters(), ref.parameters()):
            got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            worst = max(worst, (got - q.grad).abs().max().item())
        sharded = sorted({n.rpartition(".")[0] for n, p in conv.named_parameters() if type(p).__name__ == "DTensor"})
        return dict(loss=total.item(), ref=want.item(), grad=worst, module_calls=conv.__dict__["_depthrewrite"].module_calls,
                    sharded=len(sharded))


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (WORLD,))
    results = {}
    try:
        for case, framework, name, recipe, scheme in CASES:
            try:
                results[case] = _case(mesh, rank, framework, name, recipe, scheme)
            except Exception as e:  # noqa: BLE001 - recorded, asserted by the tests
                results[case] = dict(error=type(e).__name__, text=str(e)[:2000])
            dist.barrier()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def recipe_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_recipes")
    spawn_ranks(_worker, (str(tmp / "rdzv"), str(tmp)), WORLD, 480, "FSDP recipe workers")
    return torch.load(tmp / "rank0.pt")


@pytest.mark.parametrize("case", [c[0] for c in CASES if c[0] not in REFUSED])
def test_framework_fsdp_recipe_trains_as_one_process(recipe_results, case):
    got = recipe_results[case]
    assert "error" not in got, got
    assert abs(got["loss"] - got["ref"]) <= 1e-5, got
    assert got["grad"] <= 1e-5, got
    assert got["module_calls"] is True  # a sharded module that is not a block turns module calls on
    assert got["sharded"] > 0


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_sharded_module_that_cannot_be_called_is_a_typed_error(recipe_results, case):
    got = recipe_results[case]
    assert got.get("error") == "ModuleCallError", got
    assert REFUSED[case] in got["text"] and "its call stays inlined" in got["text"]
