"""The typed-error floor of a converted model: module tools it would bypass, and export's shape guards.

The converted graph reads the weights directly (``get_attr``) and never calls the submodules, so hooks on a
submodule, a replaced submodule (peft's LoRA does ``setattr(parent, name, lora_module)``) and global module hooks
would be ignored; every call checks the module tree recorded at conversion and raises ``ModuleTreeChangedError``
instead. A dimension export fixed at the example inputs raises ``CaptureGuardError`` instead of export's
``AssertionError("Guard failed: ...")``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import depthrewrite as dr
from depthrewrite.demo.zoo import hf_model
from depthrewrite.errors import CaptureGuardError, ConfigError, DepthRewriteError, ModuleTreeChangedError

IDS = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
Q = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def conv():
    torch.manual_seed(0)
    return dr.convert(hf_model("llama", layers=2).eval(), "attnres")


def _raises(conv, module):
    with pytest.raises(ModuleTreeChangedError) as e:
        conv(input_ids=IDS)
    assert e.value.module == module and isinstance(e.value, (ConfigError, DepthRewriteError))
    assert "convert it again" in str(e.value)
    return e.value


@pytest.mark.parametrize("kind", ["forward", "forward_pre", "full_backward", "full_backward_pre"])
def test_hook_on_a_submodule_raises_naming_it(conv, kind):
    fired = []
    handle = getattr(conv.get_submodule(Q), f"register_{kind}_hook")(lambda *a: fired.append(1))
    try:
        err = _raises(conv, Q)
        assert repr(Q) in str(err) and "hook" in str(err)
    finally:
        handle.remove()
    assert fired == []
    conv(input_ids=IDS)  # removing the hook makes the model callable again


def test_replaced_submodule_raises_naming_it(conv):
    """What peft's LoRA injection does: the graph would keep reading ``q_proj.weight`` and skip the adapter."""
    parent = conv.get_submodule("model.layers.0.self_attn")
    old = parent.q_proj
    parent.q_proj = nn.Linear(64, 64)  # has a .weight of the right shape: the graph would silently read it
    try:
        err = _raises(conv, Q)
        assert "replaced" in str(err) and "Linear" in str(err)
    finally:
        parent.q_proj = old
    conv(input_ids=IDS)



def test_a_change_before_a_pipeline_split_is_still_reported():
    """split() records the tree again after placing its cuts; it must not take a replaced submodule as the new tree."""
    import depthrewrite.pipeline as pp

    conv = dr.convert(hf_model("llama", layers=2).eval(), "attnres", blocks=2)
    conv.get_submodule("model.layers.0.self_attn").q_proj = nn.Linear(64, 64)
    with pytest.raises(ModuleTreeChangedError) as e:
        pp.split(conv, 2)
    assert e.value.module == Q and "replaced" in str(e.value)

def test_added_and_removed_submodules_raise(conv):
    layer = conv.get_submodule("model.layers.1")
    layer.adapter = nn.Linear(4, 4)
    try:
        assert "added" in str(_raises(conv, "model.layers.1.adapter"))
    finally:
        del layer.adapter
    mlp = layer.mlp
    del layer.mlp
    try:
        assert "removed" in str(_raises(conv, "model.layers.1.mlp"))
    finally:
        layer.mlp = mlp
    conv(input_ids=IDS)


@pytest.mark.parametrize("kind", ["forward", "forward_pre", "full_backward"])
def test_global_module_hook_raises(conv, kind):
    register = getattr(torch.nn.modules.module, f"register_module_{kind}_hook")
    handle = register(lambda *a: None)
    try:
        err = _raises(conv, None)
        assert "global module hook" in str(err)
    finally:
        handle.remove()
    conv(input_ids=IDS)


def test_hooks_on_the_converted_model_itself_fire(conv):
    seen = []
    handles = [
        conv.register_forward_pre_hook(lambda m, a, k: seen.append("pre"), with_kwargs=True),
        conv.register_forward_hook(lambda m, a, o: seen.append("post")),
    ]
    try:
        conv(input_ids=IDS)
    finally:
        for h in handles:
            h.remove()
    assert seen == ["pre", "post"]


def test_no_false_positive_on_an_untouched_model():
    torch.manual_seed(0)
    conv = dr.convert(hf_model("llama", layers=2).eval(), "attnres")
    for _ in range(20):
        conv(input_ids=IDS)
    conv.train()
    conv(input_ids=IDS).logits.sum().backward()
    conv.eval()
    with torch.no_grad():
        conv(input_ids=IDS[:1, :5])
    conv.half()
    assert conv(input_ids=IDS).logits.dtype == torch.float16
    conv.to(torch.float64)
    assert conv(input_ids=IDS).logits.dtype == torch.float64
    conv.load_state_dict(conv.state_dict())
    conv(input_ids=IDS)


def test_the_check_runs_under_torch_compile():
    torch.manual_seed(0)
    conv = dr.convert(hf_model("llama", layers=2).eval(), "attnres")
    compiled = torch.compile(conv, backend="eager")
    compiled(input_ids=IDS)
    handle = conv.get_submodule(Q).register_forward_hook(lambda *a: None)
    try:
        with pytest.raises(ModuleTreeChangedError):
            compiled(input_ids=IDS)
    finally:
        handle.remove()
    compiled(input_ids=IDS)


@pytest.fixture(scope="module")
def cpmant():
    """CPM-Ant's conversion specialises the sequence length to the example's (16)."""
    torch.manual_seed(0)
    return dr.convert(hf_model("cpmant", layers=2).eval(), "attnres")


def test_capture_guard_is_a_typed_error(cpmant):
    cpmant(input_ids=IDS)  # the captured length runs; so does another batch size
    cpmant(input_ids=torch.cat([IDS, IDS]))
    with pytest.raises(CaptureGuardError) as e:
        cpmant(input_ids=IDS[:, :12])
    err = e.value
    assert isinstance(err, ConfigError) and not isinstance(err, AssertionError)
    assert (err.input, err.dim, err.captured, err.given) == ("input_ids", 1, 16, 12)
    msg = str(err)
    assert "'input_ids'" in msg and "fixed to 16" in msg and "gives 12" in msg and "example inputs" in msg


class _Fixed(nn.Module):
    """A model whose forward specialises the token dim (an explicit size check), not an HF model."""

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


def test_only_guard_failures_are_retyped():
    """The wrapper retypes export's ``Guard failed: ...`` assertions only; any other AssertionError passes."""
    from depthrewrite.converted import _typed_guards

    for message, expected in (("something else", AssertionError), ("Guard failed: x.size()[0] <= 64", CaptureGuardError)):
        gm = torch.fx.symbolic_trace(nn.Identity())
        guards = nn.Module()

        def fail(*args, message=message):
            raise AssertionError(message)

        guards.forward = fail
        gm.add_submodule("_guards_fn", guards)
        _typed_guards(gm)
        with pytest.raises(expected) as e:
            gm._guards_fn(torch.zeros(70))
        if expected is CaptureGuardError:
            assert e.value.guard == "x.size()[0] <= 64" and e.value.given is None and "x.size()[0] <= 64" in str(e.value)
        else:
            assert str(e.value) == "something else"


def test_hand_written_model_with_a_fixed_dim():
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 8))
    conv = dr.convert(_Fixed(), "attnres", example_inputs=(ids,))
    conv(ids)
    with pytest.raises(CaptureGuardError) as e:
        conv(ids[:, :5])
    assert (e.value.dim, e.value.captured, e.value.given) == (1, 8, 5)
