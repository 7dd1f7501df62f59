"""The transformers sweep: every causal-LM model type transformers ships, every scheme, tiny with random weights.

    python -m bench.sweep [--types a,b,...] [--schemes attnres,mhc,...] [--out bench/sweep_results.json] [--resume]
                          [--layers 2] [--timeout 600] [--deep]

For each model type (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``) the model is built once by
``depthrewrite.demo.zoo.hf_model(type, layers=2)``; each scheme then converts it (``inplace=False``) with the scheme's
exact-at-init options (``depthrewrite.scheme(name).exact``), and the converted model's logits on
``depthrewrite.capture.example_inputs_for(model)`` are compared with the original's (max|Δ| / max|ref| <= 1e-5, the
contract's ``INIT_RTOL``). Each (type, scheme) row is one of:

* ``ok``         converted, and the same function at init
* ``refused``    a typed refusal: a :class:`depthrewrite.errors.DepthRewriteError` (class + first line)
* ``UNTYPED``    any other exception out of depthrewrite (type, message, last 3 traceback frames)
* ``MISMATCH``   converted, but the logits differ (max abs and relative diff) past the contract's tolerance and past
                 ``ROUNDING_FACTOR`` times the original's own fp32 rounding (fp32 vs a float64 copy; such a row is
                 ``ok`` with a note)
* ``not built``  the zoo cannot build the model tiny, or the original model fails on the example inputs
* ``timeout``    the row ran past ``--timeout`` seconds

``--deep`` also runs, on each converted model, a training step (loss.backward on the logits) and ``generate`` (4 new
tokens) where the model has one; their failures are classified the same way (the stage is recorded).

Rows are written to ``--out`` as they finish; ``--resume`` skips rows already there. A type whose process died
(segfault, OOM kill) is recorded as UNTYPED ``process died`` on the next ``--resume``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import torch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "sweep_results.json"
INIT_RTOL = 1e-5  # tests/passes/rewrite/helpers.py


class _Timeout(BaseException):
    """Raised by SIGALRM; a BaseException so that no ``except Exception`` in the code under test swallows it."""


def _alarm(signum, frame):  # pragma: no cover - signal handler
    raise _Timeout()


def all_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0][:300] if s else ""


def _frames(e: BaseException, n: int = 3) -> list[str]:
    tb = traceback.extract_tb(e.__traceback__)[-n:]
    return [f"{Path(f.filename).as_posix().split('site-packages/')[-1].replace(str(ROOT) + '/', '')}:{f.lineno} "
            f"in {f.name}: {(f.line or '').strip()[:160]}" for f in tb]


def _classify(e: BaseException, stage: str) -> dict[str, Any]:
    from depthrewrite.errors import DepthRewriteError

    if isinstance(e, DepthRewriteError):
        return {"status": "refused", "stage": stage, "error": type(e).__name__, "message": _first_line(e)}
    return {"status": "UNTYPED", "stage": stage, "error": f"{type(e).__module__}.{type(e).__qualname__}",
            "message": str(e).strip()[:1000], "frames": _frames(e)}


def _logits(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    lg = getattr(out, "logits", None)
    if isinstance(lg, torch.Tensor):
        return lg
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    if isinstance(out, dict):
        for v in out.values():
            if isinstance(v, torch.Tensor):
                return v
    return None


def _diff(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    if out.shape != ref.shape:
        return float("inf"), float("inf")
    a = (out.float() - ref.float()).abs()
    if torch.isnan(a).any():
        both_nan = torch.isnan(out) & torch.isnan(ref)
        if bool((torch.isnan(a) & ~both_nan).any()):
            return float("nan"), float("nan")
        a = torch.where(both_nan, torch.zeros_like(a), a)
    m = a.max().item() if a.numel() else 0.0
    scale = ref.float().abs().nan_to_num(0.0).max().item() if ref.numel() else 0.0
    return m, (m / scale if scale > 0 else (0.0 if m == 0 else float("inf")))


def _deep_checks(conv: torch.nn.Module, args: tuple, kwargs: dict, row: dict[str, Any]) -> dict[str, Any]:
    """A training step and generate on the converted model; returns the row updated (first failure wins)."""
    stage = "train"
    try:
        conv.train()
        out = conv(*args, **kwargs)
        lg = _logits(out)
        if lg is None:
            raise AssertionError(f"no logits in {type(out).__name__}")
        lg.float().square().mean().backward()
        conv.zero_grad(set_to_none=True)
        conv.eval()
        row["train"] = "ok"
        stage = "generate"
        ids = kwargs.get("input_ids")
        if ids is not None and hasattr(conv, "generate") and getattr(conv, "can_generate", lambda: False)():
            with torch.no_grad():
                conv.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
            row["generate"] = "ok"
        else:
            row["generate"] = "n/a"
    except _Timeout:
        raise
    except BaseException as e:  # noqa: BLE001 - classified
        deep = _classify(e, stage)
        if deep["status"] == "UNTYPED":
            row.update(deep)
        else:
            row[stage] = f"refused: {deep['error']}: {deep['message']}"
    return row


def _not_built(schemes: list[str], e: BaseException, where: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """A ``not built`` row per scheme: the zoo could not build the model, or the original failed on the inputs."""
    row = {"status": "not built", "message": f"{where}{type(e).__name__}: {_first_line(e)}", "frames": _frames(e)}
    for s in schemes:
        yield s, dict(row)


#: a row past INIT_RTOL still counts as exact when it is within this many times the original's own fp32 rounding (the
#: original in fp32 against itself in fp64): a model that amplifies rounding that much cannot be held to 1e-5 by a
#: conversion that rounds differently (docs/mhc.md: cpmant)
ROUNDING_FACTOR = 4


def _own_rounding(model: torch.nn.Module, args: tuple, kwargs: dict, ref: torch.Tensor) -> float:
    """max |Δ| / max |ref| of the original in fp32 (``ref``) against a float64 copy of it on the same inputs."""
    import copy

    from torch.utils._pytree import tree_map

    wide = lambda x: x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x  # noqa: E731
    try:
        m64 = copy.deepcopy(model).double().eval()
        with torch.no_grad():
            out = _logits(m64(*tree_map(wide, args), **tree_map(wide, kwargs)))
        return _diff(out.float(), ref)[1] if out is not None else 0.0
    except Exception:  # noqa: BLE001 - a model that does not run in fp64: no allowance
        return 0.0


def sweep_type(model_type: str, schemes: list[str], layers: int, timeout: int, deep: bool,
               done: set[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Rows for one model type (every scheme not in ``done``), yielded as they finish."""
    import depthrewrite as dr
    from depthrewrite.capture import example_inputs_for
    from depthrewrite.demo.zoo import hf_model
    from depthrewrite.errors import DepthRewriteError

    todo = [s for s in schemes if s not in done]
    if not todo:
        return
    t0 = time.time()
    signal.alarm(timeout)
    try:
        try:
            model = hf_model(model_type, layers=layers)
        except _Timeout:
            raise
        except BaseException as e:  # noqa: BLE001
            yield from _not_built(todo, e)
            return
        try:
            args, kwargs = example_inputs_for(model)
        except _Timeout:
            raise
        except BaseException as e:  # noqa: BLE001
            row = _classify(e, "example_inputs")
            for s in todo:
                yield s, dict(row)
            return
        try:
            with torch.no_grad():
                ref = _logits(model(*args, **kwargs))
            if ref is None:
                raise TypeError("the original's output has no logits tensor")
        except _Timeout:
            raise
        except BaseException as e:  # noqa: BLE001
            yield from _not_built(todo, e, "original forward: ")
            return
    except _Timeout:
        for s in todo:
            yield s, {"status": "timeout", "stage": "build", "seconds": round(time.time() - t0, 1)}
        return
    finally:
        signal.alarm(0)
    cls = type(model).__name__
    for s in todo:
        t1 = time.time()
        stage = "convert"
        row: dict[str, Any]
        signal.alarm(timeout)
        try:
            options = dict(dr.scheme(s).exact)
            conv = dr.convert(model, s, **options, inplace=False).eval()
            stage = "call"
            with torch.no_grad():
                out = _logits(conv(*args, **kwargs))
            if out is None:
                raise TypeError("the converted model's output has no logits tensor")
            mx, rel = _diff(out, ref)
            noise = _own_rounding(model, args, kwargs, ref) if rel > INIT_RTOL else 0.0
            if rel <= INIT_RTOL:
                row = {"status": "ok"}
            elif rel <= ROUNDING_FACTOR * noise:
                row = {"status": "ok", "max_rel": rel, "own_fp32_rounding": noise,
                       "note": f"past {INIT_RTOL:g}, within {ROUNDING_FACTOR}x the original's own fp32 rounding"}
            else:
                row = {"status": "MISMATCH", "max_abs": mx, "max_rel": rel,
                       "shapes": [list(out.shape), list(ref.shape)]}
            if deep:
                row = _deep_checks(conv, args, kwargs, row)
            del conv
        except _Timeout:
            row = {"status": "timeout", "stage": stage}
        except BaseException as e:  # noqa: BLE001
            if isinstance(e, KeyboardInterrupt):
                raise
            row = _classify(e, stage)
        finally:
            signal.alarm(0)
        row["seconds"] = round(time.time() - t1, 1)
        row["class"] = cls
        yield s, row


