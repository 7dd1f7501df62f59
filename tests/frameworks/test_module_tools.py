"""Module tools on every framework model (issue: modules stay modules, item 1): the converted torchtitan, torchtune,
litgpt and OLMo-core models call their intact modules, so a forward hook on a projection inside a block fires on every
call with the original's output shapes (no recapture), and FlopCounterMode counts every module inside the blocks as
it counts them in the original, including torchtitan DeepSeek-V3's MoE router gate, called inside the router's
``torch.autocast`` block (kept as that block's own enter/exit nodes, not a higher-order op). OLMo-core's LMHead
wrapper, whose forward takes a string, is called."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

import depthrewrite as dr
from depthrewrite.runtime.handle import state_of
from tests.frameworks.models import CASES, build

#: modules that stay inlined, by case (the report's module-calls note says why): none now
INLINED: dict[tuple[str, str], set[str]] = {}


def _observe(model: nn.Module, path: str, args: tuple, kwargs: dict):
    """(logits, output shapes a hook on ``path`` saw over 3 calls, FlopCounterMode's count per module of one call)."""
    seen = []
    h = model.get_submodule(path).register_forward_hook(lambda mod, i, out: seen.append(tuple(out.shape)))
    try:
        with torch.no_grad():
            outs = [model(*args, **kwargs) for _ in range(3)]
    finally:
        h.remove()
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        model(*args, **kwargs)
    return outs[0], seen, {k: sum(v.values()) for k, v in fc.get_flop_counts().items()}


@pytest.mark.parametrize("framework, name", CASES, ids=[f"{f}-{n}" for f, n in CASES])
def test_hooks_and_flop_counts_inside_the_blocks(framework, name):
    model, args, kwargs = build(framework, name)
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conv = dr.convert(model, "attnres", example_inputs=args, example_kwargs=kwargs)
    st = state_of(conv)
    assert st.blocks, st.blocks_note
    note = next(n for n in conv.report().notes if n.startswith("module calls"))
    inlined = INLINED.get((framework, name), set())
    assert ("inlined" in note) == bool(inlined) and all(f"{p} (" in note for p in inlined), note
    first = next(n for n, m in conv.named_modules() if isinstance(m, nn.Linear) and n.startswith(st.blocks[0] + "."))
    with torch.no_grad():
        conv(*args, **kwargs)  # every graph these calls use is captured
    captures = st.captures
    with warnings.catch_warnings():
        # no "the hook ... is traced" warning: the projection is called
        warnings.filterwarnings("error", message="depthrewrite")
        got, seen, per = _observe(conv, first, args, kwargs)
    want, seen_ref, per_ref = _observe(ref, first, args, kwargs)
    torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=0)
    assert seen == seen_ref and len(seen) == 3
    assert st.captures == captures and st.recaptures == 0
    root = type(ref).__name__
    inside = {k: v for k, v in per_ref.items()
              if any(k.startswith(f"{root}.{b}.") for b in st.blocks)
              and not any(k.startswith(f"{root}.{p}") for p in inlined)}
    assert len(inside) >= 10
    assert {k: per.get(k) for k in inside} == inside


def test_a_module_called_with_a_string_is_called_with_it():
    """OLMo-core's LMHead takes ``loss_reduction="mean"``: export's call marker cannot take a string, so the capture
    carries it in the call's input spec (``ConstStr``); the lowered call passes the plain string and a hook on the
    wrapper fires on every call."""
    model, args, kwargs = build("olmo_core", "llama_like")
    ref = copy.deepcopy(model)
    conv = dr.convert(model, "attnres", example_inputs=args, example_kwargs=kwargs)
    seen = []
    conv.lm_head.register_forward_hook(lambda mod, i, out: seen.append(out.shape))
    with torch.no_grad():
        got = [conv(*args, **kwargs) for _ in range(2)]
        want = ref(*args, **kwargs)
    torch.testing.assert_close(got[1], want, atol=1e-5, rtol=0)
    assert len(seen) == 2
    code = state_of(conv).entries()[0].run.code
    assert "self.lm_head(" in code and "loss_reduction = 'mean'" in code
