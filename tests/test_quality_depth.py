"""`python -m bench.quality --preset depth`: runs kept one file each, resumed, and the page section made from them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import quality, quality_depth
from bench.quality_depth import MARKER, PRESET, planned, section, write_page


def test_depth_quick_trains_compiled_keeps_each_run_and_resumes(tmp_path, capsys):
    folder, page = tmp_path / "runs", tmp_path / "results.md"
    page.write_text("# Results: quality at small scale\n\nthe small study\n")
    argv = ["--preset", "depth", "--quick", "--dir", str(folder), "--page", str(page), "--only", "vanilla,attnres"]
    assert quality.main(argv + ["--jobs", "2"]) == 0
    files = sorted(p.name for p in folder.glob("*.json"))
    assert files == ["attnres-s0.json", "vanilla-s0.json"]
    rec = json.loads((folder / "attnres-s0.json").read_text())
    assert rec["init_error"] < 1e-5 and len(rec["step_times"]) == rec["config"]["steps"]
    assert rec["saved_bytes"] > 0 and rec["first_step"] > rec["step_time"]  # the first step compiled
    text = page.read_text()
    assert text.startswith("# Results: quality at small scale\n\nthe small study\n")  # the small study is kept
    assert MARKER in text and "**Incomplete:** 2 of 10 runs" in text
    assert "| Vanilla (PreNorm residual) | 1 |" in text and "| Full AttnRes | 1 |" in text
    assert (tmp_path / "results_depth.png").read_bytes()[:4] == b"\x89PNG"
    mtimes = {p: p.stat().st_mtime_ns for p in folder.glob("*.json")}
    capsys.readouterr()
    assert quality.main(argv) == 0  # resumed: nothing left to run among these
    out = capsys.readouterr().out
    assert "2 of 10 run(s) on disk" in out and "0 to run now" in out
    assert {p: p.stat().st_mtime_ns for p in folder.glob("*.json")} == mtimes
    assert text.count(MARKER) == 1 and page.read_text().count(MARKER) == 1


def _record(name: str, seed: int, val: float, **kw) -> dict:
    rec = dict(name=name, variant=name, options={}, seed=seed, config=PRESET, label=name.upper(), new_params=10,
               model_params=1000, init_error=None if name == "vanilla" else 1e-7, tokens=1_024_000,
               train_losses=[3.0, 2.0], val_points=[[100, val + 0.5], [500, val]], step_times=[30.0, 1.0, 1.0],
               step_time=1.0, first_step=30.0, saved_bytes=2**20, peak_rss=2**30, started=0.0, finished=3600.0,
               threads=1, jobs=2, torch="2.x", cpu="x86_64", cores=2, load=[1.0, 1.0, 1.0])
    rec.update(kw)
    return rec


def test_section_pairs_by_seed_counts_signs_and_puts_the_papers_beside():
    runs = {
        "vanilla": [_record("vanilla", s, v) for s, v in enumerate((2.0, 2.1, 2.2))],
        "attnres": [_record("attnres", s, v) for s, v in enumerate((1.9, 2.0, 2.3))],
        "msar": [_record("msar", s, v, step_times=[90.0, 3.0, 3.0], saved_bytes=2**21) for s, v in enumerate((1.8, 1.9, 2.0))],
        "block-attnres-n2": [_record("block-attnres-n2", 0, 1.95)],
    }
    text = section(runs, PRESET, "p.png")
    assert "**Incomplete:** 10 of 26 runs" in text
    assert "| -0.0333 ± 0.1155 (2/3 lower) |" in text  # attnres: −0.1, −0.1, +0.1
    assert "-0.2000 ± 0.0000 (3/3 lower)" in text  # msar: lower in every seed
    assert "3000 (3.00×)" in text and "2.0 (2.00×)" in text  # step time and activations against vanilla
    assert "| 1.898 | 1.867 | 1.847 |" in text  # the MSAR paper's ablation beside ours
    assert "Ordering, best first — paper: msar < attnres < vanilla; here: msar < attnres < vanilla (the same)." in text
    assert "| N = 2 | 12 | 1.9500 | -0.0500 |" in text  # S = 24 / 2
    assert "| Full (every sublayer) | 1 | 1.9000 | -0.1000 |" in text and "S = 1: 1.737" in text
    assert "Wall time of all runs together: 1.00 h" in text  # overlapping runs count once


def test_loss_rises_are_named_on_the_page():
    """A run whose smoothed training loss climbs back up by more than RISE_NATS is named with where and how far; the
    others' largest rise is stated. Steps are the smoothing windows' centres."""
    flat = [3.0 - 0.001 * i for i in range(200)]
    bump = flat[:100] + [flat[99] + 0.3] * 50 + flat[150:]
    assert quality_depth.loss_rise({"train_losses": flat})[0] == 0.0
    rise, s0, low, s1, peak = quality_depth.loss_rise({"train_losses": bump})
    assert abs(rise - 0.3) < 0.03 and s0 < 100 < s1 <= 150 and peak > low
    runs = {"vanilla": [_record("vanilla", 0, 2.0, train_losses=flat)],
            "moda": [_record("moda", 1, 2.0, train_losses=bump)]}
    text = section(runs, PRESET, "p.png")
    assert "**Loss rises.**" in text and "MODA, seed 1: " in text and "In every other run the largest such rise is 0.000" in text
    assert "none (the largest rise is 0.000)" in section({"vanilla": runs["vanilla"]}, PRESET, "p.png")


def test_step_time_is_the_least_contended_window():
    """Runs share the machine: a stretch slowed 2x by other work does not set the step time."""
    steps = [40.0] * 20 + [2.0] * 50 + [1.0] * 50 + [2.0] * 30
    assert quality_depth.step_time({"step_times": steps}) == 1.0
    assert quality_depth.step_time({"step_times": [9.0, 1.0, 1.0]}) == 1.0  # shorter than the warm-up: every step


def test_a_run_of_another_configuration_is_refused(tmp_path, capsys):
    (tmp_path / "vanilla-s0.json").write_text(json.dumps(_record("vanilla", 0, 2.0, config={**PRESET, "lr": 1.0})))
    assert quality_depth.main(["--report", "--dir", str(tmp_path), "--page", str(tmp_path / "r.md")]) == 2
    err = capsys.readouterr().err
    assert "vanilla-s0.json was made with another configuration" in err and "move the folder away" in err


def test_a_stray_file_is_named(tmp_path, capsys):
    (tmp_path / "notes.json").write_text("[1, 2]")
    assert quality_depth.main(["--report", "--dir", str(tmp_path), "--page", str(tmp_path / "r.md")]) == 2
    assert "notes.json is not a run of the depth study" in capsys.readouterr().err


def test_write_page_replaces_only_its_own_section(tmp_path):
    page = tmp_path / "results.md"
    page.write_text("# small\n\nbody\n\n" + MARKER + "\n\nold depth section\n")
    (tmp_path / "runs").mkdir()
    write_page(tmp_path / "runs", PRESET, page)
    text = page.read_text()
    assert text.startswith("# small\n\nbody\n\n" + MARKER) and "old depth section" not in text
    assert "No run of the depth study has finished yet." in text


def test_plan_is_seed_by_seed_then_the_block_axis():
    runs = planned(PRESET)
    assert len(runs) == 3 * 8 + 2 and [r.name for r in runs[:2]] == ["vanilla", "attnres"]
    assert {r.name for r in runs[-2:]} == {"block-attnres-n2", "block-attnres-n8"} and runs[-1].options == {"blocks": 8}


def test_interrupt_stops_the_workers(tmp_path, monkeypatch):
    started = []
    real_popen = subprocess.Popen

    def popen(cmd, *args, **kwargs):
        p = real_popen([sys.executable, "-c", "import time; time.sleep(60)"])
        started.append(p)
        return p

    real_sleep, calls = quality_depth.time.sleep, []

    def interrupt(seconds):  # Ctrl-C in the first wait only (Popen.wait sleeps too)
        calls.append(seconds)
        if len(calls) == 1:
            raise KeyboardInterrupt
        real_sleep(seconds)

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setattr(quality_depth.time, "sleep", interrupt)
    with pytest.raises(KeyboardInterrupt):
        quality_depth.run_missing(tmp_path, PRESET, 2, 1, False, None, None)
    assert len(started) == 2 and all(p.poll() is not None for p in started)
    assert not list(tmp_path.glob("*.json"))  # nothing half-written: those runs start again next time
