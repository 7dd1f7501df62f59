"""Convert a hand-written nanoGPT-style model into every scheme and compare them at init and after a few steps.

    python examples/nanogpt_schemes.py [--out DIR] [--steps N]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tabulate import tabulate

import depthrewrite as dr
from depthrewrite.testing import nanogpt


def schemes() -> dict[str, tuple[str, dict]]:
    """label -> (scheme, options): the demo's variants of every registered scheme (``Scheme.variants``); one that is
    not function-preserving at init (MoDA as in the paper) runs with the scheme's exact options (``Scheme.exact``)."""
    out = {}
    for s in dr.schemes().values():
        for v in s.variants:
            if v.demo:
                opts = dict(v.options) if v.init_tol is not None else {**v.options, **s.exact}
                out[s.name + (f" ({', '.join(f'{k}={x}' for k, x in opts.items())})" if opts else "")] = (s.name, opts)
    return out


def main(out: Path, steps: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    data = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(0))
    x, y = data[:, :-1], data[:, 1:]
    rows = []
    for label, (scheme, options) in schemes().items():
        torch.manual_seed(0)
        model = nanogpt(n_layer=4, n_embd=64)
        conv = dr.convert(model, scheme, inplace=False, **options)  # the original stays the reference
        with torch.no_grad():
            err = ((conv(x) - model(x)).abs().max() / model(x).abs().max()).item()
        opt = torch.optim.AdamW(conv.parameters(), lr=3e-3)
        for _ in range(steps):
            loss = torch.nn.functional.cross_entropy(conv(x).flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
        rep = conv.report()
        rows.append([label, f"{rep.new_params:,}", f"{err:.1e}", f"{loss.item():.3f}"])
    table = tabulate(rows, headers=["scheme", "new params", "init rel. error", f"loss after {steps} steps"])
    print(table)
    (out / "nanogpt_schemes.md").write_text(table + "\n")


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The module docstring as the description, and every option's default in --help."""


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    ap.add_argument("--out", type=Path, default=Path("depthrewrite-examples/nanogpt_schemes"),
                    help="output folder for the comparison table")
    ap.add_argument("--steps", type=int, default=10, help="training steps per scheme")
    args = ap.parse_args()
    main(args.out, args.steps)
