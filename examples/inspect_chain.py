"""Inspect the PreNorm residual chain of a Hugging Face model and of a hand-written nanoGPT, draw the chain, then
convert the nanoGPT to Block AttnRes and draw the *rewritten* graph.

    python examples/inspect_chain.py [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import depthrewrite as dr
from depthrewrite.views.draw import rewritten_text, save_rewritten
from depthrewrite.testing import nanogpt
from depthrewrite.demo.zoo import hf_model


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    report = dr.inspect(hf_model("qwen3", layers=3))  # random weights from a small config; nothing downloaded
    print(report)
    print()
    print(report.graph_text(only_chain=True))

    gpt = dr.inspect(nanogpt(n_layer=2))
    print()
    print(gpt)
    try:
        path = gpt.save(out / "nanogpt_chain.svg")
    except dr.ConfigError as e:  # no pydot / Graphviz: DOT text still works
        print(f"(svg unavailable: {e})")
        path = gpt.save(out / "nanogpt_chain.dot")
    print(f"wrote {path}")

    # The rewritten graph, read back from the converted FX graph: sublayers, the depth_attn mixing ops, block sums.
    conv = dr.convert(nanogpt(n_layer=2), "attnres", blocks=2)
    print()
    print(conv.report())
    print()
    print(rewritten_text(conv))
    try:
        path = save_rewritten(conv, out / "nanogpt_block_attnres.svg")
    except dr.ConfigError as e:
        print(f"(svg unavailable: {e})")
        path = save_rewritten(conv, out / "nanogpt_block_attnres.dot")
    print(f"wrote {path}")


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The module docstring as the description, and every option's default in --help."""


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    ap.add_argument("--out", type=Path, default=Path("depthrewrite-examples/inspect_chain"),
                    help="output folder for the chain and rewritten-graph pictures")
    main(ap.parse_args().out)
