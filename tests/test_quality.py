"""`python -m bench.quality --quick`: the whole quality pipeline (every variant, report, plot) as a smoke test."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile

import pytest

from bench import quality
from bench.quality import main


def test_quality_quick(tmp_path, capsys):
    out = tmp_path / "results.md"
    assert main(["--quick", "--out", str(out)]) == 0
    text = out.read_text()
    for label in ("Vanilla", "Full AttnRes", "Block AttnRes", "mHC", "Full MSAR", "Block MSAR", "MoDA"):
        assert f"| {label}" in text
    assert "Against the MSAR paper" in text and "1.898" in text
    assert "Load average (1 minute" in text and "shared with other jobs" not in text  # measured, not assumed
    assert (tmp_path / "results_quality.png").read_bytes()[:4] == b"\x89PNG"


def test_quality_bad_scheme_exits_2(tmp_path, capsys):
    assert main(["--quick", "--schemes", "vanilla,xyz", "--out", str(tmp_path / "r.md")]) == 2
    assert "unknown scheme" in capsys.readouterr().err


def test_load_text_reports_the_measured_load(monkeypatch):
    monkeypatch.setattr(quality.os, "cpu_count", lambda: 2)
    busy = quality._load_text((1.0, 3.5))
    assert "1.0 at the start and 3.5 at the end, on 2 core(s)" in busy and "more runnable processes than cores" in busy
    idle = quality._load_text((0.2, 0.9))
    assert "0.2 at the start" in idle and "more runnable" not in idle
    assert "not measured" in quality._load_text(None)
    assert "could not be read" in quality._load_text((float("nan"), float("nan")))


@pytest.mark.parametrize("saved", [False, True])
def test_parallel_workers_stopped_and_folder_handled_on_interrupt(tmp_path, monkeypatch, capsys, saved):
    """Ctrl-C in the parent terminates the seed workers; their folder is removed, or kept (and named) when it holds
    runs that --merge can still report."""
    folder = tmp_path / "work"
    folder.mkdir()
    started = []
    real_popen = subprocess.Popen

    def popen(cmd, *args, **kwargs):
        if saved:
            (folder / "seed0.json").write_text("[]")
        p = real_popen([sys.executable, "-c", "import time; time.sleep(60)"])
        started.append(p)
        return p

    real_sleep, calls = quality.time.sleep, []

    def interrupt(seconds):  # Ctrl-C in the parent's first wait (Popen.wait sleeps too: only the first call raises)
        calls.append(seconds)
        if len(calls) == 1:
            raise KeyboardInterrupt
        real_sleep(seconds)

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setattr(tempfile, "mkdtemp", lambda prefix="": str(folder))
    monkeypatch.setattr(quality.time, "sleep", interrupt)
    args = argparse.Namespace(seeds=2, jobs=2, schemes="vanilla")
    with pytest.raises(KeyboardInterrupt):
        quality._run_parallel(args, ["--jobs", "2"])
    assert len(started) == 2 and all(p.poll() is not None for p in started)  # terminated, and waited for
    if saved:
        assert (folder / "seed0.json").exists() and "--merge" in capsys.readouterr().err
    else:
        assert not folder.exists()
