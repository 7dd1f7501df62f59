"""Conversion time: ``convert()`` (one capture, in the model's mode) and the first call of another structure (a
training step captures its own graph), per layer, at a few depths.

    python -m bench.conversion [--layers 16 32] [--hidden 256] [--scheme attnres] [--threads 1]

Since a converted model captures a graph per call structure on first use, ``convert()`` captures one graph (the
example call, in the model's current mode) instead of the two (training and eval) it captured up front before; the
training graph is captured by the first training call. Both are timed, side by side, in one run.
"""

from __future__ import annotations

import argparse
import time
from datetime import date

import torch

import depthrewrite as dr
from depthrewrite.demo.zoo import hf_model


def rows(layers: list[int], hidden: int, scheme: str) -> list[list]:
    out = []
    for L in layers:
        torch.manual_seed(0)
        model = hf_model("llama", layers=L, hidden=hidden).eval()
        ids = torch.randint(0, 256, (2, 16))
        t = time.perf_counter()
        conv = dr.convert(model, scheme)
        first = time.perf_counter() - t
        conv.train()
        t = time.perf_counter()
        conv(input_ids=ids, labels=ids).loss.backward()
        train = time.perf_counter() - t
        out.append([L, 2 * L, f"{first:.2f}", f"{first / L:.3f}", f"{train:.2f}", f"{(first + train) / L:.3f}"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[16, 32])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--scheme", default="attnres")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from tabulate import tabulate

    print(f"Conversion time, tiny Llama (hidden {a.hidden}), {a.scheme}, {a.threads} thread(s), torch "
          f"{torch.__version__}, {date.today()}")
    print(tabulate(rows(a.layers, a.hidden, a.scheme), tablefmt="github", headers=[
        "layers", "sublayers", "convert() s", "s / layer", "first training step s (its capture + step)",
        "both graphs, s / layer"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
