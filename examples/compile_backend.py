"""Compile a converted model with the ``depthrewrite`` backend, train it, and ask the backend what it did.

    python examples/compile_backend.py [--out DIR] [--steps N] [--inner inductor|aot_eager|eager]

On a GPU the registered depth ops run their fused Triton kernels inside the inductor-compiled graph; on a CPU they run
their PyTorch references. The default inner compiler is inductor on CUDA and aot_eager on CPU (an inductor compile
of forward + backward takes about a minute on two CPU cores; pass ``--inner inductor`` to see it anyway).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import depthrewrite as dr
from depthrewrite.demo.zoo import hf_model


def main(out: Path, steps: int, inner: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = hf_model("llama", layers=4, hidden=64).to(device)
    conv = dr.convert(model, "attnres", blocks=2)  # Block AttnRes: 2 blocks of 4 sublayers

    print(dr.explain(conv), "\n")  # what the backend would do, before compiling

    compiled = torch.compile(conv, backend="depthrewrite", options={"inner": inner})
    opt = torch.optim.AdamW(conv.parameters(), lr=3e-3)
    ids = torch.randint(0, model.config.vocab_size, (4, 32), device=device)
    for step in range(steps):
        logits = compiled(ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step}  loss {loss.item():.3f}")

    exp = dr.explain(compiled)
    print("\n" + str(exp))
    (out / "explain.json").write_text(json.dumps(exp.to_dict(), indent=1, default=str))
    print(f"\nwrote {out / 'explain.json'}")


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The module docstring as the description, and every option's default in --help."""


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    ap.add_argument("--out", type=Path, default=Path("depthrewrite-examples/compile_backend"), help="output folder")
    ap.add_argument("--steps", type=int, default=5, help="compiled training steps")
    ap.add_argument("--inner", default="inductor" if torch.cuda.is_available() else "aot_eager",
                    choices=["inductor", "aot_eager", "eager"],
                    help="the compiler the backend hands the rewritten graph to (inductor on CUDA, aot_eager on CPU)")
    args = ap.parse_args()
    main(args.out, args.steps, args.inner)
