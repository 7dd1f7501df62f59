"""A converted block returns tensors of its own, never views (issue #23): FSDP2 warns about a module that returns a
view, since an in-place op on it would silently skip the pre-backward all-gather. MoDA's depth slots were the last
views (a slot is a view of its block's K/V projection: ``v_proj(x).view(..).transpose(1, 2)``, a slice of
``kv_proj``'s output); the block now returns the tensor a slot views and the layout ops run where the slots are
stacked."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import depthrewrite as dr
from depthrewrite.blocks import ConvertedBlock
from depthrewrite.demo.zoo import hf_model
from depthrewrite.testing import nanogpt

IDS = torch.randint(0, 60, (2, 16), generator=torch.Generator().manual_seed(0))

CASES = [
    pytest.param("llama", "attnres", {}, id="attnres"),
    pytest.param("llama", "block-attnres", {}, id="block-attnres"),
    pytest.param("llama", "msar", {}, id="msar"),
    pytest.param("llama", "block-msar", {}, id="block-msar"),
    pytest.param("llama", "mhc", {}, id="mhc"),
    pytest.param("llama", "moda", {}, id="moda"),
    pytest.param("llama", "moda", {"preserve_init": True}, id="moda-preserve_init"),
    pytest.param("llama", "moda", {"ffn_kv": False}, id="moda-attention-slots-only"),
]
# nanoGPT: biased projections (linear of a 3-d input with a bias is a view of addmm's [B·T, N] product at run time;
# full AttnRes / MSAR pass c_proj's output on as a depth source through dropout(p=0), which returns its input),
# MoDA's slots views of one fused c_attn output
CASES += [
    pytest.param("nanogpt", s, {}, id=f"nanogpt-{s}")
    for s in ("attnres", "block-attnres", "msar", "block-msar", "mhc", "moda")
]


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return (nanogpt(n_layer=3) if name == "nanogpt" else hf_model("llama", layers=3, attention_dropout=0.0)).train()


def _block_outputs(conv: nn.Module, run) -> list[tuple[str, int, torch.Tensor]]:
    got = []
    blocks = [(n, m) for n, m in conv.named_modules() if isinstance(m, ConvertedBlock)]
    assert blocks
    hooks = [m.register_forward_hook(lambda mod, args, out, n=n: got.extend(
        (n, j, t) for j, t in enumerate(out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)))
        for n, m in blocks]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return got


@pytest.mark.parametrize("name, scheme, options", CASES)
def test_block_outputs_are_not_views(name, scheme, options):
    conv = dr.convert(_model(name), scheme, example_inputs=(IDS,), **options)
    outs = _block_outputs(conv, lambda: conv(IDS))
    assert len({n for n, _, _ in outs}) == 3
    views = [f"{n} output {j} {tuple(t.shape)} views {tuple(t._base.shape)}" for n, j, t in outs if t._base is not None]
    assert not views, views
    if scheme == "moda":  # the slots cross the blocks: more outputs than the residual stream
        assert len(outs) > 3


def test_fsdp2_per_block_with_moda_warns_no_view():
    """fully_shard on every block and the root (one gloo rank): a MoDA training step gives no 'returned a view tensor'
    warning, and the same loss and gradients as the unsharded model."""
    import copy

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        conv = dr.convert(_model("llama"), "moda")
        ref = copy.deepcopy(conv)
        for blk in conv.model.layers:
            fully_shard(blk)
        fully_shard(conv)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = conv(IDS, labels=IDS).loss
            loss.backward()
        views = [str(w.message) for w in caught if "view" in str(w.message)]
        assert not views, views
        want = ref(IDS, labels=IDS).loss
        want.backward()
        torch.testing.assert_close(loss.detach(), want.detach())
        for (n, p), q in zip(conv.named_parameters(), ref.parameters()):
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            torch.testing.assert_close(g, q.grad, msg=lambda s, n=n: f"{n}: {s}")
    finally:
        dist.destroy_process_group()
