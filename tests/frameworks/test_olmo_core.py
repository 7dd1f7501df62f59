"""Every scheme converts OLMo-core 3.0.0: TransformerConfig.llama_like and the OLMo2 block (reordered norms + QK-norm), exact at init, and trains one step (tests/frameworks/contract.py)."""

from __future__ import annotations

import importlib.util

import pytest

from .contract import SCHEMES, check_init, check_training_step
from .models import cases

FRAMEWORK = "olmo_core"
pytestmark = pytest.mark.skipif(importlib.util.find_spec(FRAMEWORK) is None, reason=f"{FRAMEWORK} is not installed")


@pytest.mark.parametrize("scheme, options, tol", SCHEMES)
@pytest.mark.parametrize("name", cases(FRAMEWORK))
def test_exact_at_init(name, scheme, options, tol):
    check_init(FRAMEWORK, name, scheme, options, tol)


@pytest.mark.parametrize("scheme, options, tol", SCHEMES)
@pytest.mark.parametrize("name", cases(FRAMEWORK))
def test_training_step(name, scheme, options, tol):
    check_training_step(FRAMEWORK, name, scheme, options)


@pytest.mark.parametrize("scheme, options", [("attnres", {"blocks": 2}), ("msar", "exact"), ("mhc", "exact"),
                                             ("moda", "exact")], ids=["block-attnres", "msar", "mhc", "moda"])
def test_init_weights_and_generation_module(scheme, options):
    """OLMo-core's own flows re-initialise a model in place: ``Transformer.init_weights`` (which its train and
    generation modules call after parallelising) runs ``to_empty`` and then every module's ``reset_parameters``. The
    new parameters reset to their init with it (they used to stay uninitialised memory: NaN logits), so the
    converted model is again the original function, and ``TransformerGenerationModule.generate_batch`` (greedy, no
    cache: OLMo-core's torch attention backend has none) gives the original's tokens."""
    import torch

    import depthrewrite as dr

    from .models import _stubbed, build

    with _stubbed(FRAMEWORK):
        from olmo_core.generate.generation_module import GenerationConfig, TransformerGenerationModule
    model, args, kwargs = build(FRAMEWORK, "llama_like")
    opts = dict(dr.scheme(scheme).exact) if options == "exact" else options
    conv = dr.convert(model, scheme, example_inputs=args, inplace=False, **opts)
    with torch.no_grad():
        for p in conv.depthrewrite.parameters():  # trained-looking: init_weights must put them back
            p.add_(torch.randn_like(p))
    conv.init_weights(max_seq_len=64, device=torch.device("cpu"))
    model.init_weights(max_seq_len=64, device=torch.device("cpu"))  # the same seeded init for the original
    with torch.no_grad():
        torch.testing.assert_close(conv(*args), model(*args), rtol=1e-5, atol=1e-5)
    cfg = GenerationConfig(pad_token_id=0, eos_token_id=1, max_new_tokens=5, do_sample=False, use_cache=False)
    prompt = args[0][:1, :5]
    got = TransformerGenerationModule(conv, cfg, device=torch.device("cpu")).generate_batch(prompt, log_timing=False)
    want = TransformerGenerationModule(model, cfg, device=torch.device("cpu")).generate_batch(prompt, log_timing=False)
    assert got[0].tolist() == want[0].tolist()


@pytest.mark.parametrize("scheme, options", [("attnres", {"blocks": 2}), ("mhc", "exact")], ids=["block-attnres", "mhc"])
def test_kv_cache_is_refused_by_name_and_the_uncached_path_stays_exact(scheme, options):
    """OLMo-core's only KV cache (``use_cache=True``: ``kv_cache_manager`` modules the generation module adds to each
    attention, written in place by flash-attn's ``flash_attn_with_kvcache``) tried on a CPU through a stand-in for
    those flash-attn functions. The original decodes with it (the stand-in is right: its tokens equal the uncached
    ones). The converted model's capture cannot follow it (the RoPE offset and write positions come from the cache's
    own buffer): a CaptureError naming the cache module and ``use_cache=False``, nothing generated silently; with
    ``use_cache=False`` (which frees the cache modules) the uncached path gives the original's tokens."""
    import torch

    import depthrewrite as dr
    from depthrewrite.errors import CaptureError

    from .flash_stand_in import build_olmo_flash, olmo_flash_on_cpu
    from .models import _stubbed

    with _stubbed(FRAMEWORK):
        from olmo_core.generate.generation_module import GenerationConfig, TransformerGenerationModule
    with olmo_flash_on_cpu():
        model, args, _ = build_olmo_flash()
        assert type(model.blocks["0"].attention.backend).__name__ == "FlashAttention2Backend"
        opts = dict(dr.scheme(scheme).exact) if options == "exact" else options
        conv = dr.convert(model, scheme, example_inputs=args, inplace=False, **opts)
        prompt = args[0][:1, :5]

        def generate(m, cache):
            cfg = GenerationConfig(pad_token_id=0, eos_token_id=1, max_new_tokens=5, do_sample=False, use_cache=cache)
            gen = TransformerGenerationModule(m, cfg, device=torch.device("cpu"))
            return gen.generate_batch(prompt, log_timing=False)[0].tolist()

        want = generate(model, False)
        assert generate(model, True) == want
        with pytest.raises(CaptureError, match=r"blocks\.\d+\.attention\.kv_cache_manager \(KVCacheManager, one of 2\).*"
                                               r"use_cache=False.*free_inference_cache"):
            generate(conv, True)
        assert generate(conv, False) == want  # use_cache=False removes the cache modules first
