"""The frameworks' own FSDP2 recipes on their own converted models (issue #24 item 4, #25 item 2), 2 gloo ranks:
torchtitan's ``apply_fsdp_to_decoder`` (embedding, each block, norm + output, root), torchtune's ``shard_model``
(each layer plus ``tok_embeddings`` and ``output`` by name), OLMo-core's ``Transformer.apply_fsdp`` (its
``blocks`` strategy: each block and the embeddings; its ``full`` strategy, which also shards ``lm_head``, is a typed
refusal) and litgpt's ``finetune.lora.parallelize_fn`` (checkpoint_wrapper per block, every Linear, block and the
root sharded). litgpt's FSDP1 recipes (Lightning's ``FSDPStrategy``) need a GPU: an FSDP1 wrapper is a typed
refusal. They shard modules that are not blocks, so the converted model runs with module calls (docs/training.md): each sharded module is called as the
live module and its FSDP2 hooks gather its parameters. One forward/backward on half the batch per rank gives the
loss and the gradients of one process on the whole batch.

torchtitan's Llama3 with FlexAttention (its default) goes through its FSDP recipe and TP plan too (#25 item 2).

torchtitan's own tensor parallelism (issue #24 item 2, #25 item 2) runs in the same workers: its Llama3 / Qwen3
sharding configs (``set_llama3_sharding_config``, as its trainer sets them) and ``model.parallelize(parallel_dims)``
on a 2-rank TP mesh, converting before and after parallelising. Its modules keep activations as DTensors between
them; the converted graph computes its depth mixing on their (replicated) local values and hands them back as
DTensors (docs/training.md). Each rank runs the whole batch: loss and gradients equal one process. Its default
``spmd_backend="spmd_types"`` (plain local shards, no DTensor) is run as its trainer runs it."""

from __future__ import annotations

import copy
import functools
import importlib.util
import os
import sys
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import depthrewrite as dr

from ..distributed import grad_gaps, record_cases, spawn_ranks

