"""Convert a Hugging Face Llama to Block AttnRes, check it is the same function, load its checkpoint, and train it
byte-level on the Python standard library's source (the demo's corpus).

    python examples/convert_llama.py [--out DIR] [--steps N]

A pretrained model works the same way (``LlamaForCausalLM.from_pretrained(...)``); here a small random config keeps
the example offline.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import depthrewrite as dr
from depthrewrite.demo.corpus import Corpus
from depthrewrite.demo.zoo import hf_model


def main(out: Path, steps: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = hf_model("llama", layers=4, hidden=64)
    conv = dr.convert(model, "attnres", blocks=4)
    print(conv.report())

    ids = torch.randint(0, model.config.vocab_size, (4, 32))
    with torch.no_grad():
        err = (conv(ids).logits - model(ids).logits).abs().max() / model(ids).logits.abs().max()
    print(f"\nmax |Δlogits| / max |logits| at init: {err:.1e}")

    # A checkpoint of the original model loads; only the new depthrewrite.* parameters are missing.
    missing = conv.load_state_dict(model.state_dict(), strict=False).missing_keys
    print(f"loading the original state dict: {len(missing)} missing keys, all new: {all(k.startswith('depthrewrite.') for k in missing)}")

    corpus = Corpus.stdlib(max_bytes=2_000_000)  # held-out files for validation
    print(corpus)
    gen = torch.Generator().manual_seed(0)
    new = [p for n, p in conv.named_parameters() if n.startswith("depthrewrite.")]
    old = [p for n, p in conv.named_parameters() if not n.startswith("depthrewrite.")]
    opt = torch.optim.AdamW([{"params": old}, {"params": new, "weight_decay": 0.0}], lr=3e-3)
    conv.train()
    for step in range(steps):
        x, y = corpus.batch("train", 8, 64, gen)
        logits = conv(x).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 5 == 0 or step == steps - 1:
            print(f"step {step:3d}  loss {loss.item():.3f}")
    conv.eval()
    with torch.no_grad():
        val = [torch.nn.functional.cross_entropy(conv(x).logits.flatten(0, 1), y.flatten()).item()
               for x, y in corpus.eval_batches(4, 8, 64)]
    print(f"validation loss (held-out files): {sum(val) / len(val):.3f} nats/byte")
    torch.save(conv.state_dict(), out / "llama_attnres.pt")
    print(f"wrote {out / 'llama_attnres.pt'}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("depthrewrite-demo"))
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    main(args.out, args.steps)
