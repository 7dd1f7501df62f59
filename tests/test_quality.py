"""`python -m bench.quality --quick`: the whole quality pipeline (every variant, report, plot) as a smoke test."""

from __future__ import annotations

from bench.quality import main


def test_quality_quick(tmp_path, capsys):
    out = tmp_path / "results.md"
    assert main(["--quick", "--out", str(out)]) == 0
    text = out.read_text()
    for label in ("Vanilla", "Full AttnRes", "Block AttnRes", "mHC", "Full MSAR", "Block MSAR", "MoDA"):
        assert f"| {label}" in text
    assert "Against the MSAR paper" in text and "1.898" in text
    assert (tmp_path / "results_quality.png").read_bytes()[:4] == b"\x89PNG"


def test_quality_bad_scheme_exits_2(tmp_path, capsys):
    assert main(["--quick", "--schemes", "vanilla,xyz", "--out", str(tmp_path / "r.md")]) == 2
    assert "unknown scheme" in capsys.readouterr().err
