"""The benchmark harness runs (timing, tables) without a GPU; the per-op case modules import everywhere.

No speed is asserted here: measurements live in bench/RESULTS.md."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from bench import kernels
from bench.kernel_cases import Case


def test_run_case_and_markdown_on_cpu():
    x = torch.randn(64, 64)
    case = Case(
        op="toy",
        shape="64x64",
        impls={"fused": lambda: x * 2, "reference": lambda: x + x, "compiled-reference": lambda: x.mul(2)},
        impls_bwd={"fused": lambda: x * 2},
        bytes=2 * x.numel() * 4,
    )
    rows = kernels.run_case(case, "cpu", copy_gbs=10.0, rep=3)
    assert [(r["direction"], r["impl"]) for r in rows] == [
        ("fwd", "fused"), ("fwd", "reference"), ("fwd", "compiled-reference"), ("fwd+bwd", "fused")
    ]
    assert all(r["ms"] > 0 and r["GB/s"] > 0 for r in rows if r["direction"] == "fwd")
    assert rows[0]["x fused"] == 1.0
    table = kernels.to_markdown(rows)
    assert table.startswith("| op | shape | direction | impl | ms |") and table.count("\n") == 6


def test_a_failing_impl_is_reported_not_raised():
    def boom():
        raise RuntimeError("out of memory\nmore")

    rows = kernels.run_case(Case(op="toy", shape="s", impls={"fused": boom, "compiled-reference": boom}), "cpu", 0.0, 1)
    assert rows[0]["error"] == "RuntimeError: out of memory" and rows[0]["ms"] is None


def test_without_a_gpu_nothing_is_measured(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert kernels.main([]) == 0
    assert "nothing measured" in capsys.readouterr().out


@pytest.mark.parametrize("op", kernels.OPS)
def test_case_modules_import(op):
    try:
        mod = importlib.import_module(f"bench.kernel_cases.{op}")
    except ModuleNotFoundError as e:
        if e.name == f"bench.kernel_cases.{op}":
            pytest.fail(f"bench/kernel_cases/{op}.py is missing")
        raise
    assert callable(mod.cases)


def test_whole_model_step_runs_every_scheme_on_cpu():
    rows = kernels.model_step_rows("cpu", torch.float32, rep=1, layers=2, hidden=64, tokens=32)
    assert [r["model"] for r in rows][0] == "vanilla" and len(rows) == 6
    assert all("error" not in r and r["ms"] > 0 for r in rows), rows


def test_module_calls_bench_runs_side_by_side_on_cpu():
    from bench import module_calls

    table = module_calls.rows(layers=2, hidden=32, schemes=["attnres"], prefixes=(4, 8), tokens=2, repeats=1,
                              conv_layers=2)
    assert [r[:2] for r in table] == [["vanilla", "-"], ["attnres", "module calls"], ["attnres", "inlined"],
                                      ["attnres", "ratio"]]
    # numbers, not their size: a per-token figure is a difference of two timings (t(n + 1 tokens) - t(1 token)), which
    # at 2 tokens and 1 repeat can come out at or below 0 on a busy machine; speed is measured in bench/, not asserted
    assert all(math.isfinite(float(x)) for r in table[1:3] for x in r[2:])


def test_generation_step_ab_restores_todays_setting():
    """``bench.generation --ab rows --per-step``: every model times its steps under each setting, and today's setting
    is in force afterwards."""
    from bench import generation
    from depthrewrite.converted import ConvertedGraphModule
    from depthrewrite.kernels.depth_attn import reference

    before = reference.SMALL_ROWS, ConvertedGraphModule.__getattr__
    rows = generation.step_rows(layers=2, hidden=32, prefix=4, steps=6, ab="rows", schemes=["attnres"])
    assert [r[0] for r in rows] == ["Full AttnRes", "Block AttnRes (4 blocks)"]
    assert all(float(x) > 0 for r in rows for x in r[1:4])
    assert (reference.SMALL_ROWS, ConvertedGraphModule.__getattr__) == before
