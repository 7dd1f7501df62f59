"""Blocks stay modules: a converted model calls one module per transformer block (depthrewrite.blocks), so FSDP2 per
block, activation checkpointing and torch.compile per block apply to it as to the original blocks."""

from __future__ import annotations

import copy
import warnings
import os
from datetime import timedelta
from unittest.mock import patch

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

import depthrewrite as dr
from depthrewrite import blocks
from depthrewrite.blocks import BlockProgram, ConvertedBlock
from depthrewrite.demo.zoo import hf_model, timm_model
from depthrewrite.errors import ConfigError, DepthRewriteError
from depthrewrite.testing import nanogpt

from .distributed import spawn_ranks

SCHEMES = ["attnres", "block-attnres", "msar", "block-msar", "mhc", "moda"]
IDS = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))


def _randomise(conv: nn.Module) -> None:
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in conv.depthrewrite.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _grads(model: nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [g if g is not None else torch.zeros_like(p)
            for g, p in zip(torch.autograd.grad(loss, params, allow_unused=True), params)]


def _saved_bytes(fn) -> tuple[torch.Tensor, int]:
    """``fn()`` and the bytes autograd saved for backward while it ran."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


def _llama(layers: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return hf_model("llama", layers=layers, attention_dropout=0.0).train()


# ---- the blocks are the model's own modules -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "nanogpt", "vit"])
def test_blocks_are_the_models_own_modules(name):
    torch.manual_seed(0)
    if name == "llama":
        model, container, x = hf_model("llama", layers=2).eval(), "model.layers", IDS
    elif name == "nanogpt":
        model, container, x = nanogpt(n_layer=2).eval(), "transformer.h", IDS % 64
    else:
        model, container, x = timm_model("vit_tiny_patch16_224", layers=2).eval(), "blocks", torch.randn(1, 3, 224, 224)
    blocks = list(model.get_submodule(container))
    classes = [type(b) for b in blocks]
    keys = set(model.state_dict())
    conv = dr.convert(model, "block-attnres", example_inputs=(x,))
    st = conv.__dict__["_depthrewrite"]
    assert st.blocks == tuple(f"{container}.{i}" for i in range(2))
    for i, (b, cls) in enumerate(zip(blocks, classes)):
        assert conv.get_submodule(f"{container}.{i}") is b and isinstance(b, cls) and isinstance(b, ConvertedBlock)
        assert type(b).__name__ == cls.__name__
    assert {k for k in conv.state_dict() if not k.startswith("depthrewrite.")} == keys
    # hooks on a block fire once per call, around the block call
    calls = []
    h1 = blocks[1].register_forward_pre_hook(lambda m, args: calls.append(("pre", type(args[0]))))
    h2 = blocks[1].register_forward_hook(lambda m, args, out: calls.append(("post", len(out))))
    conv(x)
    conv(x)
    assert [c[0] for c in calls] == ["pre", "post"] * 2 and calls[0][1] is BlockProgram
    h1.remove()
    h2.remove()
    assert st.recaptures == 0  # hooks on blocks are not traced: nothing to recapture
    with pytest.raises(DepthRewriteError, match="cannot be called on its own"):
        blocks[0](torch.randn(1, 4, 8))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_block_calls_equal_the_flat_graph(scheme):
    """Outputs and gradients of the block runner are the flat rewritten graph's, with the new parameters random."""
    conv = dr.convert(_llama(), scheme)
    _randomise(conv)
    conv.train()
    out = conv(IDS, labels=IDS).loss
    entry = conv.__dict__["_depthrewrite"].last[True]
    assert entry.runner is not None and len(entry.runner.programs) == 3
    flat = entry.module(input_ids=IDS, labels=IDS).loss
    torch.testing.assert_close(out, flat, rtol=0, atol=0)
    # AttnRes blocks read their earlier sources as one stack (blocks.source_stack), whose backward sums each source's
    # gradient in another order than the flat graph's autograd does: equal to rounding
    tol = dict(rtol=1e-5, atol=1e-7) if entry.runner.programs["_dr_block_1"].listed is not None else dict(rtol=0, atol=0)
    for a, b in zip(_grads(conv, out), _grads(conv, flat)):
        torch.testing.assert_close(a, b, **tol)


def test_the_report_lists_the_blocks_and_what_crosses():
    conv = dr.convert(_llama().eval(), "block-attnres")
    text = str(conv.report())
    assert "model.layers.2" in text and "crosses" in text


# ---- activation checkpointing --------------------------------------------------------------------------------------


def test_hf_and_torch_activation_checkpointing_recompute_blocks():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    conv = dr.convert(_llama(), "block-attnres")
    _randomise(conv)
    conv.train()
    st = conv.__dict__["_depthrewrite"]

    def step():
        return conv(IDS, labels=IDS).loss

    step()
    loss, plain = _saved_bytes(step)
    want = _grads(conv, loss)
    conv.activation_checkpointing_enable()
    step()
    loss, hf = _saved_bytes(step)
    for a, b in zip(_grads(conv, loss), want):
        torch.testing.assert_close(a, b)
    conv.activation_checkpointing_disable()
    recaptures = st.recaptures
    apply_activation_checkpointing(conv, check_fn=lambda m: type(m).__name__ == "LlamaDecoderLayer")
    assert type(conv.model.layers[0]).__name__ == "CheckpointWrapper"
    loss, wrapped = _saved_bytes(step)
    for a, b in zip(_grads(conv, loss), want):
        torch.testing.assert_close(a, b)
    assert st.recaptures == recaptures  # a wrapper around a block calls the same block: no recapture
    assert hf < plain / 2 and wrapped < plain / 2, (plain, hf, wrapped)


def test_convert_checkpoint_true_for_a_model_without_a_switch():
    torch.manual_seed(0)
    model = nanogpt(n_layer=3).train()
    plain = dr.convert(model, "block-msar", inplace=False)
    ckpt = dr.convert(model, "block-msar", inplace=False, checkpoint=True)
    for c in (plain, ckpt):
        _randomise(c)
        c.train()
    x = IDS % 64
    a, bytes_plain = _saved_bytes(lambda: plain(x).square().mean())
    b, bytes_ckpt = _saved_bytes(lambda: ckpt(x).square().mean())
    torch.testing.assert_close(a, b)
    for ga, gb in zip(_grads(plain, a), _grads(ckpt, b)):
        torch.testing.assert_close(ga, gb)
    assert bytes_ckpt < bytes_plain / 2, (bytes_plain, bytes_ckpt)


class _LoopLM(nn.Module):
    """A model whose own loop adds the residuals (no block module holds a residual add)."""

    def __init__(self, d: int = 32, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(64, d)
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        self.mlps = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)

    def forward(self, idx):
        h = self.emb(idx)
        for n, f in zip(self.norms, self.mlps):
            h = h + f(n(h))
        return self.norm(h)


def test_checkpoint_true_without_block_modules_is_a_config_error():
    model = _LoopLM().eval()
    with pytest.raises(ConfigError, match="runs as one graph"):
        dr.convert(model, "attnres", example_inputs=(IDS % 64,), checkpoint=True)
    assert type(model) is _LoopLM and "depthrewrite" not in model._modules
    conv = dr.convert(model, "attnres", example_inputs=(IDS % 64,))  # without checkpointing: the flat graph runs
    assert conv.__dict__["_depthrewrite"].blocks is None
    assert "no block module" in " ".join(conv.report().notes)


# ---- torch.compile per block ---------------------------------------------------------------------------------------


def test_compile_per_block_with_the_depthrewrite_backend():
    torch.manual_seed(0)
    conv = dr.convert(nanogpt(n_layer=2), "block-attnres", example_inputs=(IDS % 64,))
    _randomise(conv)
    conv.train()
    x = IDS % 64
    want = conv(x)
    want_g = _grads(conv, want.square().mean())
    for blk in conv.transformer.h:
        blk.compile(backend="depthrewrite")
    got = conv(x)
    torch.testing.assert_close(got, want)
    for a, b in zip(_grads(conv, got.square().mean()), want_g):
        torch.testing.assert_close(a, b)
    assert conv.__dict__["_depthrewrite"].recaptures == 0


def test_compile_per_block_gives_each_program_its_own_compile_cache():
    """``block.compile()`` on a model deeper than Dynamo's recompile limit (8 per code object). ``nn.Module.compile``
    compiles the ``_call_impl`` every module shares, and blocks past the eighth program ran uncompiled (a
    recompile-limit warning); each program gets a copy of it with a code object of its own. Full AttnRes blocks each
    read one more source: read as one stack (``blocks.STACK_SOURCES``) they run 2 programs (the first block, whose
    first sublayer reads the embedding alone, and every other), each compiled once with the stack's length a dynamic
    size; as separate inputs, 10 programs, each compiled once; mHC's blocks share 2; MoDA's blocks read two more
    depth slots each (stacked: 3 programs, the first block reads none and the last writes none)."""
    from torch._dynamo.utils import counters

    for scheme, layers, programs, stacked in (("attnres", 10, 2, True), ("attnres", 10, 10, False),
                                              ("mhc", 10, 2, True), ("moda", 10, 3, True)):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        with patch.object(blocks, "STACK_SOURCES", stacked):
            conv = dr.convert(hf_model("llama", layers=layers, hidden=32), scheme)
            _randomise(conv)
            conv.train()
            want = conv(IDS, labels=IDS).loss
            for blk in conv.model.layers:
                blk.compile(backend="eager", fullgraph=True)
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                got = conv(IDS, labels=IDS).loss
            assert not [w for w in seen if "recompile_limit" in str(w.message)]
            torch.testing.assert_close(got, want)
            assert counters["stats"]["unique_graphs"] == programs, (scheme, dict(counters["stats"]))
            assert not counters["recompiles"], (scheme, dict(counters["recompiles"]))


def test_compile_per_block_with_decomposed_depth_ops_compiles_each_program_once():
    """As above, through the compile backend: AOT autograd traces the depth ops' decompositions (the code inductor
    would get; ``inner="aot_eager"`` skips the code generation). The stack's row count stays a dynamic size there too:
    one graph per program (a decomposition that fixed it compiled every block again, 2-3x the compile time)."""
    from torch._dynamo.utils import counters

    for scheme, options, programs in (("attnres", {}, 2), ("msar", {"blocks": 4}, 2), ("moda", {}, 3)):
        torch._dynamo.reset()
        counters.clear()
        dr.backend.clear_records()
        torch.manual_seed(0)
        conv = dr.convert(hf_model("llama", layers=4, hidden=32), scheme, **options)
        _randomise(conv)
        conv.train()
        want = conv(IDS, labels=IDS).loss
        want_g = _grads(conv, want)
        for blk in conv.model.layers:
            blk.compile(backend="depthrewrite", options={"inner": "aot_eager"})
        got = conv(IDS, labels=IDS).loss
        torch.testing.assert_close(got, want)
        for a, b in zip(_grads(conv, got), want_g):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        assert counters["stats"]["unique_graphs"] == programs, (scheme, dict(counters["stats"]))
        assert not counters["recompiles"], (scheme, dict(counters["recompiles"]))
        assert any(r.decomposed for r in dr.backend._RECORDS), scheme  # the references were traced


# ---- FSDP2 per block and DDP, two processes on gloo ---------------------------------------------------------------


def _fsdp_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    results = {}
    try:
        for scheme in [*SCHEMES, "ddp"]:
            conv = dr.convert(_llama(2), "block-msar" if scheme == "ddp" else scheme)
            _randomise(conv)
            ref = copy.deepcopy(conv)
            if scheme == "ddp":
                run = DDP(conv)
            else:
                for blk in conv.model.layers:
                    fully_shard(blk)
                fully_shard(conv)
                run = conv
            ref.train()
            run.train()
            opt = torch.optim.AdamW(conv.parameters(), lr=1e-2)
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
            g = torch.Generator().manual_seed(1)
            losses, ref_losses = [], []
            for _ in range(3):
                x = torch.randint(0, 100, (4, 16), generator=g)
                mine = x.chunk(world)[rank]
                loss = run(mine, labels=mine).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                total = loss.detach().clone()
                dist.all_reduce(total)
                losses.append(total.item() / world)
                r = ref(x, labels=x).loss
                r.backward()
                ref_opt.step()
                ref_opt.zero_grad()
                ref_losses.append(r.item())
            sharded = any(type(p).__name__ == "DTensor" for p in conv.model.layers[0].parameters())
            results[scheme] = dict(losses=losses, ref=ref_losses, sharded=sharded,
                                   captures=conv.__dict__["_depthrewrite"].captures)
            dist.barrier()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    spawn_ranks(_fsdp_worker, (2, str(tmp / "rdzv"), str(tmp)), 2, 240, "FSDP workers")
    return torch.load(tmp / "rank0.pt")


@pytest.mark.parametrize("scheme", [*SCHEMES, "ddp"])
def test_fsdp2_per_block_and_ddp_train_as_one_process(fsdp_results, scheme):
    """fully_shard on every block then the root (torchtitan's recipe), or DDP: three AdamW steps on half the batch
    per rank give the losses of one process on the whole batch. The training graph is captured after sharding."""
    r = fsdp_results[scheme]
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref"]), rtol=1e-4, atol=1e-4)
    assert r["sharded"] == (scheme != "ddp")
    assert r["captures"] == 2  # the eval graph at convert(), the training graph on the first sharded step


def test_checkpointing_flag_without_block_modules_is_refused_not_dropped():
    conv = dr.convert(_LoopLM().eval(), "attnres", example_inputs=(IDS % 64,))
    conv.gradient_checkpointing = True  # an HF-style flag on a model whose graph runs flat
    conv.train()
    with pytest.raises(ConfigError, match="refused rather than silently dropped"):
        conv(IDS % 64)


def test_pipeline_stages_are_groups_of_the_same_block_modules():
    from depthrewrite import pipeline as pp

    conv = dr.convert(_llama(4).eval(), "block-attnres", pipeline_stages=2)
    assert conv.__dict__["_depthrewrite"].entries()[0].runner is not None  # eager calls run the blocks too
    mods = pp.stages(conv, 2, (IDS,))
    called = [[n.target for n in m.graph.nodes if n.op == "call_module"] for m in mods]
    assert called == [["model.layers.0", "model.layers.1"], ["model.layers.2", "model.layers.3"]]
    for m, paths in zip(mods, called):
        for p in paths:
            assert m.get_submodule(p) is conv.get_submodule(p)
    with torch.no_grad():
        out = mods[1](*mods[0](IDS))
        want = conv(IDS).logits
    torch.testing.assert_close(out if isinstance(out, torch.Tensor) else out[0], want)


# ---- what the graphs read, and what they refuse (review findings) -------------------------------------------------


def test_graphs_read_the_live_tensors_and_keep_no_replaced_one_alive():
    import gc
    import weakref

    conv = dr.convert(_llama(2).eval(), "block-attnres")
    with torch.no_grad():  # (an autograd graph would hold the weight)
        before = conv(IDS).logits
    lin = conv.model.layers[0].mlp.down_proj
    old = weakref.ref(lin.weight)
    lin.weight = nn.Parameter(lin.weight.detach() * 2)  # same shape and dtype: no recapture needed
    gc.collect()
    assert old() is None  # neither the runner, the programs nor the flat graph hold the replaced tensor
    after = conv(IDS).logits
    assert (after - before).abs().max() > 1e-4
    flat = conv.graph_module(False)(input_ids=IDS).logits  # the flat graph reads the live model too
    torch.testing.assert_close(flat, after)
    assert conv.__dict__["_depthrewrite"].recaptures == 0


def test_untying_weights_after_conversion():
    """The tied wte and lm_head are both called as live modules: giving lm_head a weight of its own keeps the graphs
    (each call reads its module's weight); inlined (module_calls=False) the graphs read the one tied tensor, so they
    are captured again."""
    for module_calls, recaptures in ((None, 0), (False, 1)):
        torch.manual_seed(0)
        conv = dr.convert(nanogpt(n_layer=2).train(), "block-attnres", example_inputs=(IDS % 64,),
                          module_calls=module_calls)
        assert conv.lm_head.weight is conv.transformer.wte.weight
        conv.lm_head.weight = nn.Parameter(conv.lm_head.weight.detach().clone())
        conv(IDS % 64).square().mean().backward()
        assert conv.__dict__["_depthrewrite"].recaptures == recaptures
        assert conv.transformer.wte.weight.grad is not None and conv.lm_head.weight.grad is not None


def test_hooks_on_blocks_before_conversion_are_refused_and_the_model_is_left_as_it_was():
    model = _llama(2).eval()
    h = model.model.layers[1].register_forward_hook(lambda m, args, out: out)
    with pytest.raises(ConfigError, match="model.layers.1 has a forward hook"):
        dr.convert(model, "block-attnres")
    assert type(model).__name__ == "LlamaForCausalLM" and not dr.is_converted(model)
    assert not any(isinstance(m, ConvertedBlock) for m in model.modules())
    h.remove()
    model(IDS)  # the original still runs


class _Blk(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln1, self.f1, self.ln2, self.f2 = nn.LayerNorm(d), nn.Linear(d, d), nn.LayerNorm(d), nn.Linear(d, d)
        self.other: list = []

    def forward(self, h):
        h = h + self.f1(self.ln1(h))
        w = self.other[0].f2.weight if self.other else self.f2.weight  # reads another block's parameter
        return h + nn.functional.linear(self.ln2(h), w)


class _CrossLM(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.emb = nn.Embedding(64, d)
        self.blocks = nn.ModuleList([_Blk(d), _Blk(d)])
        self.blocks[0].other.append(self.blocks[1])
        self.norm = nn.LayerNorm(d)

    def forward(self, idx):
        h = self.emb(idx)
        for b in self.blocks:
            h = b(h)
        return self.norm(h)


def test_blocks_that_cannot_be_split_run_flat_and_a_failed_conversion_restores_them():
    model = _CrossLM().eval()
    x = IDS % 64
    with pytest.raises(ConfigError, match="runs as one graph"):
        dr.convert(model, "attnres", example_inputs=(x,), checkpoint=True)
    assert not any(isinstance(m, ConvertedBlock) for m in model.modules())
    ref = model(x)
    conv = dr.convert(model, "attnres", example_inputs=(x,), inplace=False)
    assert conv.__dict__["_depthrewrite"].blocks is None and "later block" in " ".join(conv.report().notes)
    torch.testing.assert_close(conv(x), ref)


def test_accelerate_hooks_on_blocks_call_the_converted_block():
    from accelerate.hooks import ModelHook, add_hook_to_module

    model = _llama(2).eval()
    want = model(IDS).logits
    for blk in model.model.layers:
        add_hook_to_module(blk, ModelHook())  # what device_map / offloading install on each layer
    conv = dr.convert(model, "block-attnres")
    torch.testing.assert_close(conv(IDS).logits, want)
    conv.train()
    conv(IDS, labels=IDS).loss.backward()  # a later capture runs the original forward through the hook again


def test_accelerate_hooks_added_or_removed_after_conversion():
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_submodules

    conv = dr.convert(_llama(2).eval(), "block-attnres")
    want = conv(IDS).logits
    for blk in conv.model.layers:
        add_hook_to_module(blk, ModelHook())  # its _old_forward is the converted forward
    conv.train()
    conv(IDS, labels=IDS).loss.backward()  # a capture with the hooks on
    conv.eval()
    torch.testing.assert_close(conv(IDS).logits, want)
    remove_hook_from_submodules(conv)
    conv(IDS, attention_mask=torch.ones_like(IDS))  # another capture after the hooks are gone


def test_a_checkpoint_wrapper_inside_a_block_is_not_silently_dropped():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    conv = dr.convert(_llama(2), "block-attnres")
    conv.train()
    conv.model.layers[0].mlp = checkpoint_wrapper(conv.model.layers[0].mlp)
    try:
        conv(IDS, labels=IDS)
    except DepthRewriteError:
        return  # refused loudly: fine
    assert conv.__dict__["_depthrewrite"].recaptures == 1  # or followed: the tree change was seen


def test_an_in_place_write_that_others_read_is_not_split():
    """Splitting reorders operations by their data only; a `fill_` of a tensor that blocks read before and after it
    would move. Such a graph is not split (the flat graph runs); a write nothing else reads is fine."""
    from depthrewrite.blocks import split_blocks

    def graph(shared: bool) -> fx.GraphModule:
        model = nn.Module()
        model.blocks = nn.ModuleList([nn.Identity(), nn.Identity()])
        g = fx.Graph()
        x = g.placeholder("x")
        buf = g.call_function(torch.ops.aten.ones_like.default, (x,))
        a = g.call_function(torch.ops.aten.mul.Tensor, (x, buf if shared else x))
        a.meta["nn_module_stack"] = {"b0": ("blocks.0", nn.Identity)}
        g.call_function(torch.ops.aten.fill_.Scalar, (buf, 2.0))
        b = g.call_function(torch.ops.aten.mul.Tensor, (a, x))
        b.meta["nn_module_stack"] = {"b1": ("blocks.1", nn.Identity)}
        g.output(b)
        return fx.GraphModule(model, g)

    why = split_blocks(graph(True), ("blocks.0", "blocks.1"), lambda blk: False)
    assert isinstance(why, str) and "writes a tensor in place" in why
    assert not isinstance(split_blocks(graph(False), ("blocks.0", "blocks.1"), lambda blk: False), str)


def test_a_value_without_storage_in_the_graph_meta_does_not_break_the_split():
    """transformers' FlexAttention mask functions run under vmap while captured: a node's recorded value can be a
    batched tensor, which has no storage. The in-place analysis skips it instead of failing with a bare RuntimeError."""
    from depthrewrite.blocks import split_blocks

    batched = []
    torch.func.vmap(lambda t: batched.append(t) or t)(torch.ones(2, 3))
    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Identity(), nn.Identity()])
    g = fx.Graph()
    x = g.placeholder("x")
    buf = g.call_function(torch.ops.aten.ones_like.default, (x,))
    buf.meta["val"] = batched[0]
    g.call_function(torch.ops.aten.fill_.Scalar, (buf, 2.0))
    a = g.call_function(torch.ops.aten.mul.Tensor, (x, x))
    a.meta["nn_module_stack"] = {"b0": ("blocks.0", nn.Identity)}
    b = g.call_function(torch.ops.aten.mul.Tensor, (a, x))
    b.meta["nn_module_stack"] = {"b1": ("blocks.1", nn.Identity)}
    g.output(b)
    assert not isinstance(split_blocks(fx.GraphModule(model, g), ("blocks.0", "blocks.1"), lambda blk: False), str)
