"""A FlexAttention ``BlockMask`` as a call input (depthrewrite/flexattention.py): what the mask holds is either an
input of the graph (its tensors, the tensors its mask function closes over) or part of the call's structure (the
mask function's code, its other closure values, the sequence lengths), so no call runs a graph captured for another
mask. torchtitan's own models: tests/frameworks/test_torchtitan.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree

import depthrewrite as dr
from depthrewrite import flexattention
from depthrewrite.runtime.handle import state_of

flex = pytest.importorskip("torch.nn.attention.flex_attention")
pytestmark = pytest.mark.skipif(not flexattention.register_block_mask(), reason="this torch lacks BlockMask's flatten")

T, D, H = 8, 32, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x, mask):
        B = x.shape[0]
        q, k, v = self.qkv(self.n1(x)).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
        a = flex.flex_attention(q, k, v, block_mask=mask)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, D))
        return x + self.down(F.gelu(self.up(self.n2(x))))


class FlexGPT(nn.Module):
    """nanoGPT-style, the block mask built by the caller (as torchtitan does) and passed to every block."""

    def __init__(self, layers: int = 3):
        super().__init__()
        self.emb = nn.Embedding(64, D)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, 64, bias=False)

    def forward(self, ids, mask):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.norm(x))


def sliding(window: int):
    def mask_mod(b, h, q, kv):
        return (q >= kv) & (q - kv < window)
    return mask_mod


def documents(doc: torch.Tensor):
    def mask_mod(b, h, q, kv):
        return (q >= kv) & (doc[b, q] == doc[b, kv])
    return mask_mod


def block_mask(mask_mod, batch: int = 2):
    return flex.create_block_mask(mask_mod, batch, None, T, T, device="cpu", BLOCK_SIZE=T)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return FlexGPT().eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(1))


def test_mask_function_closure_values_are_part_of_the_call_structure(model, ids):
    """Two sliding windows from one function (the window an int in its closure): the second call gets its own graph
    and the original's logits, never those of the graph captured for the first window."""
    conv = dr.convert(model, "attnres", example_inputs=(ids, block_mask(sliding(2))), inplace=False)
    with torch.no_grad():
        outs = []
        for w in (2, 5, 2):
            m = block_mask(sliding(w))
            want = model(ids, m)
            torch.testing.assert_close(conv(ids, m), want, atol=1e-5, rtol=0)
            outs.append(want)
    assert (outs[0] - outs[1]).abs().max() > 1e-3
    assert state_of(conv).captures == 2  # the window of 5 is a capture of its own; the third call reuses the first


def test_closure_tensors_are_graph_inputs(model, ids):
    """A document mask closes over a tensor of document ids: it is an input of the graph, so other documents give the
    original's logits without a new capture."""
    first = torch.zeros(2, T, dtype=torch.long)
    conv = dr.convert(model, "mhc", example_inputs=(ids, block_mask(documents(first))), inplace=False,
                      **dr.scheme("mhc").exact)
    captures = state_of(conv).captures
    with torch.no_grad():
        for doc in (first, torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 2, 2, 2, 2]])):
            m = block_mask(documents(doc))
            torch.testing.assert_close(conv(ids, m), model(ids, m), atol=1e-5, rtol=0)
    assert state_of(conv).captures == captures


def test_the_tree_spec_text_is_short():
    """A call's structure is keyed by its tree spec's text: the mask function appears by name, place and code hash,
    not by the repr of its globals (the stripped closure's own repr prints the module's namespace)."""
    _, spec = pytree.tree_flatten(block_mask(documents(torch.zeros(2, T, dtype=torch.long))))
    text = str(spec)
    assert "documents.<locals>.mask_mod" in text and len(text) < 1500, text
    _, other = pytree.tree_flatten(block_mask(sliding(2)))
    assert str(other) != text


def test_dynamo_traces_the_captured_operator(model, ids):
    """Under torch.compile the graphs' FlexAttention call takes the 7-operand form Dynamo accepts (the mask's closure
    tensors closed over, lifted by Dynamo): the compiled converted model gives the original's logits for two masks."""
    first = torch.zeros(2, T, dtype=torch.long)
    conv = dr.convert(model, "attnres", example_inputs=(ids, block_mask(documents(first))), inplace=False)
    compiled = torch.compile(conv, backend="eager")
    with torch.no_grad():
        for doc in (first, torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 2, 2, 2, 2]])):
            m = block_mask(documents(doc))
            torch.testing.assert_close(compiled(ids, m), model(ids, m), atol=1e-5, rtol=0)


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x, mask):
        B = x.shape[0]
        q, k, v = self.qkv(x).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
        return self.o(flex.flex_attention(q, k, v, block_mask=mask).transpose(1, 2).reshape(B, T, D))


class AttnModuleBlock(Block):
    """The attention a module of its own that takes the mask (torchtitan's layout)."""

    def __init__(self):
        super().__init__()
        self.attn = Attn()

    def forward(self, x, mask):
        x = x + self.attn(self.n1(x), mask)
        return x + self.down(F.gelu(self.up(self.n2(x))))


def test_a_hooked_module_taking_the_block_mask_is_called_live():
    """A module that takes the BlockMask stays inlined unless something needs it live (FlexAttention then runs as
    depthrewrite's operator); with a forward hook it is called live, the mask rebuilt from the graph's tensors for the
    call: the hook fires on every call and sees the caller's document mask."""
    torch.manual_seed(0)
    model = FlexGPT()
    model.blocks = nn.ModuleList(AttnModuleBlock() for _ in range(2))
    model.eval()
    ids = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(1))
    first = torch.zeros(2, T, dtype=torch.long)
    plain = dr.convert(model, "attnres", example_inputs=(ids, block_mask(documents(first))), inplace=False)
    assert "inlined: blocks.0.attn (it takes a BlockMask and nothing needs it live" in str(plain.report())
    assert "mask=BlockMask (ids.shape[1]=8)" in str(plain.report())  # the mask's fixed sizes are not listed

    seen = []
    model.blocks[0].attn.register_forward_hook(lambda m, args, out: seen.append(args[1]))
    conv = dr.convert(model, "attnres", example_inputs=(ids, block_mask(documents(first))), inplace=False)
    docs = (first, torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 2, 2, 2, 2]]), first)
    with torch.no_grad():
        for doc in docs:
            m = block_mask(documents(doc))
            n = len(seen)
            want = model(ids, m)
            assert len(seen) == n + 1
            torch.testing.assert_close(conv(ids, m), want, atol=1e-5, rtol=0)
            assert len(seen) == n + 2 and flexattention.is_block_mask(seen[-1])
            torch.testing.assert_close(seen[-1].to_dense(), m.to_dense())  # the caller's mask, rebuilt
    assert "blocks.0.attn (" not in str(conv.report())  # called live (blocks.1.attn, unhooked, stays inlined)
    compiled = torch.compile(conv, backend="eager")  # Dynamo through the mask's rebuild and the live call
    with torch.no_grad():
        m = block_mask(documents(docs[1]))
        n = len(seen)
        torch.testing.assert_close(compiled(ids, m), model(ids, m), atol=1e-5, rtol=0)
        assert len(seen) == n + 2