WORLD = 2
SCHEMES = ["attnres", "msar", "mhc", "moda"]
# (case, framework, model name, recipe)
CASES = [
    *[(f"torchtitan-{s}", "torchtitan", "llama3", "apply_fsdp_to_decoder", s) for s in SCHEMES],
    *[(f"torchtune-{s}", "torchtune", "llama3", "shard_model", s) for s in ("attnres", "mhc")],
    *[(f"olmo_core-{s}", "olmo_core", "llama_like", "apply_fsdp:blocks", s) for s in ("attnres", "msar")],
    # litgpt's multi-device LoRA recipe (Lightning's ModelParallelStrategy calls it): checkpoint_wrapper on every
    # block, fully_shard on every trainable Linear, every wrapped block and the root
    *[(f"litgpt-{s}", "litgpt", "Llama-3.2-1B", "lora.parallelize_fn", s) for s in ("attnres", "msar", "mhc")],
    # its "full" strategy also shards lm_head, whose forward takes a string (loss_reduction="mean"): called as a
    # module with the string a constant of the call (export's call marker takes no string: passes/lower/module_calls)
    *[(f"olmo_core-full-{s}", "olmo_core", "llama_like", "apply_fsdp:full", s) for s in ("attnres", "mhc")],
    # torchtitan's default FlexAttention: its BlockMask an input of every block; the attention stays inlined (nothing
    # needs it live), so the converted model trains on a CPU
    *[(f"torchtitan-flex-{s}", "torchtitan", "llama3-flex", "apply_fsdp_to_decoder", s) for s in ("attnres",
                                                                                                  "block-msar")],
]
# torchtitan's own TP: recipe "parallelize" = convert, then model.parallelize; ":first" = the reverse; ":sp" with its
# sequence-parallel plan; the name "qwen3-untied": Qwen3 (fused q/k/v, QK-norm) without weight tying
TP_CASES = [
    *[(f"torchtitan-tp-{s}", "torchtitan", "llama3", "parallelize", s) for s in ("attnres", "msar", "mhc",
                                                                                  "block-attnres")],
    ("torchtitan-tp-first-block-msar", "torchtitan", "llama3", "parallelize:first", "block-msar"),
    ("torchtitan-tp-qwen3-mhc", "torchtitan", "qwen3-untied", "parallelize", "mhc"),
    # MoDA rewrites the attention, which runs inlined on whole tensors: its plan's wrapper (partial_dtensor: DTensor
    # redistributions only) is reproduced at the live q/k/v, QK-norm and output calls around it
    ("torchtitan-tp-moda", "torchtitan", "llama3", "parallelize", "moda"),
    ("torchtitan-tp-first-moda", "torchtitan", "llama3", "parallelize:first", "moda"),
    ("torchtitan-tp-qwen3-moda", "torchtitan", "qwen3-untied", "parallelize", "moda"),
    ("torchtitan-tp-sp-attnres", "torchtitan", "llama3", "parallelize:sp", "attnres"),
    # its compile-per-block helper after its TP plan (apply_compile: block.compile(fullgraph=True), aot_eager here):
    # the glue between module calls traced by Dynamo (Full AttnRes: a program per block; MoDA: the most glue)
    *[(f"torchtitan-tp-compile-{s}", "torchtitan", "llama3", "parallelize:compile", s) for s in ("attnres", "moda")],
    # FlexAttention under its TP plan: the parallelised attention is called live with the BlockMask rebuilt from the
    # graph's tensors; its FlexAttention refuses a CPU backward (as the original does): forward only
    *[(f"torchtitan-tp-flex-{s}", "torchtitan", "llama3-flex", "parallelize", s) for s in ("mhc", "msar")],
    ("torchtitan-tp-first-flex-attnres", "torchtitan", "llama3-flex", "parallelize:first", "attnres"),
    # its default spmd_backend="spmd_types": weights become plain local shards, activations plain tensors, the
    # redistributions run in each module's wrapped forward (the converted model calls them live); a conversion
    # before parallelising is captured again when its called modules' weights shrink to shards
    ("torchtitan-spmd-attnres", "torchtitan", "llama3", "spmd", "attnres"),
    ("torchtitan-spmd-block-msar", "torchtitan", "llama3", "spmd", "block-msar"),
    ("torchtitan-spmd-first-mhc", "torchtitan", "llama3", "spmd:first", "mhc"),
    # MoDA rewrites the attention, which runs inlined on whole tensors (the capture stands whole zeros in for the
    # local shards): the plan's redistributions are made at the live calls around it, in both orders
    ("torchtitan-spmd-moda", "torchtitan", "llama3", "spmd", "moda"),
    ("torchtitan-spmd-first-moda", "torchtitan", "llama3", "spmd:first", "moda"),
    # MoDA with module_calls=False: the plan's collectives traced into its attention are refused at conversion
    ("torchtitan-spmd-inline-moda", "torchtitan", "llama3", "spmd:inline", "moda"),
    # Qwen3's QK-norm weights are R on the tp axis (each rank's gradient partial, completed by torchtitan's FSDP):
    # the live QK-norm takes its heads' shard, an inlined one's weight keeps 1/n of its complete gradient
    ("torchtitan-spmd-qwen3-moda", "torchtitan", "qwen3-untied", "spmd", "moda"),
    # DeepSeek-V3's MLA down-projection `wkv_a` and `kv_norm` are R on tp and take whole inputs: called whole, their
    # outputs keep 1/n of the gradient and their inputs' gradients are summed over the ranks
    ("torchtitan-spmd-deepseek-moda", "torchtitan", "deepseek_v3", "spmd", "moda"),
    # its sequence-parallel plan with plain tensors: refused at capture from the plan's own layouts
    ("torchtitan-spmd-sp-msar", "torchtitan", "llama3", "spmd:sp", "msar"),
    # module_calls=False: the plan's forward communication traced into the graph (exact), its backward lost: refused
    ("torchtitan-spmd-inline-attnres", "torchtitan", "llama3", "spmd:inline", "attnres"),
]
CASES += TP_CASES
SPMD_REFUSED = ("torchtitan-spmd-inline-moda",)
INLINE_REFUSED = "torchtitan-spmd-inline-attnres"
SP_REFUSED = ("torchtitan-tp-sp-attnres", "torchtitan-spmd-sp-msar")
_FRAMEWORKS = {c[1] for c in CASES}
pytestmark = pytest.mark.skipif(any(importlib.util.find_spec(f) is None for f in _FRAMEWORKS),
                                reason="needs torchtitan, torchtune and OLMo-core (the `frameworks` extra)")


