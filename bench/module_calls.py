"""What module calls cost: a converted model that calls its intact modules as live modules (``module_calls=True``)
against the same conversion running inlined aten graphs (``module_calls=False``), side by side.

    python -m bench.module_calls [--layers 4] [--hidden 256] [--schemes attnres msar mhc block-msar moda]
                                 [--prefixes 32 512] [--tokens 16] [--repeats 5] [--conv-layers 16] [--threads 1]

Per scheme and mode, in one run:

* **call**: one eager forward of a short sequence (batch 1, 16 tokens, eval, no grad), best of ``--repeats`` x 20
  calls: the per-call overhead of calling modules (``nn.Module.__call__`` with its hook checks, per Linear, norm and
  embedding) instead of running their aten ops in the graph;
* **decode**: ms per generated token with the KV cache at a short and a long prefix (:func:`bench.generation._per_token`:
  ``(t(N+1 tokens) - t(1 token)) / N``, greedy); MSAR recomputes the prefix (``use_cache=False``, marked);
* **convert**: ``convert()`` time per layer at ``--conv-layers`` layers (one capture, the module-call lowering
  included).

The vanilla model's call and decode times are the first row. Ratios are module calls / inlined.
"""

from __future__ import annotations

import argparse
import platform
import time
from datetime import date

import torch

import depthrewrite as dr
from bench.generation import _per_token
from depthrewrite.zoo import hf_model

# module_calls=True: with no hooks on the model it runs the same graphs as the default (None); True makes sure a call
# that cannot keep its module calls fails instead of being measured inlined
MODES = (("module calls", True), ("inlined", False))


def _call_ms(model, repeats: int, calls: int = 20) -> float:
    ids = torch.randint(3, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)  # capture, warm up
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(calls):
                model(input_ids=ids, use_cache=False)
            best = min(best, (time.perf_counter() - t) / calls)
    return 1e3 * best


def _convert_s_per_layer(scheme: str, layers: int, hidden: int, module_calls: bool | None) -> float:
    torch.manual_seed(0)
    model = hf_model("llama", layers=layers, hidden=hidden).eval()
    t = time.perf_counter()
    dr.convert(model, scheme, module_calls=module_calls)
    return (time.perf_counter() - t) / layers


def rows(layers: int, hidden: int, schemes: list[str], prefixes: tuple[int, int], tokens: int, repeats: int,
         conv_layers: int) -> list[list]:
    torch.manual_seed(0)
    base = hf_model("llama", layers=layers, hidden=hidden, max_position_embeddings=max(prefixes) + tokens + 8).eval()
    out = [["vanilla", "-", f"{_call_ms(base, repeats):.2f}",
            *(f"{1e3 * _per_token(base, p, tokens, True, repeats):.2f}" for p in prefixes), "-"]]
    for scheme in schemes:
        measured = {}
        for label, mode in MODES:
            model = dr.convert(base, scheme, inplace=False, module_calls=mode)
            cache = dr.scheme(model.report().config).no_cached_decoding is None
            call = _call_ms(model, repeats)
            decode = [1e3 * _per_token(model, p, tokens, cache, repeats) for p in prefixes]
            conv = _convert_s_per_layer(scheme, conv_layers, hidden, mode)
            measured[label] = (call, *decode, conv)
            out.append([scheme + ("" if cache else " (no cache)"), label, f"{call:.2f}",
                        *(f"{d:.2f}" for d in decode), f"{conv:.3f}"])
        ratio = [a / b for a, b in zip(measured["module calls"], measured["inlined"])]
        out.append([scheme, "ratio", *(f"{r:.2f}x" for r in ratio)])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--schemes", nargs="+", default=["attnres", "msar", "mhc", "block-msar", "moda"])
    p.add_argument("--prefixes", type=int, nargs=2, default=(32, 512))
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--conv-layers", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    s, l_ = a.prefixes
    table = rows(a.layers, a.hidden, a.schemes, (s, l_), a.tokens, a.repeats, a.conv_layers)
    from tabulate import tabulate

    print(f"Module calls vs inlined graphs, tiny Llama ({a.layers} layers, hidden {a.hidden}), batch 1; convert() at "
          f"{a.conv_layers} layers; {platform.processor() or platform.machine()}, {a.threads} thread(s), torch "
          f"{torch.__version__}, {date.today()}")
    print(tabulate(table, headers=["scheme", "mode", "call ms (16 tokens)", f"ms/token @ {s}", f"ms/token @ {l_}",
                                   "convert s/layer"], tablefmt="github"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
