"""Convert litgpt's own GPT (a tiny Pythia config) to Block AttnRes, check it is the same function, train it
byte-level on the Python standard library's source, decode with litgpt's KV cache and its ``generate``, and save and
reload the checkpoint as litgpt keeps it (``lit_model.pth``: the model's state dict).

    python examples/litgpt_gpt.py [--out DIR] [--steps N]

A pretrained litgpt checkpoint works the same way: build ``GPT(Config.from_name(...))``, load ``lit_model.pth`` into
it, then convert (the new parameters start where the converted model is the original function).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from litgpt import GPT, Config
from litgpt.generate.base import generate

import depthrewrite as dr
from depthrewrite.demo.corpus import Corpus


def gpt() -> GPT:
    cfg = Config.from_name("pythia-14m", n_layer=4, n_embd=64, n_head=4, block_size=128, vocab_size=256,
                           padded_vocab_size=256)  # bytes as tokens
    return GPT(cfg)


def main(out: Path, steps: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = gpt()
    ids = torch.randint(0, 256, (2, 32))
    conv = dr.convert(model, "attnres", blocks=2, inplace=False, example_inputs=(ids,))
    print(conv.report())
    with torch.no_grad():
        err = (conv(ids) - model(ids)).abs().max() / model(ids).abs().max()
    print(f"\nmax |Δlogits| / max |logits| at init: {err:.1e}")
    # a checkpoint of the original model (a pretrained lit_model.pth) loads; only the new parameters are missing
    missing = conv.load_state_dict(model.state_dict(), strict=False).missing_keys
    print(f"the original's state dict: {len(missing)} missing keys, all new: "
          f"{all(k.startswith('depthrewrite.') for k in missing)}")

    corpus = Corpus.stdlib(max_bytes=1_000_000)
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(conv.parameters(), lr=3e-3)
    conv.train()
    for step in range(steps):
        x, y = corpus.batch("train", 8, 64, gen)
        loss = torch.nn.functional.cross_entropy(conv(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 5 == 0 or step == steps - 1:
            print(f"step {step:3d}  loss {loss.item():.3f}")
    conv.eval()

    # litgpt's own decoding: its KV cache (set_kv_cache, calls with input_pos) and generate(), against greedy decoding
    # that recomputes the whole sequence for every token
    prompt = torch.tensor(list(b"def main("), dtype=torch.long)
    with torch.no_grad():
        want = prompt.clone()
        for _ in range(16):
            want = torch.cat([want, conv(want[None])[0, -1].argmax().view(1)])
        conv.set_kv_cache(batch_size=1)
        got = generate(conv, prompt, max_returned_tokens=len(prompt) + 16, temperature=0.0, top_k=1)
        conv.clear_kv_cache()
    print(f"litgpt generate() with the KV cache == greedy without it: {got.tolist() == want.tolist()}  "
          f"({bytes(got.tolist())!r})")

    # lit_model.pth is the state dict; a fresh conversion of a fresh GPT loads it (the new parameters included)
    path = out / "lit_model.pth"
    torch.save(conv.state_dict(), path)
    again = dr.convert(gpt(), "attnres", blocks=2, example_inputs=(ids,))
    again.load_state_dict(torch.load(path))
    again.eval()
    with torch.no_grad():
        same = torch.equal(again(ids), conv(ids))
    print(f"reloaded {path.name} ({path.stat().st_size / 1e6:.1f} MB): same logits {same}")


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The module docstring as the description, and every option's default in --help."""


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    ap.add_argument("--out", type=Path, default=Path("depthrewrite-examples/litgpt_gpt"),
                    help="output folder (lit_model.pth goes in it)")
    ap.add_argument("--steps", type=int, default=10, help="training steps on the standard-library corpus")
    a = ap.parse_args()
    main(a.out, a.steps)
