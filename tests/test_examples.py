"""Every script in examples/ runs (they are also what docs/ shows)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))
#: the training frameworks an example may build its model with (installed by .ci/run, not by the README's command)
FRAMEWORKS = ("litgpt", "torchtitan", "torchtune", "olmo_core")


def _missing_framework(script: Path) -> str | None:
    text = script.read_text()
    for fw in FRAMEWORKS:
        if re.search(rf"^(from|import) {fw}\b", text, re.M) and importlib.util.find_spec(fw) is None:
            return fw
    return None


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(script, tmp_path):
    if fw := _missing_framework(script):
        pytest.skip(f"{fw} is not installed (pip install --no-deps, see pyproject's `frameworks` extra)")
    proc = subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip()
