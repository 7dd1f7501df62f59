"""Example inputs that alias each other (``labels=input_ids``, the same tensor twice, views of one storage) must not
tie two graph inputs together: torch.export would keep the aliasing and the converted graph would read one input for
both (issue #12, item 1)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import depthrewrite as dr
from depthrewrite.capture import unalias_inputs
from depthrewrite.demo.zoo import hf_model


def test_unalias_inputs_copies_only_shared_storage():
    ids = torch.arange(12).view(2, 6)
    other = torch.ones(2, 6, dtype=torch.long)
    args, kwargs, copied = unalias_inputs((ids, ids[:, :3]), {"input_ids": ids, "mask": other, "n": 3})
    assert args[0] is ids and kwargs["mask"] is other and kwargs["n"] == 3
    assert args[1].untyped_storage().data_ptr() != ids.untyped_storage().data_ptr()
    assert kwargs["input_ids"].untyped_storage().data_ptr() != ids.untyped_storage().data_ptr()
    torch.testing.assert_close(args[1], ids[:, :3])
    torch.testing.assert_close(kwargs["input_ids"], ids)
    assert len(copied) == 2 and all("shares storage with" in c for c in copied)


def _hf_check(model_type: str, scheme: str, labels_view: bool = False):
    torch.manual_seed(0)
    model = hf_model(model_type, layers=2).eval()
    V = model.config.vocab_size
    ids = torch.randint(0, V, (2, 12))
    am = torch.ones_like(ids)
    labels = ids[:] if labels_view else ids  # the same tensor, or a view of the same storage
    conv = dr.convert(model, scheme, example_kwargs={"input_ids": ids, "attention_mask": am, "labels": labels}, inplace=False).eval()
    assert "labels" in {n.target for n in conv.graph.nodes if n.op == "placeholder"}
    for n in conv.graph.nodes:  # the token embedding reads input_ids, never the labels
        if n.op == "call_function" and n.target is torch.ops.aten.embedding.default:
            assert n.args[1].target != "labels"
    x = torch.randint(0, V, (2, 12))
    y = torch.randint(0, V, (2, 12))
    y[:, :4] = -100  # ignored positions: an embedding of these would raise IndexError
    with torch.no_grad():
        ref = model(input_ids=x, attention_mask=am, labels=y)
        out = conv(input_ids=x, attention_mask=am, labels=y)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gpt2"])
def test_hf_labels_equal_to_input_ids(model_type):
    _hf_check(model_type, "attnres")


def test_hf_labels_view_of_input_ids_msar():
    _hf_check("llama", "msar", labels_view=True)


class _GPTWithTargets(nn.Module):
    """nanoGPT's calling convention: ``forward(idx, targets=None) -> (logits, loss)``."""

    def __init__(self, vocab=64, d=32, layers=2, heads=2, T=32):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(T, d)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                dict(
                    ln1=nn.LayerNorm(d),
                    attn=nn.MultiheadAttention(d, heads, batch_first=True),
                    ln2=nn.LayerNorm(d),
                    mlp=nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)),
                )
            )
            for _ in range(layers)
        )
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        mask = torch.triu(torch.full((T, T), float("-inf"), device=idx.device), 1)
        for b in self.blocks:
            h = b["ln1"](x)
            x = x + b["attn"](h, h, h, attn_mask=mask, need_weights=False)[0]
            x = x + b["mlp"](b["ln2"](x))
        logits = self.head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)
        return logits, loss


@pytest.mark.parametrize("scheme", ["attnres", "mhc"])
def test_positional_aliasing(scheme):
    torch.manual_seed(0)
    model = _GPTWithTargets().eval()
    ids = torch.randint(0, 64, (2, 16))
    conv = dr.convert(model, scheme, example_inputs=(ids, ids), inplace=False).eval()
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    y[0, :3] = -1
    with torch.no_grad():
        ref_logits, ref_loss = model(x, y)
        logits, loss = conv(x, y)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)


# A graph that is not the model: the captured graph is run against the model on the example inputs (eval mode).


class _ExportSeesAnotherPath(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)

    def forward(self, idx):
        h = self.emb(idx)
        h = h + self.fc(self.norm(h))
        out = self.norm(h)
        if torch.compiler.is_exporting():  # Python state the trace fixes differently from eager execution
            out = out * 2
        return out


def test_capture_refuses_a_graph_that_differs_from_the_model():
    model = _ExportSeesAnotherPath().eval()
    with pytest.raises(dr.CaptureError, match="computes something else than the model itself"):
        dr.capture(model, (torch.randint(0, 16, (2, 5)),))
    gm = dr.capture(model, (torch.randint(0, 16, (2, 5)),), check=False)  # opt-out, for the user who knows
    assert isinstance(gm, torch.fx.GraphModule)


def test_paligemma_text_only_capture_is_refused_not_misconverted():
    # PaliGemma's eager forward lets a text-only prefix attend both ways; the exported graph is causal.
    model = hf_model("paligemma", layers=1).eval()
    with pytest.raises(dr.CaptureError, match="computes something else"):
        dr.convert(model, "attnres", inplace=False)


def test_a_crash_inside_a_rewrite_pass_names_the_pass(monkeypatch):
    import depthrewrite.runtime.rewrite as rewrite

    def broken(gm, chain, config):
        raise KeyError("some_node")

    monkeypatch.setattr(rewrite, "get_handler", lambda config: broken)
    model = _GPTWithTargets().eval()
    with pytest.raises(dr.DepthRewriteError, match=r"the rewrite\[attnres\] pass failed on the eval graph of _GPTWithTargets: KeyError") as ei:
        dr.convert(model, "attnres", example_inputs=(torch.randint(0, 64, (2, 8)),), inplace=False)
    assert isinstance(ei.value.__cause__, KeyError)
