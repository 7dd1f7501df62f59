"""Blocks are modules on every framework model (issue: frameworks first-class, item 1): a tensor of one module that
every block reads (torchtune's single RoPE module, shared by all layers) is a side input of the block programs, and an
in-place write to a tensor made in the graph (litgpt Gemma-2's ``mask.masked_fill_``) is turned out of place before
the split; then the frameworks' own activation checkpointing acts per block: fewer saved activations, same grads."""

from __future__ import annotations

import warnings

import pytest
import torch

import depthrewrite as dr
from depthrewrite.runtime.handle import state_of
from tests.frameworks.models import CASES, build, require


def _convert(model, args, kwargs, scheme, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dr.convert(model, scheme, example_inputs=args, example_kwargs=kwargs, **options)


@pytest.mark.parametrize("framework, name", CASES, ids=[f"{f}-{n}" for f, n in CASES])
def test_no_model_runs_flat(framework, name):
    model, args, kwargs = build(framework, name)
    conv = _convert(model, args, kwargs, "attnres", blocks=2)
    assert state_of(conv).blocks is not None, state_of(conv).blocks_note


@pytest.mark.parametrize("scheme", ["msar", "moda", "mhc"])
@pytest.mark.parametrize("framework, name", [("litgpt", "gemma-2-2b"), ("torchtune", "llama3")])
def test_blocks_for_every_scheme(framework, name, scheme):
    model, args, kwargs = build(framework, name)
    model.eval()
    with torch.no_grad():
        want = model(*args, **kwargs)
    conv = _convert(model, args, kwargs, scheme, **dr.scheme(scheme).exact)
    assert state_of(conv).blocks is not None, state_of(conv).blocks_note
    with torch.no_grad():
        got = conv(*args, **kwargs)
    torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=0)


def _step(model, args, kwargs):
    """Loss and grads of one training step, and the bytes autograd saved while the forward ran."""
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*args, **kwargs).float().pow(2).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, saved[0]


def _checkpointing(framework: str, mode: str = "full"):
    """The framework's own helper: torchtune's set_activation_checkpointing, torchtitan's FullAC / SelectiveAC,
    OLMo-core's Transformer.apply_activation_checkpointing, else torch's (litgpt's recipes use it)."""
    if framework == "torchtitan":
        from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

        cls = {"full": FullAC, "selective": SelectiveAC}[mode]
        return lambda m: cls(cls.Config()).apply(m)
    if framework == "olmo_core":
        return lambda m: m.apply_activation_checkpointing(mode)
    if framework == "torchtune":
        require("torchtune", "torchtune.training", "torchtune.modules")
        from torchtune.modules import TransformerSelfAttentionLayer
        from torchtune.training import set_activation_checkpointing

        return lambda m: set_activation_checkpointing(m, auto_wrap_policy={TransformerSelfAttentionLayer})
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from litgpt.model import Block

    return lambda m: apply_activation_checkpointing(m, check_fn=lambda x: isinstance(x, Block))


@pytest.mark.parametrize("framework, name, mode", [
    ("litgpt", "gemma-2-2b", "full"), ("torchtune", "llama3", "full"), ("torchtitan", "llama3", "full"),
    ("torchtitan", "llama3", "selective"), ("olmo_core", "llama_like", "full"),  # SelectiveAC: what it saves itself
    ("torchtitan", "llama3-flex", "selective"),  # FlexAttention, its BlockMask an input of every block
], ids=["litgpt", "torchtune", "torchtitan-full", "torchtitan-selective", "olmo_core", "torchtitan-flex-selective"])
def test_framework_checkpointing_acts_per_block(framework, name, mode):
    flex = name.endswith("-flex")
    model, args, kwargs = build(framework, name.removesuffix("-flex"), **({"attention": "flex"} if flex else {}))
    model.train()
    conv = _convert(model, args, kwargs, "msar", blocks=2, **dr.scheme("msar").exact)
    loss0, grads0, saved0 = _step(conv, args, kwargs)
    _checkpointing(framework, mode)(conv)
    loss1, grads1, saved1 = _step(conv, args, kwargs)
    assert saved1 < 0.7 * saved0, (saved1, saved0)
    torch.testing.assert_close(loss1, loss0)
    strip = lambda n: n.replace("_checkpoint_wrapped_module.", "")  # noqa: E731 - the wrapper's extra path level
    assert {strip(n) for n in grads1} == set(grads0)
    for n, g in grads1.items():
        torch.testing.assert_close(g, grads0[strip(n)], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_torchtitan_apply_compile_compiles_each_block(attention):
    """torchtitan's compile-per-block helper (``apply_compile``: ``block.compile(fullgraph=True)`` for each of
    ``model.layers``) on a converted model: one training step equals eager (aot_eager here: inductor costs ~40 s).
    With FlexAttention (its BlockMask an input) Dynamo traces the captured operator in each block."""
    model, args, kwargs = build("torchtitan", "llama3", attention=attention)
    require("torchtitan", "torchtitan.models.llama3.parallelize", "torchtitan.distributed.parallel_dims")
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.llama3.parallelize import apply_compile

    model.train()
    conv = _convert(model, args, kwargs, "attnres", blocks=2)
    loss0, grads0, _ = _step(conv, args, kwargs)
    torch._dynamo.reset()
    with torch._dynamo.config.patch():  # apply_compile sets two dynamo flags process-wide: undone on exit
        apply_compile(conv, compile_config=CompileConfig(enable=True, components=["model"], backend="aot_eager"),
                      parallel_dims=ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1))
        assert all(getattr(b, "_compiled_call_impl", None) is not None for b in conv.layers.children())
        from torch._dynamo.utils import counters

        counters.clear()
        loss1, grads1, _ = _step(conv, args, kwargs)
        assert counters["stats"]["unique_graphs"] >= 1  # the blocks ran compiled (not bypassed by the runtime)
    torch._dynamo.reset()
    torch.testing.assert_close(loss1, loss0)
    assert set(grads1) == set(grads0)
    for n, g in grads1.items():
        torch.testing.assert_close(g, grads0[n], atol=1e-6, rtol=1e-5)
