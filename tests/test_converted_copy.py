"""copy.deepcopy, pickle and torch.save round-trips of a converted model (issue #14).

A copy is an independent model: its own parameters (an optimizer step or ``.to()`` on one leaves the other alone),
the same outputs in training and eval mode, the same conversion and state dict, and its own module tree (a change in
one recaptures that one only). Graphs are never copied: a copy captures its own on first use.
The new ``depthrewrite.*`` parameters are randomised first, so equal outputs are not equal-at-init by accident.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import subprocess
import sys

import pytest
import torch

import depthrewrite as dr
from depthrewrite.demo.zoo import hf_model
from depthrewrite.testing import nanogpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMES = list(dr.schemes())
MODELS = ["llama", "nanogpt"]


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return hf_model("llama", layers=2) if name == "llama" else nanogpt(n_layer=2)


def _randomise(conv: torch.nn.Module) -> None:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in conv.named_parameters():
            if name.startswith("depthrewrite."):
                p.copy_(torch.rand(p.shape, generator=g, dtype=torch.float32).to(p.dtype) - 0.5)


def _out(conv, ids):
    out = conv(ids)
    if hasattr(out, "logits"):
        return out.logits
    return out[0] if isinstance(out, tuple) else out


@pytest.fixture(scope="module", params=[(m, s) for m in MODELS for s in SCHEMES], ids=lambda p: f"{p[0]}-{p[1]}")
def conv(request):
    name, scheme = request.param
    conv = dr.convert(_model(name), scheme)
    _randomise(conv)
    return conv


def _ids():
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))


def _pickled(conv):
    return pickle.loads(pickle.dumps(conv))


def _saved(conv):
    buf = io.BytesIO()
    torch.save(conv, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


COPIES = {"deepcopy": copy.deepcopy, "pickle": _pickled, "torch.save": _saved}


def _assert_same(dup, conv, ids):
    assert dr.is_converted(dup) and type(dup) is type(conv) and dup is not conv
    assert dup.report().config == conv.report().config and dup.report().sites == conv.report().sites
    a, b = dup.state_dict(), conv.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    theirs = dict(conv.named_parameters())
    for k, p in dup.named_parameters():
        assert p is not theirs[k] and p.data_ptr() != theirs[k].data_ptr()
        assert p.requires_grad == theirs[k].requires_grad
    was = conv.training
    try:
        with torch.no_grad():
            for mode in (True, False):
                conv.train(mode)
                dup.train(mode)
                assert dup.training is mode
                assert torch.equal(_out(dup, ids), _out(conv, ids))
    finally:
        conv.train(was)
        dup.train(was)


@pytest.mark.parametrize("how", list(COPIES))
def test_copy_computes_the_same(conv, how):
    dup = COPIES[how](conv)
    _assert_same(dup, conv, _ids())
    # the graphs read the copy's own parameters
    for mode in (True, False):
        mine, other = dup.graph_module(mode), conv.graph_module(mode)
        for n in mine.graph.nodes:
            if n.op == "get_attr":
                ours, theirs = mine.resolve_attr(n.target), other.resolve_attr(n.target)
                if isinstance(ours, torch.Tensor):
                    assert ours is not theirs


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copy_is_independent(conv, how):
    ids = _ids()
    dup = COPIES[how](conv)
    with torch.no_grad():
        before = _out(conv, ids).clone()
    snapshot = {k: v.clone() for k, v in conv.state_dict().items()}
    opt = torch.optim.SGD(dup.parameters(), lr=0.1)
    out = _out(dup, ids)
    out.float().pow(2).mean().backward()
    opt.step()
    assert all(p.grad is None for p in conv.parameters())
    assert all(torch.equal(v, snapshot[k]) for k, v in conv.state_dict().items())
    changed = {k for k, v in dup.state_dict().items() if not torch.equal(v, snapshot[k])}
    assert any(k.startswith("depthrewrite.") for k in changed)
    with torch.no_grad():
        assert torch.equal(_out(conv, ids), before)
        assert not torch.equal(_out(dup, ids), before)
    # .to() on the copy retargets the copy only
    dup.to(torch.float64)
    assert next(dup.parameters()).dtype == torch.float64 and next(conv.parameters()).dtype == torch.float32
    with torch.no_grad():
        assert _out(dup, ids).dtype == torch.float64
        assert torch.equal(_out(conv, ids), before)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copy_follows_its_own_module_tree(conv, how):
    """A submodule replaced in the copy is followed there (recaptured), and the original is unaffected."""
    ids = _ids()
    dup = COPIES[how](conv)
    with torch.no_grad():
        before = _out(conv, ids).clone()
    lin = next((n, m) for n, m in dup.named_modules() if isinstance(m, torch.nn.Linear) and "mlp" in n)
    path, old = lin
    parent, _, leaf = path.rpartition(".")
    new = copy.deepcopy(old)
    with torch.no_grad():
        new.weight.mul_(3)
    setattr(dup.get_submodule(parent), leaf, new)
    with torch.no_grad():
        assert not torch.equal(_out(dup, ids), before)
        assert torch.equal(_out(conv, ids), before)
    setattr(dup.get_submodule(parent), leaf, old)
    with torch.no_grad():
        assert torch.equal(_out(dup, ids), before)


def test_copy_of_a_copy(conv):
    dup = _pickled(copy.deepcopy(_pickled(conv)))
    _assert_same(dup, conv, _ids())


_CHILD = r"""
import pickle, sys, torch
{imports}
torch.set_num_threads({threads})  # the parent's count: the bitwise comparison needs the same reduction order
conv = pickle.load(open(sys.argv[1], "rb"))
ids, want = torch.load(sys.argv[2])
assert type(conv).__mro__[1].__name__ == "ConvertedModel", type(conv).__mro__
with torch.no_grad():
    out = conv(ids)
    out = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out
