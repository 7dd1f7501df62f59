"""Generate docs/architectures.md from the test zoo: the models the tests run, what detection finds in each, and the
schemes whose init-equivalence tests run on it.

    python -m bench.architectures [--out docs/architectures.md] [--verify]

The model lists are imported from the tests (``tests/passes/analyse/test_chain.py``: ZOO, MORE_HF and the refused
models; ``tests/passes/rewrite/test_contract.py``: its ZOO, MORE_HF sweep, REFUSED and the SCHEMES it checks; the
schemes themselves are the registry's, ``depthrewrite.schemes()``), so the table cannot drift from what CI asserts.
Detection is run here for every row (a few seconds per model).
``--verify`` also converts every model into every listed scheme and checks init equivalence again (minutes).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the tests package lives at the repository root
    sys.path.insert(0, str(ROOT))

from tests.conftest import LAYERS, build_zoo_model, zoo_graph  # noqa: E402
from tests.passes.analyse import test_chain  # noqa: E402
from tests.passes.rewrite import test_contract  # noqa: E402

import depthrewrite as dr  # noqa: E402
from depthrewrite.errors import DepthRewriteError  # noqa: E402

#: every registered scheme, in registration order (a new scheme's rewrite file adds it here)
SCHEMES = tuple(dr.schemes())
#: models the detection tests assert are refused, with the test that asserts it
REFUSED = {
    "hf:bert": "test_bert_postnorm_is_refused",
    "hf:inkling2_text": "test_inkling2_is_refused_as_already_depth_mixed",
    "hf:dory": "test_dory_is_refused_as_an_interpolating_normalised_stream",
}


def zoo_names() -> list[str]:
    names = [p.values[0] for p in test_chain.ZOO] + [f"hf:{t}" for t in test_chain.MORE_HF] + list(test_contract.ZOO)
    return list(dict.fromkeys(names))


def tested_schemes(name: str) -> tuple[list[str], list[str]]:
    """(schemes whose init-equivalence test runs on ``name``, schemes a test asserts are refused)."""
    contract_zoo = set(test_contract.ZOO)
    more = {f"hf:{t}" for t in test_contract.MORE_HF}
    checked = {p.values[0] for p in test_contract.SCHEMES}
    if name in contract_zoo:
        return [s for s in SCHEMES if s in checked], []
    if name in more:
        refused = [s for s in SCHEMES if name.removeprefix("hf:") in test_contract.REFUSED.get(s, ())]
        return [s for s in SCHEMES if s not in refused], refused
    return [], []


def _verify(name: str, schemes: list[str]) -> list[str]:
    from tests.passes.rewrite.helpers import INIT_RTOL, inputs_for, logits, rel_err

    ok = []
    for scheme in schemes:
        torch.manual_seed(0)
        model = build_zoo_model(name).eval()
        try:
            conv = dr.convert(model, scheme, **test_contract.EXACT[scheme]).eval()
            x = inputs_for(name, model)
            with torch.no_grad():
                if rel_err(logits(conv(*x)), logits(model(*x))) <= INIT_RTOL:
                    ok.append(scheme)
        except DepthRewriteError:
            pass
    return ok


def detection_cells(model, chain) -> str:
    """The class, sublayers, reading and final-norm cells of one row: what detection found in ``model``."""
    kinds = Counter(s.kind for s in chain.sublayers)
    readings = sorted({s.reading for s in chain.sublayers})
    return (f"{type(model).__name__} | {len(chain)} ({', '.join(f'{n} {k}' for k, n in kinds.items())}) | "
            f"{', '.join(readings)} | {chain.final_norm.short}")


#: the training frameworks' test models (tests/frameworks/models.py) and the test file that converts each into every
#: scheme (tests/frameworks/contract.py: every registered scheme, Full and Block forms, init equivalence + a step)
FRAMEWORK_TESTS = {"litgpt": "test_litgpt.py", "torchtitan": "test_torchtitan.py", "torchtune": "test_torchtune.py",
                   "olmo_core": "test_olmo_core.py"}


def framework_rows() -> list[str]:
    """One row per framework model the tests build: detection run here on the framework's own class."""
    import importlib.util

    from tests.frameworks import contract
    from tests.frameworks.models import CASES, FRAMEWORKS, _stubbed, build

    schemes = ", ".join(dict.fromkeys(p.values[0] + ("-block" if "blocks" in p.values[1] else "")
                                      for p in contract.SCHEMES))
    rows = []
    for fw, name in CASES:
        test = f"`tests/frameworks/{FRAMEWORK_TESTS[fw]}`"
        if importlib.util.find_spec(FRAMEWORKS[fw]) is None:
            rows.append(f"| {fw} `{name}` | — | not installed where this page was generated | | | {test} |")
            continue
        with _stubbed(fw):
            model, args, kwargs = build(fw, name)
        chain = dr.detect_chain(dr.capture(model, args, kwargs or None))
        rows.append(f"| {fw} `{name}` | {detection_cells(model, chain)} | {schemes} ({test}) |")
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.architectures", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "architectures.md")
    ap.add_argument("--verify", action="store_true", help="convert every model into every listed scheme and re-check")
    args = ap.parse_args(argv)
    rows = []
    for name in zoo_names():
        model, gm = zoo_graph(name)
        chain = dr.detect_chain(gm)
        passing, refused = tested_schemes(name)
        if args.verify and passing:
            verified = _verify(name, passing)
            if verified != passing:
                print(f"{name}: listed {passing}, verified {verified}", file=sys.stderr)
                passing = verified
        schemes = ", ".join(passing) or "detection only"
        if refused:
            schemes += " (refused: " + ", ".join(refused) + ")"
        rows.append(f"| `{name}` | {detection_cells(model, chain)} | {schemes} |")
        print(rows[-1], flush=True)
    for name, test in REFUSED.items():
        model, gm = zoo_graph(name)
        try:
            dr.detect_chain(gm)
            verdict = "**detected** (the refusal test would fail)"
        except DepthRewriteError as e:
            verdict = f"refused: `{type(e).__name__}`"
        rows.append(f"| `{name}` | {type(model).__name__} | {verdict} | | | — (`{test}`) |")
    text = f"""# Supported architectures

Generated by `python -m bench.architectures` from the test zoo; do not edit by hand. Every model is built from a small
config with random weights and {LAYERS} transformer blocks (nothing is downloaded); detection is run on each when the
table is generated, and every row is also asserted by a test:

- **sublayers** and **reading**: `tests/passes/analyse/test_chain.py` (`ZOO` with exact modules and norms, `MORE_HF`
  with kinds). Parallel blocks count as one sublayer per block (`attention+mlp`).
- **schemes**: the schemes whose function-preserving-at-init test runs on the model in
  `tests/passes/rewrite/test_contract.py` (AttnRes Full and Block, MSAR Full and Block, mHC, MoDA with
  `preserve_init=True`; the `ZOO` there also runs the contract tests). "refused" means a test asserts a clear
  `AttentionPatternError` instead (MoDA on ALiBi written as `baddbmm`/`masked_fill`, and on attention sinks).
  "detection only": the model is in the detection zoo but not in the conversion sweep.

| spec | class | sublayers | reading | final norm | schemes (init-equivalence tested) |
|---|---|---|---|---|---|
""" + "\n".join(rows) + """

## Training frameworks

The training frameworks' own model classes, built tiny from their own configs by `tests/frameworks/models.py` (with
""" + str(LAYERS) + """ blocks; one page per framework in [frameworks/](frameworks/index.md)). Every row's schemes are
converted, checked exact at init and trained one step by the test named.

| framework and model | class | sublayers | reading | final norm | schemes (init-equivalence tested) |
|---|---|---|---|---|---|
""" + "\n".join(framework_rows()) + """

Refusals are explained in [concepts](concepts.md#what-is-refused-and-how) and [limitations](limitations.md).
Reproduce one row:

```python
from tests.conftest import zoo_graph
import depthrewrite as dr
print(dr.inspect(zoo_graph("hf:llama")[0]))
```
"""
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
