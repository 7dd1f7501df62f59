"""Regressions from the transformers sweep (``python -m bench.sweep``): model types the zoo could not build tiny."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from depthrewrite.demo.zoo import hf_model  # noqa: E402


def test_xlnet_builds_tiny():
    """XLNetConfig's max_position_embeddings is a property whose setter raises NotImplementedError (no sequence length
    limit), and it names the head size d_head (checked == d_model // n_head): the zoo drops the one, passes the other."""
    model = hf_model("xlnet", layers=2)
    cfg = model.config
    assert type(model).__name__ == "XLNetLMHeadModel"
    assert (cfg.n_layer, cfg.d_model, cfg.d_head) == (2, 64, 64 // cfg.n_head)
    assert cfg.max_position_embeddings == -1  # XLNet's own "no limit"


def test_property_fields_still_pass_elsewhere():
    """The retry without property fields is only taken when the first try fails: llama keeps every small size."""
    cfg = hf_model("llama", layers=2).config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.max_position_embeddings, cfg.head_dim) == (2, 64, 512, 16)


def test_xlnet_convert_is_a_typed_refusal():
    """XLNet is PostNorm: given token ids, convert refuses it with a DepthRewriteError, never a plain error. (Without
    example inputs, capture.example_inputs_for reads max_position_embeddings == -1 as the length limit: see the sweep
    report; once that is fixed this holds for convert(model, ...) alone.)"""
    import torch

    import depthrewrite as dr
    from depthrewrite.errors import DepthRewriteError

    model = hf_model("xlnet", layers=2)
    ids = torch.randint(0, 256, (2, 8))
    with pytest.raises(DepthRewriteError):
        dr.convert(model, "attnres", example_kwargs={"input_ids": ids}, inplace=False)


@pytest.mark.parametrize("scheme", ["attnres", "mhc", "moda", "msar"])
def test_xlnet_convert_without_inputs_is_a_typed_refusal(scheme):
    """XLNet's max_position_embeddings is -1 ("no limit"): the example inputs take the default length, and convert
    ends in the typed PostNorm refusal (was a RuntimeError on a tensor of negative size)."""
    import depthrewrite as dr
    from depthrewrite.errors import DepthRewriteError

    with pytest.raises(DepthRewriteError):
        dr.convert(hf_model("xlnet", layers=2), scheme)


# ---- an unknown type, and types the zoo could not build before (issue #23) ----------------------------------------


def test_an_unknown_hf_type_from_python_is_a_short_config_error():
    """dr.inspect("hf:<unknown>") is the zoo's short typed error naming the type and the closest known ones, not
    transformers' message listing every model type (several kB)."""
    import depthrewrite as dr
    from depthrewrite.errors import ConfigError

    with pytest.raises(ConfigError) as ei:
        dr.inspect("hf:nonexistent")
    msg = str(ei.value)
    assert "unknown Hugging Face model type 'nonexistent'" in msg and len(msg) < 400
    with pytest.raises(ConfigError, match="did you mean llama") as ei:
        hf_model("lama")
    assert len(str(ei.value)) < 400


def test_a_type_the_zoo_does_not_build_says_why():
    """A draft (assistant) model is no language model alone: a ConfigError with the reason, not a ValueError out of
    its forward."""
    from depthrewrite.errors import ConfigError

    with pytest.raises(ConfigError, match="gemma4_assistant is not built: .*draft"):
        hf_model("gemma4_assistant", layers=2)


def test_mla_sizes_follow_the_tiny_head_dim():
    """Multi-head latent attention (DeepSeek-V3): the rope / no-position parts of the query-key head, the low ranks and
    the head_dim the rotary embedding reads are set together, and one MoE layer is kept in the 2-layer stack."""
    cfg = hf_model("deepseek_v3", layers=2).config
    assert (cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.head_dim) == (8, 8, 16, 8)
    assert cfg.kv_lora_rank == cfg.q_lora_rank == 32 and cfg.num_key_value_heads == cfg.num_attention_heads
    assert cfg.first_k_dense_replace == 1 and 4 // cfg.n_group >= 2


@pytest.mark.parametrize("model_type", ["deepseek_v3", "gpt_neo"])
def test_newly_built_types_convert_exactly_with_attnres(model_type):
    """Types the sweep had as "not built" (MLA's head sizes; GPT-Neo's attention_types for 24 layers) build tiny, and
    attnres with its exact-at-init options is the same function."""
    import depthrewrite as dr
    from depthrewrite.capture import example_inputs_for

    model = hf_model(model_type, layers=2)
    args, kwargs = example_inputs_for(model)
    conv = dr.convert(model, "attnres", **dict(dr.scheme("attnres").exact), inplace=False)
    res = dr.check_equivalence(conv, model, *args, **kwargs)
    assert res, str(res)
