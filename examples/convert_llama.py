"""Convert a Hugging Face Llama to Block AttnRes, check it is the same function, load its checkpoint, and train it
byte-level on the Python standard library's source (the demo's corpus), then generate with the KV cache and save and
reload it with its recipe (save_pretrained / depthrewrite.from_pretrained).

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
    conv = dr.convert(model, "attnres", blocks=4, inplace=False)  # keep the original to compare with
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
    # still the model: generate() with the KV cache, save_pretrained / from_pretrained with the scheme's recipe
    prompt, _ = corpus.batch("val", 1, 16, gen)
    tokens = conv.generate(prompt, max_new_tokens=16, do_sample=False, use_cache=True, pad_token_id=0)
    print(f"generated {tokens.shape[1] - prompt.shape[1]} tokens with the KV cache")
    conv.save_pretrained(out / "llama_attnres")
    back = dr.from_pretrained(out / "llama_attnres")
    with torch.no_grad():
        same = torch.equal(back(prompt).logits, conv(prompt).logits)
    print(f"wrote {out / 'llama_attnres'} (config.json, model.safetensors, depthrewrite.json); reloaded: same logits {same}")


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The module docstring as the description, and every option's default in --help."""


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    ap.add_argument("--out", type=Path, default=Path("depthrewrite-examples/convert_llama"),
                    help="output folder (the saved model goes in llama_attnres/ inside it)")
    ap.add_argument("--steps", type=int, default=20, help="training steps on the standard-library corpus")
    args = ap.parse_args()
    main(args.out, args.steps)
