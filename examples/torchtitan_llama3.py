"""Convert torchtitan's own Llama 3 (its ``debugmodel`` flavor) to Block AttnRes, check it is the same function,
train it with torchtitan's activation checkpointing, and save and reload it as torchtitan checkpoints do
(``torch.distributed.checkpoint``, DCP).

    python examples/torchtitan_llama3.py [--out DIR] [--steps N] [--attention flex|sdpa]

torchtitan builds its language models with FlexAttention (the default here): every call takes the token positions and
the ``BlockMask`` the model builds from them. The original's FlexAttention refuses a backward on a CPU; the converted
model runs FlexAttention as depthrewrite's operator, which trains there. ``--attention sdpa`` swaps each layer's inner
attention for torchtitan's causal SDPA instead.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import llama3_configs

import depthrewrite as dr


def llama3(seed: int = 0, attention: str = "flex") -> torch.nn.Module:
    cfg = llama3_configs["debugmodel"]("flex")  # 6 layers, d=256, vocab 2048
    if attention == "sdpa":
        for layer in cfg.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()  # causal SDPA
    torch.manual_seed(seed)
    model = cfg.build()
    model.init_states()
    return model


def inputs(model: torch.nn.Module, ids: torch.Tensor, attention: str) -> dict:
    """The keywords of one call: for FlexAttention, the positions and their BlockMask, as torchtitan's trainer passes."""
    if attention == "sdpa":
        return {}
    positions = torch.arange(ids.shape[1]).expand(*ids.shape)
    return {"positions": positions, "attention_masks": model.get_attention_masks(positions)}


def main(out: Path, steps: int, attention: str = "flex") -> None:
    out.mkdir(parents=True, exist_ok=True)
    model = llama3(attention=attention)
    ids = torch.randint(0, 2048, (2, 33), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1], ids[:, 1:]
    kw = inputs(model, x, attention)  # the BlockMask is a graph input: each batch's own mask is read
    conv = dr.convert(model, "attnres", blocks=3, inplace=False, example_inputs=(x,), example_kwargs=kw or None)
    print(conv.report())
    with torch.no_grad():
        err = (conv(x, **kw) - model(x, **kw)).abs().max() / model(x, **kw).abs().max()
    print(f"\nmax |Δlogits| / max |logits| at init: {err:.1e}")
    # a checkpoint of the original model loads; only the new depthrewrite.* parameters are missing
    missing = conv.load_state_dict(model.state_dict(), strict=False).missing_keys
    print(f"the original's state dict: {len(missing)} missing keys, all new: "
          f"{all(k.startswith('depthrewrite.') for k in missing)}")

    SelectiveAC(SelectiveAC.Config()).apply(conv)  # torchtitan's per-block activation checkpointing
    print(f"layers.0 is now {type(conv.layers['0']).__name__}")
    opt = torch.optim.AdamW(conv.parameters(), lr=1e-3)
    conv.train()
    for step in range(steps):
        loss = torch.nn.functional.cross_entropy(conv(x, **kw).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step:3d}  loss {loss.item():.3f}")
    conv.eval()

    # DCP: save the state dict, load it in place into a fresh conversion (without checkpointing: torch's checkpoint
    # wrapper, which torchtitan applies, leaves its extra path level out of state_dict())
    dcp.save(conv.state_dict(), checkpoint_id=out / "dcp")
    again = dr.convert(llama3(seed=1, attention=attention), "attnres", blocks=3, example_inputs=(x,),
                       example_kwargs=kw or None)
    state = again.state_dict()
    dcp.load(state, checkpoint_id=out / "dcp")
    again.load_state_dict(state)
    again.eval()
    with torch.no_grad():
        same = torch.equal(again(x, **kw), conv(x, **kw))
    print(f"reloaded the DCP checkpoint into a fresh conversion: same logits {same}")


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The module docstring as the description, and every option's default in --help."""


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    ap.add_argument("--out", type=Path, default=Path("depthrewrite-examples/torchtitan_llama3"),
                    help="output folder (the DCP checkpoint goes in dcp/ inside it)")
    ap.add_argument("--steps", type=int, default=5, help="training steps")
    ap.add_argument("--attention", choices=("flex", "sdpa"), default="flex",
                    help="torchtitan's FlexAttention as built, or its causal SDPA")
    a = ap.parse_args()
    main(a.out, a.steps, a.attention)
