"""torchao on a converted model (issue #24 item 3): ``quantize_`` after conversion gives what it gives on the original.

torchao swaps each ``nn.Linear``'s weight for a tensor subclass (``Int8Tensor``) that implements ``F.linear``. A
converted model that calls its Linears as live modules (module calls) runs them as they are, with no recapture;
graphs that read a weight with their own aten ops (``aten.linear`` runs as ``t`` + ``mm`` below
``__torch_function__``, which ``Int8Tensor`` does not implement) are captured again through the subclass on the next
call. Either way the quantized converted model computes what the quantized original computes. float8 training needs
a GPU (bench/gpu.sh runs that test there)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import depthrewrite as dr
from depthrewrite.demo.zoo import hf_model
from depthrewrite.testing import sqnr

torchao = pytest.importorskip("torchao", reason="torchao is not installed (CI installs torchao 0.18: .ci/run)")
from torchao.quantization import (  # noqa: E402
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    quantize_,
)

PRESERVING = ("attnres", "msar", "mhc", "block-msar")  # exact at init: quantized, they equal the quantized original


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    model = hf_model("llama", layers=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    return model, ids


def _converted(base: nn.Module, scheme: str, module_calls: bool) -> nn.Module:
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dr.convert(copy.deepcopy(base), scheme, module_calls=module_calls)


def _quantized(model: nn.Module, config) -> nn.Module:
    quantize_(model, config)
    return model


@pytest.mark.parametrize("module_calls", [True, False], ids=["module-calls", "inlined"])
@pytest.mark.parametrize("scheme", [*PRESERVING, "moda"])
def test_int8_weight_only_after_conversion(llama, scheme, module_calls):
    base, ids = llama
    model = _converted(base, scheme, module_calls)
    twin = copy.deepcopy(model)  # the same converted model, to get the dequantized weights
    with torch.no_grad():
        model(ids)  # the graphs are captured with float weights
    st = model._depthrewrite
    captures = st.captures
    _quantized(model, Int8WeightOnlyConfig())
    assert type(model.model.layers[0].self_attn.q_proj.weight).__name__ == "Int8Tensor"
    with torch.no_grad():
        out = model(ids).logits
    # module calls run the quantized Linears live (no recapture); inlined graphs are captured again through them
    assert st.captures - captures == (0 if module_calls else 1)
    # reference 1: the float converted model with each weight replaced by its dequantized value
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, nn.Linear):
                twin.get_submodule(name).weight.copy_(mod.weight.dequantize())
        torch.testing.assert_close(out, twin(ids).logits, rtol=1e-4, atol=1e-4)
    if scheme in PRESERVING:  # reference 2: the quantized original
        ref = _quantized(copy.deepcopy(base), Int8WeightOnlyConfig())
        with torch.no_grad():
            torch.testing.assert_close(out, ref(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", ["attnres", "mhc", "moda"])
def test_int8_dynamic_activation_after_conversion(llama, scheme):
    """Dynamic activation quantisation rounds each token's activations: a 1e-7 difference in the input can move one
    to the next step, so the comparison is by signal-to-noise ratio (torchao's own measure): quantising the converted
    model costs what quantising the original costs, and a scheme exact at init stays closer to the quantized original
    than quantisation itself is to the float model."""
    base, ids = llama
    with torch.no_grad():
        original = copy.deepcopy(base)
        f = original(ids).logits
        q = _quantized(original, Int8DynamicActivationInt8WeightConfig())(ids).logits
        model = _converted(base, scheme, True)
        mf = model(ids).logits
        mq = _quantized(model, Int8DynamicActivationInt8WeightConfig())(ids).logits
    own, theirs = sqnr(mf, mq), sqnr(f, q)
    assert abs(own - theirs) < 1.0, (own, theirs)
    if scheme != "moda":
        assert sqnr(q, mq) > theirs, (sqnr(q, mq), theirs)


def test_quantized_converted_model_trains_its_new_parameters(llama):
    """Weight-only int8 freezes the Linears (their weights do not require grad); the depth-mixing parameters and the
    norms still train through the quantized model."""
    base, ids = llama
    model = _quantized(_converted(base, "attnres", True), Int8WeightOnlyConfig())
    model.train()
    loss = model(ids, labels=ids).loss
    loss.backward()
    new = [p for n, p in model.named_parameters() if n.startswith("depthrewrite.")]
    assert new and all(p.grad is not None and torch.isfinite(p.grad).all() for p in new)
    assert model.model.norm.weight.grad is not None


def test_float8_training_after_conversion(llama):
    """``convert_to_float8_training`` swaps Linears for Float8Linear modules: a module swap at leaf paths, which a
    converted model recaptures through. float8 matmuls need a GPU with compute capability 8.9 or higher."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 training needs a CUDA GPU with compute capability >= 8.9 (bench/gpu.sh runs this test)")
    from torchao.float8 import convert_to_float8_training

    torch.manual_seed(0)
    model = hf_model("llama", layers=2, hidden=256).cuda().bfloat16()
    ids = torch.randint(0, model.config.vocab_size, (2, 64), device="cuda")
    original = copy.deepcopy(model)
    convert_to_float8_training(original)
    dr.convert(model, "attnres", module_calls=True)
    convert_to_float8_training(model, module_filter_fn=lambda m, fqn: not fqn.startswith("depthrewrite"))
    a, b = original(ids, labels=ids), model(ids, labels=ids)
    torch.testing.assert_close(b.logits, a.logits, rtol=0.05, atol=0.05)
    b.loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if n.startswith("depthrewrite."))


@pytest.mark.parametrize("scheme", ["attnres", "moda"])
def test_quantize_then_convert(llama, scheme):
    """Quantising first: the capture traces through the subclass weights (``mm`` of the int8 data, ``mul`` by the
    scale). MoDA's FFN-slot keys replay the attention's key path after the k projection, never the scale of its
    weight: they equal the float MoDA model with the dequantized weights."""
    base, ids = llama
    quantized = _quantized(copy.deepcopy(base), Int8WeightOnlyConfig())
    model = _converted(quantized, scheme, True)
    float_twin = _converted(base, scheme, True)
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, nn.Linear):
                float_twin.get_submodule(name).weight.copy_(mod.weight.dequantize())
        float_twin.load_state_dict({k: v for k, v in model.state_dict().items() if k.startswith("depthrewrite.")},
                                   strict=False)
        torch.testing.assert_close(model(ids).logits, float_twin(ids).logits, rtol=1e-4, atol=1e-4)