def _shard(model, framework: str, recipe: str, mesh) -> None:
    from torch.distributed.fsdp import FSDPModule

    if framework == "litgpt":
        from litgpt.finetune.lora import parallelize_fn
        from torch.distributed.device_mesh import init_device_mesh

        parallelize_fn(model, init_device_mesh("cpu", (WORLD,), mesh_dim_names=("data_parallel",)))
    elif framework == "torchtitan":
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


def _titan_tp_case(name: str, recipe: str, scheme: str) -> dict:
    """torchtitan's own TP on 2 ranks (each runs the whole batch) against one process, for ``scheme``."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    from tests.frameworks.models import build, example_inputs

    parallel_dims.device_type = "cpu"  # torchtitan picks "cuda" when it finds no accelerator
    dims = parallel_dims.ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=WORLD, pp=1, ep=1, world_size=WORLD,
                                      spmd_backend="partial_dtensor")
    dims.build_mesh()
    arch, _, variant = name.partition("-")
    order = recipe.partition(":")[2]
    model, _, _ = build("torchtitan", arch, sharding="sp" if order == "sp" else "tp",
                        **({"tie": False} if variant == "untied" else {}),
                        **({"attention": "flex"} if variant == "flex" else {}))
    model.train()
    (ids,), kwargs = example_inputs(model)  # FlexAttention: positions and their BlockMask

    def randomise(*convs):
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for ps in zip(*(c.depthrewrite.parameters() for c in convs)):
                r = torch.randn(ps[0].shape, generator=g) * 0.1
                for p in ps:
                    p.copy_(r)

    if order == "first":  # parallelise, then convert (the reference converts an unsharded copy)
        ref = dr.convert(copy.deepcopy(model), scheme, example_inputs=(ids,), example_kwargs=kwargs)
        model.parallelize(dims)
        conv = dr.convert(model, scheme, example_inputs=(ids,), example_kwargs=kwargs)
        randomise(conv, ref)
    else:
        conv = dr.convert(model, scheme, example_inputs=(ids,), example_kwargs=kwargs)
        randomise(conv)
        ref = copy.deepcopy(conv)
        conv.parallelize(dims)
    if order == "compile":
        from torchtitan.config import CompileConfig
        from torchtitan.distributed.compile import apply_compile

        torch._dynamo.reset()
        with torch._dynamo.config.patch():  # apply_compile sets two dynamo flags process-wide: undone on exit
            apply_compile(conv, compile_config=CompileConfig(enable=True, components=["model"], backend="aot_eager"),
                          parallel_dims=dims)
            got = _titan_tp_step(conv, ref, ids, kwargs)
        got["compiled"] = [len(getattr(b._compiled_call_impl, "_compiled", ())) for b in conv.layers.values()]
        return got
    if variant == "flex":
        # the parallelised attention runs live (its plan's forward), so torchtitan's FlexAttention runs and refuses
        # a backward on a CPU as the original does: the forward only here, its backward in bench/gpu.sh territory
        with torch.no_grad():
            out = conv(ids, **kwargs)
            out = out.full_tensor() if hasattr(out, "full_tensor") else out
            loss, want = out.float().pow(2).mean(), ref(ids, **kwargs).float().pow(2).mean()
        return dict(loss=loss.item(), ref=want.item(), grad=0.0, grad_rel=0.0,
                    sharded=sum(type(p).__name__ == "DTensor" for p in conv.parameters()),
                    module_calls=conv.__dict__["_depthrewrite"].module_calls)
    return _titan_tp_step(conv, ref, ids, kwargs)


def _titan_tp_step(conv, ref, ids, kwargs) -> dict:
    out = conv(ids, **kwargs)
    out = out.full_tensor() if hasattr(out, "full_tensor") else out  # its output plan shards the vocabulary
    loss = out.float().pow(2).mean()
    loss.backward()
    want = ref(ids, **kwargs).float().pow(2).mean()
    want.backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    worst, rel = grad_gaps((p.grad, grads[n]) for n, p in conv.named_parameters())
    sharded = sum(type(p).__name__ == "DTensor" for p in conv.parameters())
    return dict(loss=loss.item(), ref=want.item(), grad=worst, grad_rel=rel,
                module_calls=conv.__dict__["_depthrewrite"].module_calls, sharded=sharded)


def _titan_spmd_case(name: str, recipe: str, scheme: str) -> dict:
    """torchtitan's TP with its default ``spmd_backend="spmd_types"`` (set process-wide, as its trainer does, and put
    back after), forward and backward inside its ``get_spmd_context``, against one process. The output is each rank's
    plain vocabulary shard: gathered (differentiably) into the whole logits; a sharded weight's gradient is compared
    with its slice of the reference's."""
    import torch.distributed.nn.functional as dist_fn
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as titan_dist
    from torch.testing._internal.distributed import fake_pg  # noqa: F401  (torchtitan's size-1 mesh axes use it)

    from depthrewrite.passes.lower.module_calls import _pending_on_tp
    from tests.frameworks.models import build, example_inputs

    parallel_dims.device_type = "cpu"
    before = titan_dist.get_spmd_backend()
    titan_dist.set_spmd_backend("spmd_types")
    try:
        dims = parallel_dims.ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=WORLD, pp=1, ep=1, world_size=WORLD,
                                          spmd_backend="spmd_types")
        dims.build_mesh()
        spmd = titan_dist.get_spmd_context(parallel_dims=dims)
        arch, _, variant = name.partition("-")
        model, _, _ = build("torchtitan", arch, sharding="sp" if recipe.endswith(":sp") else "tp",
                            **({"tie": False} if variant == "untied" else {}))
        model.train()
        (ids,), _ = example_inputs(model)
        if recipe.endswith((":first", ":inline")):
            ref = dr.convert(copy.deepcopy(model), scheme, example_inputs=(ids,))
            with spmd():
                model.parallelize(dims)
                conv = dr.convert(model, scheme, example_inputs=(ids,),
                                  **({"module_calls": False} if recipe.endswith(":inline") else {}))
        else:
            conv = dr.convert(model, scheme, example_inputs=(ids,))
            ref = copy.deepcopy(conv)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p, q in zip(conv.depthrewrite.parameters(), ref.depthrewrite.parameters()):
                r = torch.randn(p.shape, generator=g) * 0.1
                p.copy_(r)
                q.copy_(r)
        if not recipe.endswith((":first", ":inline")):
            with spmd():
                conv.parallelize(dims)
        want = ref(ids).float().pow(2).mean()
        want.backward()
        with spmd():
            out = torch.cat(dist_fn.all_gather(conv(ids).contiguous()), dim=-1).float()
            loss = out.pow(2).mean()
            if recipe.endswith(":inline"):  # the forward is exact; a backward through it is refused
                try:
                    (loss / WORLD).backward()
                except dr.ConfigError as e:
                    return dict(loss=loss.item(), ref=want.item(), refused=str(e))
                return dict(loss=loss.item(), ref=want.item(), refused=None)
            (loss / WORLD).backward()  # every rank computes the whole loss; the gather's backward sums their grads
        rank, ref_grads, pairs, sharded = dist.get_rank(), dict(ref.named_parameters()), [], 0
        for n, p in conv.named_parameters():
            owner, _, k = n.rpartition(".")
            if k in _pending_on_tp(conv.get_submodule(owner)):
                # declared R on tp: each rank's gradient is a partial sum, which torchtitan's FSDP completes (a sum
                # over the tp ranks); done here as it would be (Qwen3's QK-norm weights)
                dist.all_reduce(p.grad)
            r = ref_grads[n].grad
            if p.shape != r.shape:  # a local shard: this rank's slice of the whole gradient
                sharded += 1
                d = next(i for i, (a, b) in enumerate(zip(p.shape, r.shape)) if a != b)
                r = r.chunk(WORLD, d)[rank]
            pairs.append((p.grad, r))
        worst, rel = grad_gaps(pairs)
        return dict(loss=loss.item(), ref=want.item(), grad=worst, grad_rel=rel, sharded=sharded,
                    module_calls=conv.__dict__["_depthrewrite"].module_calls)
    finally:
        titan_dist.set_spmd_backend(before)


