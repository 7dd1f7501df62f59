"""Activation checkpointing on a model whose converted graph stays flat: torch's apply_activation_checkpointing is
refused with a ConfigError, never dropped silently; without it the model trains; in eval the wrappers are harmless.

litgpt's Gemma-2 used to be such a model (its in-place ``masked_fill_`` on a fresh mask); that write is now turned out
of place before the split, and its blocks are modules (tests/frameworks/test_blocks_are_modules.py). A write that can
not be turned (a view of the written tensor is read after the write) still keeps the graph flat: a nanoGPT whose
attention builds its mask that way stands in for such code."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

import depthrewrite as dr
from depthrewrite.errors import ConfigError
from depthrewrite.testing import Block, CausalSelfAttention, nanogpt


class _ViewMaskAttention(CausalSelfAttention):
    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        mask = torch.zeros(T, T, device=x.device, dtype=x.dtype)
        first = mask[0]  # a view read after the in-place write: the write cannot be turned out of place
        mask.masked_fill_(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1)) + mask + first[0]
        return self.c_proj(F.softmax(att, dim=-1).matmul(v).transpose(1, 2).reshape(B, T, C))


def flat_model():
    """A 2-layer nanoGPT whose attentions read a view of their mask after writing the mask in place (also used by
    bench/refusals.py)."""
    torch.manual_seed(0)
    model = nanogpt(n_layer=2)
    for blk in model.transformer.h:
        old = blk.attn
        blk.attn = _ViewMaskAttention(model.config)
        blk.attn.load_state_dict(old.state_dict(), strict=False)
    return model


def test_checkpoint_wrappers_on_a_flat_graph_are_refused():
    model = flat_model().train()
    idx = torch.randint(0, 256, (2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # inlined: with module calls (the default) the attention is one call and the graph splits at the blocks
        conv = dr.convert(model, "attnres", blocks=2, example_inputs=(idx,), module_calls=False)
    assert dr.runtime.handle.state_of(conv).blocks is None, "the view-read-after-write mask should keep the graph flat"
    conv(idx)[0].float().sum().backward()  # without checkpointing: trains
    apply_activation_checkpointing(conv, check_fn=lambda m: isinstance(m, Block))
    with pytest.raises(ConfigError, match=r"transformer\.h\.0.*checkpoint.*flat graph"):
        conv(idx)
    conv.eval()
    with torch.no_grad():
        conv(idx)  # nothing is recomputed in eval: no refusal
