"""What module calls cost: a converted model that calls its intact modules as live modules (``module_calls=True``)
against the same conversion running inlined aten graphs (``module_calls=False``), side by side.

    python -m bench.module_calls [--layers 4] [--hidden 256] [--schemes attnres msar mhc block-msar moda]
                                 [--prefixes 32 512] [--tokens 16] [--repeats 5] [--conv-layers 16] [--threads 1]

Per scheme and mode, in one run, the call and decode times of the two modes sampled A/B interleaved
(:func:`interleaved`: one sample of each per repeat, the order reversed every repeat), best of ``--repeats``:

* **call**: one eager forward of a short sequence (batch 1, 16 tokens, eval, no grad), mean of 20 calls per sample:
  the per-call overhead of calling modules (``nn.Module.__call__`` with its hook checks, per Linear, norm and
  embedding) instead of running their aten ops in the graph;
* **decode**: ms per generated token with the KV cache at a short and a long prefix
  (:func:`bench.generation.token_sample`: ``(t(N+1 tokens) - t(1 token)) / N``, greedy); MSAR recomputes the prefix (``use_cache=False``, marked);
* **convert**: ``convert()`` time per layer at ``--conv-layers`` layers (one capture, the module-call lowering
  included).

The vanilla model's call and decode times (measured before, not interleaved) are the first row. Ratios are module
calls / inlined.
"""

from __future__ import annotations

import argparse
import platform
import time
from datetime import date

import torch

import depthrewrite as dr
from bench.generation import _per_token, prefix_ids, token_sample
from depthrewrite.zoo import hf_model

# module_calls=True: with no hooks on the model it runs the same graphs as the default (None); True makes sure a call
# that cannot keep its module calls fails instead of being measured inlined
MODES = (("module calls", True), ("inlined", False))


def _call_sample(model, ids: torch.Tensor, calls: int = 20) -> float:
    """Seconds per eager forward over ``calls`` calls (eval, no grad, no cache)."""
    with torch.no_grad():
        t = time.perf_counter()
        for _ in range(calls):
            model(input_ids=ids, use_cache=False)
    return (time.perf_counter() - t) / calls


def _call_ms(model, repeats: int) -> float:
    ids = _call_ids(model)
    _call_sample(model, ids, 1)  # capture, warm up
    return 1e3 * min(_call_sample(model, ids) for _ in range(repeats))


def _call_ids(model) -> torch.Tensor:
    return torch.randint(3, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))


def interleaved(models: dict[str, torch.nn.Module], prefixes: tuple[int, ...], tokens: int, cache: bool,
                repeats: int) -> dict[str, list[float]]:
    """Best-of-``repeats`` call ms and decode ms/token per prefix of each model, measured A/B interleaved: each
    repeat takes one sample of every model, in an order that reverses every repeat, so drift of the machine (another
    process, frequency, allocator state) falls on every model alike instead of on whichever ran later."""
    order = list(models)
    ids = {k: _call_ids(m) for k, m in models.items()}
    gen = {p: prefix_ids(next(iter(models.values())), p) for p in prefixes}
    for k, m in models.items():  # capture every graph these calls use, warm up
        _call_sample(m, ids[k], 1)
        for p in prefixes:
            token_sample(m, gen[p], 1, cache)
    best = {k: [float("inf")] * (1 + len(prefixes)) for k in models}
    for r in range(repeats):
        for k in (order if r % 2 == 0 else order[::-1]):
            m = models[k]
            samples = [_call_sample(m, ids[k]), *(token_sample(m, gen[p], tokens, cache) for p in prefixes)]
            best[k] = [min(b, 1e3 * x) for b, x in zip(best[k], samples)]
    return best


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
        models = {label: dr.convert(base, scheme, inplace=False, module_calls=mode) for label, mode in MODES}
        cache = dr.scheme(models["inlined"].report().config).no_cached_decoding is None
        best = interleaved(models, prefixes, tokens, cache, repeats)
        measured = {}
        for label, mode in MODES:
            conv = _convert_s_per_layer(scheme, conv_layers, hidden, mode)
            measured[label] = (*best[label], conv)
            out.append([scheme + ("" if cache else " (no cache)"), label, *(f"{x:.2f}" for x in best[label]),
                        f"{conv:.3f}"])
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
