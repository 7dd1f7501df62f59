"""Convert torchtune's own Llama 3 (its ``llama3`` builder, tiny sizes) to Block MSAR, check it is the same function,
train it with torchtune's activation checkpointing, save and reload its state dict, and show what its KV cache gets.

    python examples/torchtune_llama3.py [--out DIR] [--steps N]

torchtune's models share one rotary-embedding module across layers; the converted model passes its cache to every
block as a side input, so each layer stays a module (checkpointing and FSDP2 act per layer).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torchtune.models.llama3 import llama3
from torchtune.modules import TransformerSelfAttentionLayer
from torchtune.modules.common_utils import delete_kv_caches
from torchtune.training import set_activation_checkpointing

import depthrewrite as dr
from depthrewrite.errors import CaptureError

SIZES = dict(vocab_size=512, num_layers=4, num_heads=4, num_kv_heads=2, embed_dim=64, intermediate_dim=128,
             max_seq_len=64)


def main(out: Path, steps: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = llama3(**SIZES)
    ids = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1], ids[:, 1:]
    exact = dr.scheme("msar").exact  # the options under which MSAR is the original function at init
    conv = dr.convert(model, "msar", blocks=2, inplace=False, example_inputs=(x,), **exact)
    print(conv.report())
    with torch.no_grad():
        err = (conv(x) - model(x)).abs().max() / model(x).abs().max()
    print(f"\nmax |Δlogits| / max |logits| at init: {err:.1e}")

    set_activation_checkpointing(conv, auto_wrap_policy={TransformerSelfAttentionLayer})  # torchtune's helper
    opt = torch.optim.AdamW(conv.parameters(), lr=3e-3)
    conv.train()
    for step in range(steps):
        loss = torch.nn.functional.cross_entropy(conv(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step:3d}  loss {loss.item():.3f}")
    conv.eval()

    path = out / "model.pt"
    torch.save(conv.state_dict(), path)
    again = dr.convert(llama3(**SIZES), "msar", blocks=2, example_inputs=(x,), **exact)
    again.load_state_dict(torch.load(path))
    again.eval()
    with torch.no_grad():
        print(f"reloaded {path.name}: same logits {torch.equal(again(x), conv(x))}")

    # torchtune's KV cache (setup_caches) is not supported yet: the first cached call is a typed error that says what
    # to do instead; with the caches deleted the model runs as before
    again.setup_caches(batch_size=2, dtype=torch.float32, decoder_max_seq_len=32)
    mask = torch.tril(torch.ones(16, 32, dtype=torch.bool))[None].expand(2, -1, -1)
    try:
        again(x, mask=mask, input_pos=torch.arange(16)[None].expand(2, -1))
    except CaptureError as e:
        print(f"with setup_caches: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    delete_kv_caches(again)
    with torch.no_grad():
        print(f"after delete_kv_caches: same logits {torch.equal(again(x), conv(x))}")


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The module docstring as the description, and every option's default in --help."""


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    ap.add_argument("--out", type=Path, default=Path("depthrewrite-examples/torchtune_llama3"),
                    help="output folder (model.pt goes in it)")
    ap.add_argument("--steps", type=int, default=5, help="training steps")
    a = ap.parse_args()
    main(a.out, a.steps)
