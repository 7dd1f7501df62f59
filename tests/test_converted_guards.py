"""Module tools and shapes on a converted model: what is followed (recaptured) and what is a typed error.

Each call compares a fingerprint of the module tree (submodules, classes, parameter/buffer identities, hook dicts)
with the one its graphs were captured from; a change drops the graphs and the call recaptures, so hooks, replaced,
added and removed submodules are in the graph. Global module hooks run for the modules the graphs call. A dimension
export fixed at capture gets a graph of its own per size.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import depthrewrite as dr
from depthrewrite.demo.zoo import hf_model
from depthrewrite.errors import CaptureError

IDS = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
Q = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def conv():
    torch.manual_seed(0)
    return dr.convert(hf_model("llama", layers=2).eval(), "attnres")


def _logits(conv):
    with torch.no_grad():
        return conv(input_ids=IDS).logits


@pytest.mark.parametrize("kind", ["forward", "forward_pre"])
def test_hook_on_a_submodule_is_followed(conv, kind):
    """Module calls (the default): the hooked projection is called as the live module, so its hook runs on every
    call with no warning."""
    ref = _logits(conv)
    scale = (lambda m, a, o: o * 2) if kind == "forward" else (lambda m, a: (a[0] * 2,))
    handle = getattr(conv.get_submodule(Q), f"register_{kind}_hook")(scale)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            hooked = _logits(conv)
            assert (hooked - ref).abs().max() > 1e-5  # the hook's effect is in the call
            torch.testing.assert_close(_logits(conv), hooked)
    finally:
        handle.remove()
    torch.testing.assert_close(_logits(conv), ref)


@pytest.mark.parametrize("kind", ["forward", "forward_pre"])
def test_hook_on_a_submodule_is_traced_with_a_warning_when_inlined(kind):
    """module_calls=False: every graph runs aten ops, so a hook is traced into the recaptured graph and its side
    effects happen at capture only (said once per hook)."""
    torch.manual_seed(0)
    inlined = dr.convert(hf_model("llama", layers=2).eval(), "attnres", module_calls=False)
    ref = _logits(inlined)
    scale = (lambda m, a, o: o * 2) if kind == "forward" else (lambda m, a: (a[0] * 2,))
    handle = getattr(inlined.get_submodule(Q), f"register_{kind}_hook")(scale)
    try:
        with pytest.warns(UserWarning, match=r"traced into the converted model's graph"):
            hooked = _logits(inlined)
        assert (hooked - ref).abs().max() > 1e-5  # the hook's effect is in the recaptured graph
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once per hook
            torch.testing.assert_close(_logits(inlined), hooked)
    finally:
        handle.remove()
    torch.testing.assert_close(_logits(inlined), ref)


def test_replaced_submodule_is_followed(conv):
    """What peft's LoRA injection does: the graph is recaptured through the new module."""
    ref = _logits(conv)
    parent = conv.get_submodule("model.layers.0.self_attn")
    old = parent.q_proj
    parent.q_proj = nn.Linear(64, 64)
    try:
        assert (_logits(conv) - ref).abs().max() > 1e-5
    finally:
        parent.q_proj = old
    torch.testing.assert_close(_logits(conv), ref)


def test_added_and_removed_submodules_are_followed(conv):
    ref = _logits(conv)
    layer = conv.get_submodule("model.layers.1")
    layer.adapter = nn.Linear(4, 4)  # added, unused by forward: same function, recaptured
    try:
        torch.testing.assert_close(_logits(conv), ref)
    finally:
        del layer.adapter
    mlp = layer.mlp
    del layer.mlp  # forward needs it: the recapture fails as a typed CaptureError, not a bare AttributeError
    try:
        with pytest.raises(CaptureError):
            _logits(conv)
    finally:
        layer.mlp = mlp
    torch.testing.assert_close(_logits(conv), ref)


def test_a_reassigned_parameter_is_followed(conv):
    ref = _logits(conv)
    lin = conv.get_submodule(Q)
    old = lin.weight
    lin.weight = nn.Parameter(old.detach() * 0)
    try:
        assert (_logits(conv) - ref).abs().max() > 1e-5
    finally:
        lin.weight = old
    torch.testing.assert_close(_logits(conv), ref)


