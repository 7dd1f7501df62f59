"""capture(): default inputs, dynamic batch and sequence, and a clear CaptureError."""

from __future__ import annotations

import pytest
import torch

from depthrewrite import CaptureError, capture
from depthrewrite.capture import example_inputs_for

from .conftest import zoo_graph


def test_hf_default_inputs_are_token_ids():
    model, _ = zoo_graph("hf:llama")
    args, kwargs = example_inputs_for(model)
    ids = kwargs["input_ids"]
    assert args == () and ids.dtype == torch.long and ids.max() < model.config.vocab_size


def test_timm_default_input_is_an_image():
    model, _ = zoo_graph("timm:vit_tiny_patch16_224")
    (img,), _ = example_inputs_for(model)
    assert img.shape == (2, 3, 224, 224)


@pytest.mark.parametrize("batch, seq", [(1, 1), (3, 7), (5, 33)])  # size-1 dims, odd sizes
def test_captured_graph_has_dynamic_batch_and_sequence(batch, seq):
    model, gm = zoo_graph("hf:llama")
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
        out = gm(input_ids=ids).logits
    torch.testing.assert_close(out, ref)


def test_capture_error_carries_export_message():
    class DataDependent(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # data-dependent Python control flow
                return x * 2
            return x

    with pytest.raises(CaptureError) as ei:
        capture(DataDependent(), (torch.randn(2, 3),))
    msg = str(ei.value)
    # the cause first, at the model's own line, then export's message
    assert "branches on a tensor's value" in msg and "in DataDependent.forward: `if x.sum() > 0:" in msg, msg
    assert "GuardOnDataDependentSymNode" in msg
    assert ei.value.__cause__ is not None


def test_no_inputs_for_unknown_model():
    with pytest.raises(CaptureError, match="example_inputs"):
        capture(torch.nn.Linear(3, 3))


def test_inputs_that_do_not_fit_forward():
    from depthrewrite.testing import nanogpt

    with pytest.raises(CaptureError, match="do not fit GPT.forward"):
        capture(nanogpt(n_layer=1), (torch.zeros(2, 3, dtype=torch.long), torch.zeros(1)))


def test_fake_tensors_left_in_a_python_side_cache_are_dropped():
    """A module that fills a plain-dict cache on first use (OLMo-core's RoPE tables) gets export's fake tensors in
    it during the capture; they are dropped, so eager calls afterwards compute with real tensors again."""
    import torch.nn as nn
    from depthrewrite import capture as _capture

    class Cached(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.cache = {}

        def forward(self, x):
            if "scale" not in self.cache:
                self.cache["scale"] = torch.ones(4) * 2
            return self.lin(x) * self.cache["scale"]

    m = Cached().eval()
    x = torch.randn(2, 3, 4)
    _capture(m, (x,), check=False)
    out = m(x)
    assert type(out) is torch.Tensor
    torch.testing.assert_close(out, m.lin(x) * 2)


def test_fake_tensors_in_cache_lists_are_dropped_and_elsewhere_refused():
    """A cache list (an attribute, or a dict value holding a list of tensors) filled during the capture is emptied; a
    fake tensor in a tuple that is an item of a list cannot be taken out: CaptureError naming the path."""
    import torch.nn as nn
    from depthrewrite import capture as _capture
    from depthrewrite.capture import drop_fake_state
    from torch._subclasses.fake_tensor import FakeTensorMode

    class Cached(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.tables = []
            self.cache = {}

        def forward(self, x):
            if not self.tables:
                self.tables.append(torch.ones(4) * 2)
            if "pair" not in self.cache:
                self.cache["pair"] = [torch.ones(4), torch.zeros(4)]
            return self.lin(x) * self.tables[0] + self.cache["pair"][1]

    m = Cached().eval()
    x = torch.randn(2, 3, 4)
    _capture(m, (x,), check=False)
    assert m.tables == [] and "pair" not in m.cache
    torch.testing.assert_close(m(x), m.lin(x) * 2)

    holder = nn.Module()
    with FakeTensorMode():
        fake = torch.ones(2)
    holder.state = [(fake, "meta")]
    with pytest.raises(CaptureError, match=r"state\[0\]"):
        drop_fake_state(holder)
