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
