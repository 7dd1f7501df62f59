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
import itertools
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


def _lookup_by_exception(self, name: str):
    """A block runner's attribute read as before 2026-12-07 (night): nn.Module's lookup first, the live model's after
    it raised (an exception per read of the model's modules or depth parameters)."""
    try:
        return torch.nn.Module.__getattr__(self, name)
    except AttributeError:
        live = self.__dict__.get("_dr_live")
        if live is None:
            raise
        return getattr(live, name)


def _set_before_rows(on: bool) -> None:
    """Two cuts of 2026-12-07 (night) off (on=True) or on: the no-grad depth-attention mix on rows (every call the
    reference, as before) and the block runner's reads of the live model straight from it."""
    from depthrewrite.converted import ConvertedGraphModule
    from depthrewrite.kernels.depth_attn import reference as da_reference

    da_reference.SMALL_ROWS = 0 if on else _ROWS
    ConvertedGraphModule.__getattr__ = _lookup_by_exception if on else _GETATTR


def _today() -> tuple:
    from depthrewrite.converted import ConvertedGraphModule
    from depthrewrite.kernels.depth_attn import reference as da_reference

    return da_reference.SMALL_ROWS, ConvertedGraphModule.__getattr__


_ROWS, _GETATTR = _today()


# --ab WHAT: (row label, toggle(True) turns the older behaviour on, toggle(False) restores today's)
AB = {
    "check": ("export's check", _set_check),  # export's input check on every call (as before 2026-12-05)
    "fast-paths": ("before 12-07", _set_before_fast_paths),  # depth ops via the dispatcher, MSAR's streams one by one
    "sources": ("sources apart", _set_sources_apart),  # each block's earlier depth sources as separate inputs
    "rows": ("before rows", _set_before_rows),  # depth_attn's reference at every call, the runner's reads via raise
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


_ORDERS = tuple(itertools.permutations(range(3)))


def step_ab(base, model, prefix: int, steps: int, toggle, older=None) -> tuple[float, float, float]:
    """``(vanilla, today's, the older setting's)`` seconds per decoding step, each the median of ``steps`` single
    forward calls with the model's cache (one token after ``prefix`` tokens, the cache growing by one per call), the
    three interleaved call by call, round by round in all six orders (each model first, middle and last equally often:
    a call right after its own previous one finds its data in cache and runs faster, which an order reversed every
    round turned into a ~0.2 ms bias): a shared VM's drift hits all three alike, which best-of-N of whole
    ``generate()`` runs does not survive. Gradients off, greedy-free (the same token each step)."""
    import statistics

    from transformers import DynamicCache

    models = (base, model, model if older is None else older)
    ids = prefix_ids(base, prefix)
    caches, times = [], ([], [], [])
    try:
        with torch.no_grad():
            for i, m in enumerate(models):
                toggle(i == 2)
                caches.append(m(ids, cache=DynamicCache(config=m.config), use_cache=True).past_key_values)
                m(ids[:, -1:], cache=caches[i], use_cache=True)  # the decoding graph, captured under its setting
            for r in range(steps):
                for i in _ORDERS[r % len(_ORDERS)]:
                    toggle(i == 2)
                    t = time.perf_counter()
                    models[i](ids[:, -1:], cache=caches[i], use_cache=True)
                    times[i].append(time.perf_counter() - t)
    finally:
        toggle(False)
    return tuple(statistics.median(t) for t in times)


def step_rows(layers: int, hidden: int, prefix: int, steps: int, ab: str, schemes: list[str] | None) -> list[list]:
    """Per converted model: its decoding step today and with the older setting ``ab``, against vanilla's, measured
    by :func:`step_ab`."""
    torch.manual_seed(0)
    base = hf_model("llama", layers=layers, hidden=hidden, max_position_embeddings=prefix + steps + 8).eval()
    toggle = AB[ab][1]
    out = []
    for label, key, options in _variants(schemes):
        model = dr.convert(base, key, inplace=False, **options)
        older = dr.convert(base, key, inplace=False, **options) if ab in NEEDS_OWN_MODEL else None
        van, today, before = step_ab(base, model, prefix, steps, toggle, older)
        out.append([label, f"{1e3 * van:.3f}", f"{1e3 * before:.3f}", f"{1e3 * today:.3f}",
                    f"{before / van:.2f} → {today / van:.2f}"])
    return out


def _variants(schemes: list[str] | None) -> list[tuple[str, str, dict]]:
    """``(label, scheme, options)`` of every registry variant, or of those whose scheme or label ``schemes`` names."""
    return [(v.label, name, dict(v.options)) for name, rec in dr.schemes().items() for v in rec.variants
            if not schemes or name in schemes or v.label in schemes]


def rows(layers: int, hidden: int, prefixes: tuple[int, int], tokens: int, repeats: int,
         ab: str | None = None, schemes: list[str] | None = None) -> list[list]:
    torch.manual_seed(0)
    base = hf_model("llama", layers=layers, hidden=hidden, max_position_embeddings=max(prefixes) + tokens + 8).eval()
    out = []
    for label, key, options in [("vanilla", None, {}), *_variants(schemes)]:
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
                        "inputs, not stacked (as before 2026-12-07; a second converted model), 'rows' runs "
                        "depth_attn's reference at every no-grad call and the runner's reads of the model through "
                        "nn.Module's failed lookup (as before 2026-12-07, night)")
    p.add_argument("--per-step", type=int, default=0, metavar="N",
                   help="with --ab: time N single decoding steps per setting, interleaved call by call with vanilla's, "
                        "medians (after the first prefix), instead of generate() runs")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    s, l_ = a.prefixes
    from tabulate import tabulate

    if a.per_step:
        if not a.ab:
            p.error("--per-step needs --ab")
        print(f"Decoding step with a KV cache, tiny Llama ({a.layers} layers, hidden {a.hidden}), batch 1, prefix {s}, "
              f"medians of {a.per_step} steps interleaved with vanilla's; {platform.processor() or platform.machine()}, "
              f"{a.threads} thread(s), torch {torch.__version__}, {date.today()}")
        label = AB[a.ab][0]
        print(tabulate(step_rows(a.layers, a.hidden, s, a.per_step, a.ab, a.schemes),
                       headers=["model", "vanilla ms", f"{label} ms", "today ms", "× vanilla"], tablefmt="github"))
        return 0
    table = rows(a.layers, a.hidden, (s, l_), a.tokens, a.repeats, a.ab, a.schemes)

    print(f"Generation, tiny Llama ({a.layers} layers, hidden {a.hidden}), batch 1, greedy, {a.tokens} tokens; "
          f"{platform.processor() or platform.machine()}, {a.threads} thread(s), torch {torch.__version__}, "
          f"{date.today()}")
    print(tabulate(table, headers=["model", "KV cache", f"ms/token @ {s}", f"ms/token @ {l_}", f"ratio {l_}/{s}"],
                   tablefmt="github"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
