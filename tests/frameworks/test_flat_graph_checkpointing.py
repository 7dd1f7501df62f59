"""Activation checkpointing on a model whose converted graph stays flat (litgpt Gemma-2: its in-place
``masked_fill_`` on the mask keeps the blocks inlined): torch's apply_activation_checkpointing is refused with a
ConfigError, never dropped silently; without it the model trains; in eval the wrappers are harmless."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

import depthrewrite as dr
from depthrewrite.errors import ConfigError
from tests.frameworks.models import build


def test_checkpoint_wrappers_on_a_flat_graph_are_refused():
    model, args, kwargs = build("litgpt", "gemma-2-2b")
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conv = dr.convert(model, "attnres", blocks=2, example_inputs=args, example_kwargs=kwargs)
    if dr.model.state_of(conv).blocks is not None:
        pytest.skip("Gemma-2's blocks are modules now: checkpointing is honoured (tests/test_blocks.py)")
    conv(*args, **kwargs).sum().backward()  # without checkpointing: trains
    block = type(model.transformer.h[0])
    apply_activation_checkpointing(conv, check_fn=lambda m: isinstance(m, block))
    with pytest.raises(ConfigError, match=r"transformer\.h\.0.*checkpoint.*flat graph"):
        conv(*args, **kwargs)
    conv.eval()
    with torch.no_grad():
        conv(*args, **kwargs)  # nothing is recomputed in eval: no refusal
