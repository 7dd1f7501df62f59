"""Tensor parallelism on a converted model (issue #24 item 2): DTensor ``parallelize_module`` with a Megatron-style plan
(torchtitan's Llama layout: ``ColwiseParallel`` on q/k/v/gate/up, ``RowwiseParallel`` on o/down) on every decoder
layer, 2 gloo ranks, converting before and after parallelising. A tensor-parallel model converts with module calls
(docs/design/module-calls.md): the attention and MLP sublayers the scheme leaves intact run as the live modules,
so the plan's hooks and sharded weights act as on the original. Losses and gradients equal one process; what cannot
work yet (sequence parallelism) is a typed error. MoDA, which changes the attention itself, runs its attention with
every head on every rank: the column-parallel projections' outputs are gathered, the row-parallel output projection
gets each rank's slice back."""

from __future__ import annotations

import copy
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import depthrewrite as dr
from depthrewrite.demo.zoo import hf_model

from .distributed import grad_gaps, record_cases, spawn_ranks

WORLD = 2
# (name, model, scheme, order): order "convert" = convert, then parallelise (a recapture); "tp" = the reverse
CASES = [
    ("attnres-convert", "llama", "attnres", "convert"),
    ("msar-convert", "llama", "msar", "convert"),
    ("mhc-convert", "llama", "mhc", "convert"),
    ("block-attnres-convert", "llama", "block-attnres", "convert"),
    ("attnres-tp", "llama", "attnres", "tp"),
    ("block-msar-tp", "llama", "block-msar", "tp"),
    ("qwen2-mhc-tp", "qwen2", "mhc", "tp"),  # q/k/v with biases (Qwen's plan shards them with the weights)
    # MoDA rewrites the attention: its q/k/v outputs are gathered whole, o_proj gets this rank's slice back
    ("moda-convert", "llama", "moda", "convert"),
    ("moda-tp", "llama", "moda", "tp"),
    ("qwen2-moda-tp", "qwen2", "moda", "tp"),
    ("sp-attnres-tp", "llama", "attnres", "sp"),
]


def _plan(sp: bool = False) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    plan = {f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
    plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
                 "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    if sp:  # sequence parallelism: norms on sequence shards, gathered before each sublayer
        plan.update({"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
                     "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                     desired_input_kwarg_layouts={"hidden_states": Replicate()}),
                     "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
                     "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                     "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1))})
    return plan


def _parallelise(model, mesh, sp: bool) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    for blk in model.model.layers:
        parallelize_module(blk, mesh, _plan(sp))