def _flex_kwargs(model):
    """ids -> torchtitan's FlexAttention kwargs for them (positions and the BlockMask its model builds)."""
    masks = model.get_attention_masks

    def kwargs(ids):
        positions = torch.arange(ids.shape[1]).expand(*ids.shape)
        return {"positions": positions, "attention_masks": masks(positions)}

    return kwargs


def _case(mesh, rank: int, framework: str, name: str, recipe: str, scheme: str) -> dict:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.frameworks.models import _stubbed, build

    if recipe.startswith("parallelize"):
        return _titan_tp_case(name, recipe, scheme)
    if recipe.startswith("spmd"):
        return _titan_spmd_case(name, recipe, scheme)

    with _stubbed(framework):
        flex = name.endswith("-flex")  # torchtitan with FlexAttention: each call takes positions and their BlockMask
        model, args, kwargs = build(framework, name.removesuffix("-flex"), **({"attention": "flex"} if flex else {}))
        call_kwargs = _flex_kwargs(model) if flex else (lambda x: {})
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

        out = logits(conv(mine, **call_kwargs(mine))).float()
        loss = out.pow(2).sum() / (out.numel() * WORLD)  # this rank's share of the whole batch's mean
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        want = logits(ref(full, **call_kwargs(full))).float().pow(2).mean()
        want.backward()
        worst, rel = grad_gaps((p.grad, q.grad) for p, q in zip(conv.parameters(), ref.parameters()))
        sharded = sorted({n.rpartition(".")[0] for n, p in conv.named_parameters() if type(p).__name__ == "DTensor"})
        return dict(loss=total.item(), ref=want.item(), grad=worst, grad_rel=rel,
                    module_calls=conv.__dict__["_depthrewrite"].module_calls, sharded=len(sharded))


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (WORLD,))
    record_cases({case: functools.partial(_case, mesh, rank, framework, name, recipe, scheme)
                  for case, framework, name, recipe, scheme in CASES}, rank, out_dir, max_text=2000)