assert torch.equal(out, want), (out - want).abs().max()
print("ok", conv.report().config.name, "depthrewrite" in sys.modules)
"""


@pytest.mark.parametrize("imports", ["import depthrewrite", ""], ids=["import-first", "no-import"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_unpickle_in_a_fresh_process(tmp_path, scheme, imports):
    """The custom ops resolve in a fresh process; unpickling imports depthrewrite itself when nobody did."""
    conv = dr.convert(_model("llama"), scheme)
    _randomise(conv)
    conv.eval()
    ids = _ids()
    with torch.no_grad():
        want = _out(conv, ids)
    (tmp_path / "m.pkl").write_bytes(pickle.dumps(conv))
    torch.save((ids, want), tmp_path / "io.pt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    child = _CHILD.format(imports=imports, threads=torch.get_num_threads())
    r = subprocess.run(
        [sys.executable, "-c", child, str(tmp_path / "m.pkl"), str(tmp_path / "io.pt")],
        capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["ok", scheme, "True"]


@pytest.mark.parametrize("how", list(COPIES))
def test_pipeline_split_model_copies(how):
    torch.manual_seed(0)
    conv = dr.convert(_model("llama"), "attnres", pipeline_stages=2)
    _randomise(conv)
    assert conv.pipeline_cuts
    dup = COPIES[how](conv)
    assert dup.pipeline_cuts == conv.pipeline_cuts
    assert dup.report().pipeline == conv.report().pipeline
    for mode in (True, False):
        splits = [n.target for n in dup.graphs[mode].nodes if n.op == "call_function"]
        assert splits == [n.target for n in conv.graphs[mode].nodes if n.op == "call_function"]
    _assert_same(dup, conv, _ids())


@pytest.mark.parametrize("how", list(COPIES))
def test_copy_captures_a_graph_for_another_length(how):
    """CPM-Ant's graph fixes the sequence length (16): a copy captures its own graph for 12 tokens, as the original."""
    torch.manual_seed(0)
    conv = dr.convert(hf_model("cpmant", layers=2).eval(), "attnres")
    dup = COPIES[how](conv)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(dup(input_ids=ids).logits, conv(input_ids=ids).logits)
        assert torch.equal(dup(input_ids=ids[:, :12]).logits, conv(input_ids=ids[:, :12]).logits)
    assert len(dup.report().graphs) == 2


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copy_of_a_compiled_model_runs_its_own_modules(how):
    """``model.compile()`` keeps the compiled call in the module's ``__dict__``; a copy leaves it out (as
    ``nn.Module.__getstate__`` does) instead of running the original's compiled call on the copy's inputs (the
    copy's own weights would be ignored)."""
    conv = dr.convert(_model("nanogpt"), "attnres")
    conv.compile(backend="eager")
    ids = _ids()
    with torch.no_grad():
        want = _out(conv, ids)
    dup = COPIES[how](conv)
    assert dup.__dict__.get("_compiled_call_impl") is None
    with torch.no_grad():
        for p in dup.parameters():
            p.zero_()
        assert not torch.equal(_out(dup, ids), want)
        assert torch.equal(_out(conv, ids), want)