@pytest.mark.parametrize("kind", ["forward", "forward_pre", "full_backward"])
def test_global_module_hook_runs_for_the_called_modules(conv, kind):
    """With module calls (the default) a global module hook runs for the modules the graphs call; a conversion that
    inlines every module raises ModuleTreeChangedError (tests/test_still_the_model.py)."""
    register = getattr(torch.nn.modules.module, f"register_module_{kind}_hook")
    seen = []
    handle = register(lambda m, *a: seen.append(type(m).__name__))
    try:
        conv(input_ids=IDS).logits.float().pow(2).mean().backward()
    finally:
        handle.remove()
    assert "Linear" in seen and "LlamaMLP" in seen
    conv.zero_grad(set_to_none=True)


def test_hooks_on_the_converted_model_itself_fire(conv):
    seen = []
    handles = [
        conv.register_forward_pre_hook(lambda m, a, k: seen.append("pre"), with_kwargs=True),
        conv.register_forward_hook(lambda m, a, o: seen.append("post")),
    ]
    try:
        conv(input_ids=IDS)
        conv(input_ids=IDS)
    finally:
        for h in handles:
            h.remove()
    assert seen == ["pre", "post"] * 2


def test_no_recapture_on_an_untouched_model():
    torch.manual_seed(0)
    conv = dr.convert(hf_model("llama", layers=2).eval(), "attnres")
    st = conv.__dict__["_depthrewrite"]
    for _ in range(5):
        conv(input_ids=IDS)
    conv.train()
    conv(input_ids=IDS).logits.sum().backward()
    conv.eval()
    conv.load_state_dict(conv.state_dict())
    conv(input_ids=IDS)
    assert st.recaptures == 0 and st.captures == 2  # eval (at conversion) and train
    conv.half()
    assert conv(input_ids=IDS).logits.dtype == torch.float16
    conv.to(torch.float64)
    assert conv(input_ids=IDS).logits.dtype == torch.float64


def test_the_tree_is_followed_under_torch_compile():
    torch.manual_seed(0)
    conv = dr.convert(hf_model("llama", layers=2).eval(), "attnres")
    compiled = torch.compile(conv, backend="eager")
    ref = compiled(input_ids=IDS).logits
    parent = conv.get_submodule("model.layers.0.self_attn")
    old = parent.q_proj
    parent.q_proj = nn.Linear(64, 64)
    try:
        assert (compiled(input_ids=IDS).logits - ref).abs().max() > 1e-5
    finally:
        parent.q_proj = old
    torch.testing.assert_close(compiled(input_ids=IDS).logits, ref)


def test_a_fixed_dimension_gets_a_graph_per_size():
    """CPM-Ant's graph specialises the sequence length to the example's (16): 12 tokens get a graph of their own."""
    torch.manual_seed(0)
    model = hf_model("cpmant", layers=2).eval()
    refs = {n: model(input_ids=IDS[:, :n]).logits for n in (16, 12)}
    conv = dr.convert(model, "attnres", inplace=False)
    conv(input_ids=torch.cat([IDS, IDS]))  # another batch size runs in the same graph
    for n in (16, 12, 16):
        torch.testing.assert_close(conv(input_ids=IDS[:, :n]).logits, refs[n], atol=1e-4, rtol=1e-4)
    assert len(conv.report().graphs) == 2


