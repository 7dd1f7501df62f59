"""Every norm spelling is found, on export and Dynamo graphs, with its input, output, eps and weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from depthrewrite import capture
from depthrewrite.passes.analyse.graph import Dataflow
from depthrewrite.passes.analyse.norms import find_norms
from depthrewrite.passes.analyse.ops import op_of


class WrittenRMS(nn.Module):  # as Hugging Face Llama writes it
    def __init__(self, d, eps=1e-6, offset=False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d) if offset else torch.ones(d))
        self.eps, self.offset = eps, offset

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * (1.0 + self.weight.float())).type_as(x) if self.offset else self.weight * x.to(dtype)


class WrittenLayerNorm(nn.Module):  # as Cohere writes it
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).pow(2).mean(-1, keepdim=True)
        return self.weight * ((x - mean) * torch.rsqrt(var + self.eps))


class FLayerNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.w, self.b, 1e-5)


class FRMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.w, 1e-6)


class Wrap(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = norm

    def forward(self, x):
        return self.norm(self.lin(x)) * 2


NORMS = [
    pytest.param(lambda: nn.LayerNorm(8), "layer_norm", 1e-5, id="nn.LayerNorm"),
    pytest.param(lambda: nn.RMSNorm(8, eps=1e-6), "rms_norm", 1e-6, id="nn.RMSNorm"),
    pytest.param(lambda: FLayerNorm(8), "layer_norm", 1e-5, id="F.layer_norm"),
    pytest.param(lambda: FRMSNorm(8), "rms_norm", 1e-6, id="F.rms_norm"),
    pytest.param(lambda: WrittenRMS(8), "rms_norm (written out)", 1e-6, id="written-rms"),
    pytest.param(lambda: WrittenRMS(8, offset=True), "rms_norm (written out, 1 + weight)", 1e-6, id="written-rms-gemma"),
    pytest.param(lambda: WrittenLayerNorm(8), "layer_norm (written out)", 1e-5, id="written-layernorm"),
]


def _dynamo_graph(model, x):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, dynamic=False)(x)
    return graphs[0]


@pytest.mark.parametrize("ir", ["export", "dynamo"])
@pytest.mark.parametrize("make, kind, eps", NORMS)
def test_find_norms(make, kind, eps, ir):
    model = Wrap(make())
    x = torch.randn(2, 3, 8)
    gm = capture(model, (x,)) if ir == "export" else _dynamo_graph(model, x)
    norms = find_norms(gm)
    assert len(norms) == 1
    n = norms[0]
    assert n.kind == kind
    assert n.eps == pytest.approx(eps)
    df = Dataflow(gm)
    # the output is what the `* 2` reads (through aliases), the input is the linear's output
    (reader,) = df.users(df.by_name[n.output])
    assert op_of(reader) == "mul" and 2 in reader.args
    assert op_of(df.by_name[n.input], gm) == "linear"
    assert n.readers and all(r in n.nodes for r in n.readers)
    assert n.weight is not None
    if ir == "export":
        assert n.module == "norm"
