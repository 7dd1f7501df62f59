"""A converted model is still the model: convert a Hugging Face Llama to Block MSAR in place, fine-tune it with peft's
LoRA plus the new depth-mixing parameters on the standard library's source, generate with the KV cache, then save it
and load it back.

    python examples/lora_generate.py [--out DIR] [--steps N]

Every call structure (training with labels, cached prefill, one-token decoding) gets its own captured graph on first
use; peft replacing ``q_proj``/``v_proj`` with LoRA layers keeps the graphs, which call those modules live (a decoding
step's graph inlines them, so a change after decoding recaptures through them).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import depthrewrite as dr
from depthrewrite.demo.corpus import Corpus
from depthrewrite.demo.zoo import hf_model


def main(out: Path, steps: int) -> None:
    from peft import LoraConfig, get_peft_model

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = hf_model("llama", layers=4, hidden=64)
    conv = dr.convert(model, "block-msar")  # in place: conv is model, a LlamaForCausalLM
    print(f"{type(conv).__name__}, converted: {dr.is_converted(conv)}")

    lora = get_peft_model(conv, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    for name, p in lora.named_parameters():
        if ".depthrewrite." in name:  # peft froze everything but LoRA: train the depth mixing too
            p.requires_grad_(True)
    trainable = [p for p in lora.parameters() if p.requires_grad]
    print(f"trainable parameters: {sum(p.numel() for p in trainable):,} of {sum(p.numel() for p in lora.parameters()):,}")

    corpus = Corpus.stdlib(max_bytes=1_000_000)
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(trainable, lr=3e-3)
    lora.train()
    for step in range(steps):
        x, _ = corpus.batch("train", 8, 64, gen)
        loss = lora(input_ids=x, labels=x).loss  # HF shifts the labels itself
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 5 == 0 or step == steps - 1:
            print(f"step {step:3d}  loss {loss.item():.3f}")

    lora.eval()
    prompt, _ = corpus.batch("val", 1, 16, gen)
    kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
    cached = lora.generate(input_ids=prompt, use_cache=True, **kw)  # MSAR's conv history rides in the KV cache
    recomputed = lora.generate(input_ids=prompt, use_cache=False, **kw)
    print(f"greedy tokens with the KV cache equal recomputing the prefix: {torch.equal(cached, recomputed)}")

    merged = lora.merge_and_unload()  # LoRA folded into q_proj / v_proj: the decoding graphs inline them, so it recaptures
    merged.save_pretrained(out / "llama-block-msar")
    back = dr.from_pretrained(out / "llama-block-msar")
    with torch.no_grad():
        same = torch.allclose(back(prompt).logits, merged(prompt).logits, atol=1e-5)
    rep = back.report()
    print(f"saved {out / 'llama-block-msar'} (depthrewrite.json: {rep.config.describe(rep.block_size)}); reloaded: "
          f"same logits {same}")
    print(merged.report())


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The module docstring as the description, and every option's default in --help."""


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    p.add_argument("--out", type=Path, default=Path("depthrewrite-examples/lora_generate"),
                   help="output folder (the saved model goes in llama-block-msar/ inside it)")
    p.add_argument("--steps", type=int, default=20, help="LoRA fine-tuning steps")
    a = p.parse_args()
    main(a.out, a.steps)