@pytest.fixture(scope="module")
def recipe_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_recipes")
    spawn_ranks(_worker, (str(tmp / "rdzv"), str(tmp)), WORLD, 480, "FSDP recipe workers")
    return torch.load(tmp / "rank0.pt")


@pytest.mark.parametrize("case", [c[0] for c in CASES if c[0] not in SP_REFUSED and c[0] not in SPMD_REFUSED
                                  and c[0] != INLINE_REFUSED])
def test_framework_recipe_trains_as_one_process(recipe_results, case):
    got = recipe_results[case]
    assert "error" not in got, got
    assert abs(got["loss"] - got["ref"]) <= 1e-5, got
    assert got["grad"] <= 1e-5, got
    # relative too: a QK-norm weight's gradient is ~1e-5, and a partial sum passed the absolute bound (DeepSeek-V3's
    # experts compute in bfloat16 inside: ~4e-3)
    assert got["grad_rel"] <= 1e-2, got
    assert got["module_calls"] is True  # a sharded module that is not a block turns module calls on
    assert got["sharded"] > 0


@pytest.mark.parametrize("case", [c[0] for c in CASES if c[3] == "parallelize:compile"])
def test_torchtitan_compile_per_block_under_its_tensor_parallel_plan(recipe_results, case):
    """``apply_compile`` (``block.compile(fullgraph=True)``) after torchtitan's TP plan: each block's program compiled
    as one graph with the glue around its module calls (it read a function's name and a weak dictionary Dynamo cannot
    trace, and handed a compiled block a waiting collective's tensor whose gradient the collective's backward
    refused); the loss and gradients above equal one process."""
    got = recipe_results[case]
    assert got["compiled"] and all(n == 1 for n in got["compiled"]), got


