"""What a training step keeps for backward (bench/training.py's count), on small models: Block AttnRes and Block MSAR
with activation checkpointing keep about what the checkpointed original keeps, with and without a KV cache in the
model's config (HF configs such as ``transformers.LlamaConfig`` turn it on by default; a training call then captures
a cached graph, which for MSAR carries its conv history)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import depthrewrite as dr
from bench.training import step_bytes
from depthrewrite.demo.zoo import hf_model

SEQ = 64


def _llama(use_cache: bool) -> nn.Module:
    """head_dim 32 (2 heads of 32 at hidden 64), as the config of the 1.75x report; 4 layers."""
    torch.manual_seed(0)
    return hf_model("llama", layers=4, hidden=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                    intermediate_size=128, use_cache=use_cache, max_position_embeddings=SEQ + 8,
                    attention_dropout=0.0).train()


def _ids(model: nn.Module) -> torch.Tensor:
    return torch.randint(3, model.config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(1))


def _randomise(conv: nn.Module) -> None:
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in conv.depthrewrite.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache-on", "cache-off"])
def test_block_schemes_with_checkpointing_keep_what_the_original_keeps(use_cache):
    base = _llama(use_cache)
    base.activation_checkpointing_enable()
    ref, _ = step_bytes(base, _ids(base))
    for scheme in ("block-attnres", "block-msar"):
        model = _llama(use_cache)
        conv = dr.convert(model, scheme, blocks=2, example_inputs=(_ids(model),))
        conv.activation_checkpointing_enable()
        saved, _ = step_bytes(conv, _ids(conv))
        assert saved <= 1.3 * ref, (scheme, saved / ref)


def test_msar_history_in_a_returned_cache_holds_its_own_positions_only():
    """A cached call's MSAR conv history (the last k−1 positions of every source) is kept in the returned cache; it
    must not be a view that keeps a whole (padded) source alive with it."""
    model = _llama(True)
    conv = dr.convert(model, "block-msar", blocks=2, example_inputs=(_ids(model),))
    out = conv(_ids(conv), labels=_ids(conv))
    cache = out.past_key_values if getattr(out, "past_key_values", None) is not None else out.cache
    extra = cache.layers[model.config.num_hidden_layers:]
    assert extra, "no MSAR history in the cache"
    for layer in extra:
        for t in (layer.keys, layer.values):
            assert t.shape[-2] == 11
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), tuple(t.shape)


def test_msar_training_step_with_a_cache_equals_one_without():
    """The cached (prefill) graph computes the uncached graph's loss and gradients (random MSAR parameters)."""
    runs = []
    for use_cache in (True, False):
        model = _llama(use_cache)
        conv = dr.convert(model, "block-msar", blocks=2, example_inputs=(_ids(model),))
        _randomise(conv)
        loss = conv(_ids(conv), labels=_ids(conv)).loss
        loss.backward()
        runs.append((loss.detach(), [p.grad.clone() for p in conv.parameters() if p.grad is not None]))
    (l1, g1), (l0, g0) = runs
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    assert len(g1) == len(g0)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_hf_checkpointing_drops_cache_reads_the_flags_as_hf_does():
    from depthrewrite.blocks import hf_checkpointing_drops_cache

    model = _llama(True)
    assert not hf_checkpointing_drops_cache(model)
    model.activation_checkpointing_enable()
    assert hf_checkpointing_drops_cache(model)
    with torch.no_grad():
        assert not hf_checkpointing_drops_cache(model)  # no backward, nothing checkpointed: HF keeps the cache
    assert not hf_checkpointing_drops_cache(model.eval())


def test_with_hf_checkpointing_a_training_call_returns_no_cache_as_the_original():
    base = _llama(True)
    base.activation_checkpointing_enable()
    assert base(_ids(base), labels=_ids(base)).past_key_values is None
    model = _llama(True)
    conv = dr.convert(model, "block-msar", blocks=2, example_inputs=(_ids(model),))
    conv.activation_checkpointing_enable()
    out = conv(_ids(conv), labels=_ids(conv))
    assert out.get("cache") is None and out.get("past_key_values") is None


def test_moda_keeps_each_depth_slot_once():
    """MoDA's attention keeps the slot tensors its writers made (shared by every later reader), not a stacked copy
    per reading site, and an FFN slot's values do not keep its raw keys alive: with checkpointing, what a step keeps
    beyond the original's is one K and one V per slot that a later attention reads (the slots of every sublayer but
    the last layer's) and the mask and RoPE tables the blocks read, so it grows linearly in depth."""
    base = _llama(False)
    base.activation_checkpointing_enable()
    ref, _ = step_bytes(base, _ids(base))
    model = _llama(False)
    conv = dr.convert(model, "moda", preserve_init=True, example_inputs=(_ids(model),))
    conv.activation_checkpointing_enable()
    saved, _ = step_bytes(conv, _ids(conv))
    cfg = model.config
    slot = SEQ * cfg.num_key_value_heads * cfg.head_dim * 4  # one K or V slot of one sublayer, fp32 bytes
    read_later = 2 * (cfg.num_hidden_layers - 1)  # attention and FFN slots of every layer before the last
    side = SEQ * SEQ + 2 * slot  # what the blocks receive besides: the causal bool mask, the RoPE cos/sin tables
    assert saved <= ref + 2 * read_later * slot + side, (saved - ref) / slot
