"""Shared fixtures: the model zoo, built small with random weights and captured once per session."""

from __future__ import annotations

import functools
import os

import pytest
import torch

# Triton kernels are tested on CPU through Triton's interpreter. The variable is read when @triton.jit decorates a
# kernel, so it must be set before any kernel module is imported; on a CUDA machine the kernels run natively.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist (the README's command runs two workers on CI's two cores) each worker keeps to one intra-op
# thread: two workers of two threads each on two cores would only contend.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references are true fp32
# Every kernel module is decorated now, under the variable as set above: a test that sets TRITON_INTERPRET for itself
# (tests/kernels/test_dispatch.py) must not be the first importer of one, or that module's kernels would stay in the
# interpreter for the rest of the process (on a CUDA machine every later test of them then fails).
import depthrewrite.kernels.depth_attn.fused  # noqa: E402,F401
import depthrewrite.kernels.mhc.fused  # noqa: E402,F401
import depthrewrite.kernels.moda.fused  # noqa: E402,F401
import depthrewrite.kernels.msar.fused  # noqa: E402,F401
torch.backends.cudnn.allow_tf32 = False

from depthrewrite import capture
from depthrewrite.testing import nanogpt
from depthrewrite.demo.zoo import hf_model, timm_model

LAYERS = 2


def build_zoo_model(name: str) -> torch.nn.Module:
    """``hf:<type>``, ``timm:<name>`` or ``nanogpt``, with LAYERS transformer blocks."""
    if name == "nanogpt":
        return nanogpt(n_layer=LAYERS)
    kind, _, rest = name.partition(":")
    if kind == "hf":
        return hf_model(rest, layers=LAYERS)
    if kind == "timm":
        return timm_model(rest, layers=LAYERS)
    raise ValueError(name)


@functools.lru_cache(maxsize=None)
def zoo_graph(name: str):
    """(model, captured graph) for a zoo name; captured once per test session."""
    torch.manual_seed(0)
    model = build_zoo_model(name)
    return model, capture(model)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def fresh_backend():
    """Dynamo's caches and the depthrewrite backend's records cleared around a test (each test compiles anew)."""
    from depthrewrite.backend import clear_records

    torch._dynamo.reset()
    clear_records()
    yield
    torch._dynamo.reset()
