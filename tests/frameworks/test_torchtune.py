"""Every scheme converts torchtune 0.6.1: the llama3 and qwen2 model builders, exact at init, and trains one step (tests/frameworks/contract.py)."""

from __future__ import annotations

import importlib.util

import pytest

from .contract import SCHEMES, check_init, check_training_step
from .models import cases

FRAMEWORK = "torchtune"
pytestmark = pytest.mark.skipif(importlib.util.find_spec(FRAMEWORK) is None, reason=f"{FRAMEWORK} is not installed")


@pytest.mark.parametrize("scheme, options, tol", SCHEMES)
@pytest.mark.parametrize("name", cases(FRAMEWORK))
def test_exact_at_init(name, scheme, options, tol):
    check_init(FRAMEWORK, name, scheme, options, tol)


@pytest.mark.parametrize("scheme, options, tol", SCHEMES)
@pytest.mark.parametrize("name", cases(FRAMEWORK))
def test_training_step(name, scheme, options, tol):
    check_training_step(FRAMEWORK, name, scheme, options)


def _hf_checkpoint(model, directory) -> None:
    """``model`` (torchtune llama3, the tiny config of tests/frameworks/models.py) as a Hugging Face checkpoint:
    ``model.safetensors`` in HF key names and the ``config.json`` fields torchtune's HF checkpointer reads."""
    import json

    from safetensors.torch import save_file
    from torchtune.models import convert_weights

    sd = convert_weights.tune_to_hf(model.state_dict(), num_heads=4, num_kv_heads=2, dim=64)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2,
                                                       "hidden_size": 64, "model_type": "llama"}))


def test_checkpointers_load_and_save_a_converted_model(tmp_path):
    """torchtune's checkpointers (docs/frameworks/torchtune.md): an HF checkpoint of the original loads into the
    converted model (only the new ``depthrewrite.*`` keys are missing; logits equal the original's); its own format
    (FullModelTorchTuneCheckpointer) saves every key and loads back exactly; the HF format's converter refuses the new
    keys by name, so the original keys go through it and the new parameters are saved beside it."""
    import torch

    import depthrewrite as dr

    from .models import _stubbed, build

    with _stubbed(FRAMEWORK):
        model, (ids,), _ = build(FRAMEWORK, "llama3")
        from torchtune.training import FullModelHFCheckpointer, FullModelTorchTuneCheckpointer
    src = tmp_path / "hf"
    src.mkdir()
    _hf_checkpoint(model, src)
    want = model(ids)
    hf = FullModelHFCheckpointer(checkpoint_dir=str(src), checkpoint_files=["model.safetensors"], model_type="LLAMA3",
                                 output_dir=str(tmp_path / "out-hf"))
    conv = dr.convert(model, "msar", example_inputs=(ids,))
    got = conv.load_state_dict(hf.load_checkpoint()["model"], strict=False)
    assert got.unexpected_keys == [] and got.missing_keys
    assert all(k.startswith("depthrewrite.") for k in got.missing_keys)
    torch.testing.assert_close(conv(ids), want, rtol=0, atol=1e-5)

    g = torch.Generator().manual_seed(3)  # trained-looking new parameters
    with torch.no_grad():
        for p in conv.depthrewrite.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    trained = conv(ids)

    def fresh():
        m, _, _ = build(FRAMEWORK, "llama3", seed=5)
        return dr.convert(m, "msar", example_inputs=(ids,))

    tune = FullModelTorchTuneCheckpointer(checkpoint_dir=str(src), checkpoint_files=["model.safetensors"],
                                          model_type="LLAMA3", output_dir=str(tmp_path / "out-tune"))
    tune.save_checkpoint({"model": conv.state_dict()}, epoch=0)
    saved = tmp_path / "out-tune" / "epoch_0"
    back = fresh()
    back.load_state_dict(torch.load(next(saved.glob("*.bin")), weights_only=True))
    torch.testing.assert_close(back(ids), trained, rtol=0, atol=0)

    with pytest.raises(Exception, match="unexpected key: \"depthrewrite"):
        hf.save_checkpoint({"model": conv.state_dict()}, epoch=0)
    sd = conv.state_dict()
    hf.save_checkpoint({"model": {k: v for k, v in sd.items() if not k.startswith("depthrewrite.")}}, epoch=1)
    torch.save(conv.depthrewrite.state_dict(), tmp_path / "out-hf" / "epoch_1" / "depthrewrite.pt")
    out = tmp_path / "out-hf" / "epoch_1"
    again = FullModelHFCheckpointer(checkpoint_dir=str(out), model_type="LLAMA3", output_dir=str(tmp_path / "x"),
                                    checkpoint_files=sorted(p.name for p in out.glob("*.safetensors")))
    back = fresh()
    back.load_state_dict(again.load_checkpoint()["model"], strict=False)
    back.depthrewrite.load_state_dict(torch.load(out / "depthrewrite.pt", weights_only=True))
    torch.testing.assert_close(back(ids), trained, rtol=0, atol=0)


@pytest.mark.parametrize("scheme, options, tol", SCHEMES)
def test_generate_without_caches_gives_the_originals_tokens(scheme, options, tol):
    """torchtune's own ``generate`` without ``setup_caches`` (what the CaptureError for its KV cache says to do):
    greedy (top_k=1) tokens of the converted model equal the original's at init, for every scheme in its exact
    form."""
    import warnings

    import torch

    import depthrewrite as dr

    from .models import _stubbed, build

    with _stubbed(FRAMEWORK):
        model, (ids,), _ = build(FRAMEWORK, "llama3")
        from torchtune.generation import generate
    prompt = ids[:, :6]
    want, _ = generate(model, prompt, max_generated_tokens=3, top_k=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conv = dr.convert(model, scheme, example_inputs=(ids,), **options)
    got, _ = generate(conv, prompt, max_generated_tokens=3, top_k=1)
    assert torch.equal(got, want)
