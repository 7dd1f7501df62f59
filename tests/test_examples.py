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


#: runs an example whose framework needs the test stand-ins (tests/frameworks/models.py: torchtune and OLMo-core
#: import packages at load that building a model never uses and CI does not install): the framework modules the
#: example imports are imported under the stand-ins first, then the script runs unchanged
_RUN_STUBBED = """
import importlib, re, runpy, sys
sys.path.insert(0, {root!r})
from tests.frameworks import models
fw, script = sys.argv[1], sys.argv[2]
sys.argv = [script, *sys.argv[3:]]
with models._stubbed(fw):
    for m in re.findall(rf"^(?:from|import) ({{fw}}[\\w.]*)", open(script).read(), re.M):
        importlib.import_module(m)
runpy.run_path(script, run_name="__main__")
"""


def _framework(script: Path) -> str | None:
    text = script.read_text()
    return next((fw for fw in FRAMEWORKS if re.search(rf"^(from|import) {fw}\b", text, re.M)), None)


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(script, tmp_path):
    cmd = [sys.executable, str(script)]
    if fw := _framework(script):
        if importlib.util.find_spec(fw) is None:
            pytest.skip(f"{fw} is not installed (pip install --no-deps, see pyproject's `frameworks` extra)")
        cmd = [sys.executable, "-c", _RUN_STUBBED.format(root=str(Path(__file__).parent.parent)), fw, str(script)]
    proc = subprocess.run([*cmd, "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip()