@pytest.mark.parametrize("case", SP_REFUSED)
def test_torchtitan_sequence_parallelism_is_a_typed_error(recipe_results, case):
    """Its sequence-parallel plan leaves the stream sharded along the sequence between modules: a ConfigError at
    capture, read from the plan's own layouts, naming the first such module. With ``spmd_types`` those activations
    are plain tensors nothing else would notice (MSAR's loss was 0.2% off, the depth parameters' gradients 0.2-0.6x,
    no error)."""
    got = recipe_results[case]
    assert got.get("error") == "ConfigError", got
    assert "tok_embeddings is tensor-parallel with activations sharded along the sequence" in got["text"], got
    assert "enable_sequence_parallel=False" in got["text"], got


@pytest.mark.parametrize("case", SPMD_REFUSED)
def test_moda_with_traced_tensor_parallel_communication_is_a_typed_error(recipe_results, case):
    """With module calls off under torchtitan's ``spmd_types``, MoDA's attention would be traced with the plan's
    redistributions and this rank's heads (it used to pair a rank's heads with other heads' depth slots, logits off
    by 0.1, no error): a ConfigError naming the traced communication. With module calls (the default) it trains
    (``torchtitan-spmd-moda``, ``torchtitan-spmd-first-moda``)."""
    got = recipe_results[case]
    assert got.get("error") == "ConfigError", got
    assert "MoDA cannot convert a tensor-parallel model" in got["text"] and "_c10d_functional" in got["text"], got


def test_inlined_tensor_parallel_communication_refuses_a_backward(recipe_results):
    """``module_calls=False`` under torchtitan's ``spmd_types`` TP traces the plan's forward communication into the
    graph: the loss equals one process, but the plan's backward communication (the gradient all-reduce of each
    column-parallel layer's input) is not in it, and the gradients came out wrong (0.03 off, no error). The forward
    stays usable; a backward through it is a ConfigError naming the traced collective and module calls."""
    got = recipe_results[INLINE_REFUSED]
    assert "error" not in got, got
    assert abs(got["loss"] - got["ref"]) <= 1e-5, got
    assert got["refused"] is not None and "_c10d_functional" in got["refused"], got
    assert "module_calls=None" in got["refused"] and "the gradients would be wrong" in got["refused"], got


def test_an_fsdp1_wrapper_is_a_typed_error():
    """FSDP1 (``FullyShardedDataParallel``, what Lightning's FSDPStrategy wraps each litgpt Block in) cannot be built
    without a GPU; a wrapper put in a block's slot, as its auto-wrap policy does, makes the next call a ConfigError
    that says to use fully_shard, never an untested run."""
    import torch.nn as nn
    from torch.distributed.fsdp import FullyShardedDataParallel

    from tests.frameworks.models import build

    model, args, _ = build("litgpt", "pythia-14m")
    conv = dr.convert(model, "attnres", example_inputs=args)
    wrapper = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    nn.Module.__init__(wrapper)
    wrapper._fsdp_wrapped_module = conv.transformer.h[0]
    conv.transformer.h[0] = wrapper
    with pytest.raises(dr.ConfigError, match=r"transformer\.h\.0 is wrapped by FullyShardedDataParallel .*fully_shard"):
        conv(*args)
