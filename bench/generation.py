"""Decoding cost with a KV cache: time per generated token at a short and a long prefix, vanilla and every scheme.

    python -m bench.generation [--layers 4] [--hidden 256] [--prefixes 32 512] [--tokens 16] [--threads 1]

A converted model decodes one token with the model's own KV cache (``generate()``'s default), so the time per token
should grow with the prefix only as the vanilla model's does (attention over a longer cache), not by re-running the
prefix. Per-token time is measured as ``(t(generate N+1 tokens) - t(generate 1 token)) / N`` so the prefill cancels
out; every row is measured in the same run, side by side, best of ``--repeats``. A scheme whose record says it cannot
decode with a cache (``Scheme.no_cached_decoding``: MSAR) is timed with ``use_cache=False`` and marked: that row shows
what recomputing the prefix at every step costs.
"""

from __future__ import annotations

import argparse
import platform
import time
from datetime import date

import torch

import depthrewrite as dr
from depthrewrite.demo.zoo import hf_model


def token_sample(model, ids: torch.Tensor, tokens: int, cache: bool) -> float:
    """One sample of seconds per generated token: ``(t(generate tokens + 1) - t(generate 1)) / tokens``, greedy."""
    kw = dict(do_sample=False, use_cache=cache, pad_token_id=0)

    def run(n: int) -> float:
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        return time.perf_counter() - t

    return (run(tokens + 1) - run(1)) / tokens


def prefix_ids(model, prefix: int) -> torch.Tensor:
    return torch.randint(3, model.config.vocab_size, (1, prefix), generator=torch.Generator().manual_seed(prefix))


def _per_token(model, prefix: int, tokens: int, cache: bool, repeats: int) -> float:
    ids = prefix_ids(model, prefix)
    token_sample(model, ids, 1, cache)  # capture the prefill and decoding graphs, warm up
    return min(token_sample(model, ids, tokens, cache) for _ in range(repeats))


def _set_check(on: bool) -> None:
    from depthrewrite.runtime import entries

    entries.SKIP_EXPORT_INPUT_CHECK = not on


def _set_before_fast_paths(on: bool) -> None:
    """The two no-grad fast paths of 2026-12-07 off (on=True) or on: depth ops called through the dispatcher, and
    MSAR's streams one at a time."""
    from depthrewrite.kernels import direct
    from depthrewrite.kernels.msar import reference as msar_reference

    direct.ENABLED = not on
    msar_reference._SMALL_MIX = 0 if on else msar_reference.SMALL_MIX


def _set_sources_apart(on: bool) -> None:
    """Blocks read their earlier depth sources as separate inputs (on=True), as before 2026-12-07, or stacked. Read
    when a graph is captured: the A/B converts a second model for it (:data:`NEEDS_OWN_MODEL`)."""
    from depthrewrite import blocks

    blocks.STACK_SOURCES = not on


# --ab WHAT: (row label, toggle(True) turns the older behaviour on, toggle(False) restores today's)
AB = {
    "check": ("export's check", _set_check),  # export's input check on every call (as before 2026-12-05)
    "fast-paths": ("before 12-07", _set_before_fast_paths),  # depth ops via the dispatcher, MSAR's streams one by one
    "sources": ("sources apart", _set_sources_apart),  # each block's earlier depth sources as separate inputs
}
#: A/Bs whose setting is read when a graph is captured: the older setting gets a converted model of its own
NEEDS_OWN_MODEL = {"sources"}


def _per_token_ab(model, prefix: int, tokens: int, cache: bool, repeats: int, toggle,
                  older=None) -> tuple[float, float]:
    """``(today's, the older setting's)``: samples of the two settings taken in turn, best of ``repeats`` each.
    ``older``: the model the older setting runs (default ``model``: the toggle acts at run time)."""
    models = (model, model if older is None else older)
    ids = prefix_ids(model, prefix)
    best = [float("inf"), float("inf")]
    try:
        for which in (0, 1):  # capture each setting's graphs under it, warm up
            toggle(which == 1)
            token_sample(models[which], ids, 1, cache)
        for r in range(repeats):
            for which in ((0, 1) if r % 2 == 0 else (1, 0)):
                toggle(which == 1)
                best[which] = min(best[which], token_sample(models[which], ids, tokens, cache))
    finally:
        toggle(False)
    return best[0], best[1]


def rows(layers: int, hidden: int, prefixes: tuple[int, int], tokens: int, repeats: int,
         ab: str | None = None, schemes: list[str] | None = None) -> list[list]:
    torch.manual_seed(0)
    base = hf_model("llama", layers=layers, hidden=hidden, max_position_embeddings=max(prefixes) + tokens + 8).eval()
    variants = [("vanilla", None, {})]
    for name, rec in dr.schemes().items():
        for v in rec.variants:
            if not schemes or name in schemes or v.label in schemes:
                variants.append((v.label, name, dict(v.options)))
    out = []
    for label, key, options in variants:
        model = base if key is None else dr.convert(base, key, inplace=False, **options)
        rec = None if key is None else dr.scheme(model.report().config)
        cache = rec is None or rec.no_cached_decoding is None
        if ab and key is not None:
            what, toggle = AB[ab]
            older = dr.convert(base, key, inplace=False, **options) if ab in NEEDS_OWN_MODEL else None
            (short, short_b), (long, long_b) = (_per_token_ab(model, p, tokens, cache, repeats, toggle, older)
                                                for p in prefixes)
            out.append([f"{label}, {what}", "yes" if cache else "no (use_cache=False)", f"{1e3 * short_b:.2f}",
                        f"{1e3 * long_b:.2f}", f"{long_b / short_b:.2f}"])
        else:
            short, long = (_per_token(model, p, tokens, cache, repeats) for p in prefixes)
        out.append([label, "yes" if cache else "no (use_cache=False)", f"{1e3 * short:.2f}", f"{1e3 * long:.2f}",
                    f"{long / short:.2f}"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--prefixes", type=int, nargs=2, default=(32, 512))
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--schemes", nargs="+", default=None, help="only these schemes (keys or variant labels) and vanilla")
    p.add_argument("--ab", choices=sorted(AB),
                   help="also time each converted model with an older setting, samples taken in turn with today's: "
                        "'check' runs export's input check on every call (as before 2026-12-05), 'fast-paths' calls "
                        "the depth ops through the dispatcher and MSAR's streams one at a time at a no-grad call (as "
                        "before 2026-12-07), 'sources' passes each block its earlier depth sources as separate "
                        "inputs, not stacked (as before 2026-12-07; a second converted model)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    s, l_ = a.prefixes
    table = rows(a.layers, a.hidden, (s, l_), a.tokens, a.repeats, a.ab, a.schemes)
    from tabulate import tabulate

    print(f"Generation, tiny Llama ({a.layers} layers, hidden {a.hidden}), batch 1, greedy, {a.tokens} tokens; "
          f"{platform.processor() or platform.machine()}, {a.threads} thread(s), torch {torch.__version__}, "
          f"{date.today()}")
    print(tabulate(table, headers=["model", "KV cache", f"ms/token @ {s}", f"ms/token @ {l_}", f"ratio {l_}/{s}"],
                   tablefmt="github"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