class _Fixed(nn.Module):
    """A model whose forward itself refuses other lengths (an explicit size check), not an HF model."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16)) for _ in range(2))
        self.norm = nn.LayerNorm(16)

    def forward(self, ids):
        torch._check(ids.shape[1] == 8)
        h = self.emb(ids)
        for b in self.blocks:
            h = h + b(h)
        return self.norm(h)


def test_a_length_the_model_refuses_is_a_capture_error():
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 8))
    conv = dr.convert(_Fixed(), "attnres", example_inputs=(ids,))
    conv(ids)
    with pytest.raises(CaptureError, match="could not capture"):
        conv(ids[:, :5])


def test_derived_size_guards():
    """A size derived from one symbol must equal its expression of that symbol's value; one that cannot be evaluated
    passes and leaves the call to export's own input check (the entry is no longer complete)."""
    import sympy

    from depthrewrite.runtime.entries import Derived, GraphEntry

    s0 = sympy.Symbol("s0", integer=True, positive=True)
    entry = GraphEntry(module=None, structure="t", guards=({0: ("s0", 2, None)}, {1: Derived(s0 + 1)}), seconds=0.0)
    assert entry.complete
    assert entry.matches([torch.zeros(3), torch.zeros(2, 4)])
    assert not entry.matches([torch.zeros(3), torch.zeros(2, 5)])
    odd = GraphEntry(module=None, structure="t", guards=({0: ("s0", 2, None)}, {0: Derived(sympy.Function("f")(s0))}),
                     seconds=0.0)
    assert odd.complete and odd.matches([torch.zeros(3), torch.zeros(9)]) and not odd.complete


def test_a_called_module_whose_weight_became_a_shard_is_resharded():
    """A module the graphs call is opaque to the module-tree check, except that every tensor shape it held must
    still be there: a weight replaced by a smaller local shard (tensor parallelism with plain tensors, torchtitan's
    spmd_types) may change its output's size, so the graphs around it are captured again. Tensors added beside the
    old ones (a LoRA layer's) or of the same shape (a quantized or resharded-as-DTensor weight) are no change."""
    from depthrewrite.runtime.tree import ModuleTree

    root = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    before = ModuleTree(root, {"0": True})
    assert before.called_shapes["0"] == {(8, 4): 1, (8,): 1}
    root[0].extra = nn.Linear(4, 2)  # LoRA-like: beside the old weight
    assert before.resharded(ModuleTree(root, {"0": True})) is None
    root[0].weight = nn.Parameter(torch.zeros(8, 4))  # the same shape, another tensor
    assert before.resharded(ModuleTree(root, {"0": True})) is None
    root[0].weight = nn.Parameter(torch.zeros(4, 4))  # a shard
    assert before.resharded(ModuleTree(root, {"0": True})) == ("0", (8, 4))


class AllReduced(nn.Module):
    """A Linear whose output is all-reduced over the default process group in its own forward, as a row-parallel
    layer's code does under tensor parallelism with plain local tensors (torchtitan's ``spmd_types``)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        import torch.distributed as dist
        from torch.distributed._functional_collectives import all_reduce

        return all_reduce(self.inner(x), "sum", dist.group.WORLD)


def traced_collective_model() -> nn.Module:
    """A tiny Llama whose MLPs all-reduce their output (call inside an initialised process group)."""
    torch.manual_seed(0)
    model = hf_model("llama", layers=2)
    for blk in model.model.layers:
        blk.mlp.down_proj = AllReduced(blk.mlp.down_proj)
    return model


def test_a_backward_through_traced_communication_is_a_config_error(tmp_path):
    """With module calls off, the MLP's all-reduce is traced into the graph: its forward is exact (one rank here),
    but a tensor-parallel plan's backward communication would not be in the graph, so a backward is refused, naming
    the collective and its module; without gradients nothing is refused. (Under torchtitan's spmd_types TP this was
    0.03 off in the gradients, silently: tests/frameworks/test_fsdp_recipes.py.)"""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = traced_collective_model()
        want = model(IDS, labels=IDS).loss.item()
        conv = dr.convert(model, "attnres", module_calls=False)
        conv.train()
        out = conv(IDS, labels=IDS)
        assert abs(out.loss.item() - want) < 1e-5
        with pytest.raises(dr.ConfigError, match=r"_c10d_functional\.all_reduce in model\.layers\.0\.mlp\.down_proj"):
            out.loss.backward()
        with torch.no_grad():
            assert abs(conv(IDS, labels=IDS).loss.item() - want) < 1e-5
        called = dr.convert(traced_collective_model(), "attnres")  # module calls: the MLP runs live, nothing traced
        called(IDS, labels=IDS).loss.backward()
    finally:
        dist.destroy_process_group()