def _randomise(conv, gen_seed: int = 3) -> None:
    g = torch.Generator().manual_seed(gen_seed)
    with torch.no_grad():
        for p in conv.depthrewrite.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _case(mesh, model_name: str, scheme: str, order: str) -> dict:
    torch.manual_seed(0)
    model = hf_model(model_name, layers=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    if order == "convert":
        conv = dr.convert(model, scheme)
        _randomise(conv)
        ref = copy.deepcopy(conv)
        _parallelise(conv, mesh, sp=False)
    else:
        original = copy.deepcopy(model)
        _parallelise(model, mesh, sp=order == "sp")
        conv = dr.convert(model, scheme)
        ref = dr.convert(original, scheme)
        _randomise(conv)
        _randomise(ref)
    conv.train()
    ref.train()
    losses = []
    for c in (conv, ref):
        loss = c(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    worst, rel = grad_gaps((p.grad, q.grad) for p, q in zip(conv.parameters(), ref.parameters()))
    st = conv.__dict__["_depthrewrite"]
    sharded = sum(type(p).__name__ == "DTensor" for p in conv.parameters())
    new_sharded = sum(type(p).__name__ == "DTensor" for p in conv.depthrewrite.parameters())
    gathered, sliced = _reshards(conv)
    return dict(loss=losses[0], ref=losses[1], grad=worst, grad_rel=rel, module_calls=st.module_calls, sharded=sharded,
                new_sharded=new_sharded, gathered=gathered, sliced=sliced)


def _reshards(conv) -> tuple[int, int]:
    """In the first block program: how many q/k/v projections' outputs are checked where the graph needs them whole
    (each is gathered when it comes out as this rank's slice), and how many inputs are sliced for a row-parallel
    module (as_local_shard)."""
    from depthrewrite.passes.lower.module_calls import as_local_shard, check_local_shape

    progs = conv.__dict__["_depthrewrite"].last[True].runner.__dict__["_dr_programs"]
    g = next(iter(progs.values())).graph
    sliced = sum(n.target is as_local_shard for n in g.nodes)
    gathered = sum(n.target is check_local_shape and str(n.args[2]).endswith(("q_proj", "k_proj", "v_proj"))
                   for n in g.nodes)
    return gathered, sliced


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (WORLD,))
    record_cases({name: (lambda c=c: _case(mesh, *c)) for name, *c in CASES}, rank, out_dir)


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp")
    spawn_ranks(_worker, (str(tmp / "rdzv"), str(tmp)), WORLD, 400, "tensor-parallel workers")
    return [torch.load(tmp / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("case", [c[0] for c in CASES if c[3] != "sp"])
def test_tensor_parallel_trains_as_one_process(tp_results, case):
    for r in tp_results:
        got = r[case]
        assert "error" not in got, got
        assert abs(got["loss"] - got["ref"]) <= 1e-5, got
        assert got["grad"] <= 1e-5 and got["grad_rel"] <= 1e-2, got
        assert got["module_calls"] is True  # turned on by the tensor-parallel parameters
        assert got["sharded"] > 0 and got["new_sharded"] == 0  # the depth-mixing parameters are replicated


def test_moda_under_tensor_parallelism_runs_every_head_on_every_rank(tp_results):
    """MoDA changes the attention (depth K/V join its softmax), so the attention runs as graph operations traced with
    every head. It used to be refused where the sharded q_proj's local output came out; now the column-parallel
    q/k/v outputs are gathered whole (differentiably) and o_proj gets each rank's slice: the graph shows both."""
    for r in tp_results:
        for case in ("moda-convert", "moda-tp", "qwen2-moda-tp"):
            assert r[case]["gathered"] >= 3 and r[case]["sliced"] >= 1, (case, r[case])


def test_sequence_parallelism_is_a_typed_error(tp_results):
    for r in tp_results:
        got = r["sp-attnres-tp"]
        assert got.get("error") == "ConfigError", got
        assert "sequence parallelism" in got["text"]


# ---- 2-D: FSDP2 over data-parallel ranks x tensor parallelism, 4 gloo ranks (mesh dp=2 x tp=2) -------------------
TWO_D = ("attnres", "mhc", "block-msar", "moda")


def _case_2d(mesh, rank: int, scheme: str) -> dict:
    """torchtitan's order: the TP plan on each block over the ``tp`` mesh, then ``fully_shard`` per block and on the
    root over ``dp``. Each data-parallel group runs half the batch; the sum of the ranks' losses and the gathered
    gradients equal one process on the whole batch."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    torch.manual_seed(0)
    model = hf_model("llama", layers=2)
    full = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    conv = dr.convert(model, scheme)
    _randomise(conv)
    ref = copy.deepcopy(conv)
    for blk in conv.model.layers:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(blk, mesh["tp"], _plan())
        fully_shard(blk, mesh=mesh["dp"])
    fully_shard(conv, mesh=mesh["dp"])
    for m in conv.modules():  # gloo has no PREMUL_SUM: plain sums, the loss below is each rank's share of the mean
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
            m.set_gradient_divide_factor(1.0)
    dp = mesh["dp"].get_local_rank()
    out = conv(full.chunk(2)[dp]).logits
    loss = out.pow(2).sum() / (out.numel() * 2)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh["dp"].get_group())
    want = ref(full).logits.pow(2).mean()
    want.backward()
    worst, rel = grad_gaps((p.grad, q.grad) for p, q in zip(conv.parameters(), ref.parameters()))
    return dict(loss=total.item(), ref=want.item(), grad=worst, grad_rel=rel,
                module_calls=conv.__dict__["_depthrewrite"].module_calls)


def _worker_2d(rank: int, init_file: str, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=4,
                            timeout=timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    record_cases({scheme: (lambda s=scheme: _case_2d(mesh, rank, s)) for scheme in TWO_D}, rank, out_dir)


def test_fsdp2_times_tensor_parallel_trains_as_one_process(tmp_path):
    spawn_ranks(_worker_2d, (str(tmp_path / "rdzv"), str(tmp_path)), 4, 400, "2-D FSDP2 x TP workers")
    for r in range(4):
        res = torch.load(tmp_path / f"rank{r}.pt")
        for scheme in TWO_D:
            got = res[scheme]
            assert "error" not in got, (r, scheme, got)
            assert abs(got["loss"] - got["ref"]) <= 1e-5, (r, scheme, got)
            assert got["grad"] <= 1e-5 and got["grad_rel"] <= 1e-2, (r, scheme, got)
            assert got["module_calls"] is True
