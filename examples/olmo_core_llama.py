"""Convert an OLMo-core Transformer (``TransformerConfig.llama_like``, tiny) to MSAR, check it is the same function,
train it with OLMo-core's own activation checkpointing, and save and reload it with ``torch.distributed.checkpoint``
(DCP, the format OLMo-core's trainer writes).

    python examples/olmo_core_llama.py [--out DIR] [--steps N]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from olmo_core.nn.transformer import TransformerConfig

import depthrewrite as dr


def olmo(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = TransformerConfig.llama_like(d_model=64, vocab_size=512, n_layers=4, n_heads=4, n_kv_heads=2,
                                         hidden_size_multiple_of=16).build(init_device="cpu")
    model.init_weights(max_seq_len=64, device=torch.device("cpu"))
    return model


def main(out: Path, steps: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model = olmo()
    ids = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1], ids[:, 1:]
    exact = dr.scheme("msar").exact  # the options under which MSAR is the original function at init
    conv = dr.convert(model, "msar", inplace=False, example_inputs=(x,), **exact)
    print(conv.report())
    with torch.no_grad():
        err = (conv(x) - model(x)).abs().max() / model(x).abs().max()
    print(f"\nmax |Δlogits| / max |logits| at init: {err:.1e}")

    conv.apply_activation_checkpointing("full")  # OLMo-core's own method: each block wrapped
    opt = torch.optim.AdamW(conv.parameters(), lr=3e-3)
    conv.train()
    for step in range(steps):
        loss = torch.nn.functional.cross_entropy(conv(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step:3d}  loss {loss.item():.3f}")
    conv.eval()

    dcp.save(conv.state_dict(), checkpoint_id=out / "dcp")
    again = dr.convert(olmo(seed=1), "msar", example_inputs=(x,), **exact)
    state = again.state_dict()
    dcp.load(state, checkpoint_id=out / "dcp")
    again.load_state_dict(state)
    again.eval()
    with torch.no_grad():
        print(f"reloaded the DCP checkpoint into a fresh conversion: same logits {torch.equal(again(x), conv(x))}")


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The module docstring as the description, and every option's default in --help."""


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    ap.add_argument("--out", type=Path, default=Path("depthrewrite-examples/olmo_core_llama"),
                    help="output folder (the DCP checkpoint goes in dcp/ inside it)")
    ap.add_argument("--steps", type=int, default=5, help="training steps")
    a = ap.parse_args()
    main(a.out, a.steps)