def _load(out: Path) -> dict[str, Any]:
    if out.exists():
        try:
            return json.loads(out.read_text())
        except json.JSONDecodeError:
            pass
    return {"rows": {}}


def _save(out: Path, data: dict[str, Any]) -> None:
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, out)


def summary(data: dict[str, Any], types: list[str] | None = None, schemes: list[str] | None = None) -> str:
    rows = data["rows"]
    keys = [k for k in rows if (types is None or k.split("/")[0] in types)
            and (schemes is None or k.split("/")[1] in schemes)]
    all_schemes = schemes or sorted({k.split("/")[1] for k in keys})
    lines = []
    counts = Counter(rows[k]["status"] for k in keys)
    lines.append("status per scheme:")
    statuses = ["ok", "refused", "UNTYPED", "MISMATCH", "not built", "timeout"]
    lines.append(f"{'scheme':<10}" + "".join(f"{st:>11}" for st in statuses))
    for s in all_schemes:
        c = Counter(rows[k]["status"] for k in keys if k.split("/")[1] == s)
        lines.append(f"{s:<10}" + "".join(f"{c.get(st, 0):>11}" for st in statuses))
    lines.append(f"{'total':<10}" + "".join(f"{counts.get(st, 0):>11}" for st in statuses))
    refusals = Counter(rows[k]["error"] for k in keys if rows[k]["status"] == "refused")
    if refusals:
        lines.append("typed refusals: " + ", ".join(f"{e} {n}" for e, n in refusals.most_common()))
    bad = [k for k in sorted(keys) if rows[k]["status"] in ("UNTYPED", "MISMATCH", "timeout")]
    if bad:
        lines.append("")
        lines.append("UNTYPED / MISMATCH / timeout rows:")
        for k in bad:
            r = rows[k]
            if r["status"] == "MISMATCH":
                lines.append(f"  {k:<40} MISMATCH max_abs={r['max_abs']:.3g} max_rel={r['max_rel']:.3g}")
            elif r["status"] == "timeout":
                lines.append(f"  {k:<40} timeout ({r.get('stage')})")
            else:
                lines.append(f"  {k:<40} UNTYPED [{r.get('stage')}] {r['error']}: {r['message'].splitlines()[0][:120]}")
                for f in r.get("frames", []):
                    lines.append(f"      {f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sweep", description=__doc__.split("\n")[0])
    ap.add_argument("--types", default=None, help="comma-separated model types (default: every causal-LM type)")
    ap.add_argument("--schemes", default=None, help="comma-separated schemes (default: every registered scheme)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="results JSON (default: bench/sweep_results.json)")
    ap.add_argument("--resume", action="store_true", help="skip rows already in --out")
    ap.add_argument("--layers", type=int, default=2, help="layers of each tiny model (default: 2)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per row before it is a timeout (default: 600)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default: 1; the machine is shared)")
    ap.add_argument("--deep", action="store_true", help="also a training step and generate on each conversion")
    ap.add_argument("--summary", action="store_true", help="only print the summary of --out")
    a = ap.parse_args(argv)

    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(a.threads)
    import depthrewrite as dr
    from tqdm import tqdm

    types = a.types.split(",") if a.types else all_types()
    schemes = a.schemes.split(",") if a.schemes else list(dr.schemes())
    out = Path(a.out)
    data = _load(out) if (a.resume or a.summary) else {"rows": {}}
    if a.summary:
        print(summary(data, types if a.types else None, schemes if a.schemes else None))
        return 0
    rows = data["rows"]
    # a type whose process died last time: its started marker is still there
    started = data.pop("started", None)
    if started and started in types:
        for s in schemes:
            rows.setdefault(f"{started}/{s}", {"status": "UNTYPED", "stage": "process", "error": "process died",
                                               "message": "the sweep process died on this type (segfault or kill)"})
    data["meta"] = {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                    "layers": a.layers, "rtol": INIT_RTOL, "deep": a.deep}
    _save(out, data)
    total = len(types) * len(schemes)
    bar = tqdm(total=total, initial=sum(f"{t}/{s}" in rows for t in types for s in schemes), dynamic_ncols=True,
               mininterval=1.0)
    signal.signal(signal.SIGALRM, _alarm)
    for t in types:
        done = {s for s in schemes if f"{t}/{s}" in rows}
        if len(done) == len(schemes):
            continue
        data["started"] = t
        _save(out, data)
        bar.set_description(t[:24])
        for s, row in sweep_type(t, schemes, a.layers, a.timeout, a.deep, done):
            rows[f"{t}/{s}"] = row
            _save(out, data)
            bar.update(1)
            if row["status"] in ("UNTYPED", "MISMATCH", "timeout"):
                tqdm.write(f"{t}/{s}: {row['status']} {row.get('error', '')} {str(row.get('message', ''))[:100]}")
        data.pop("started", None)
        _save(out, data)
    bar.close()
    print(summary(data, types, schemes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
