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


def example_framework(script: Path) -> str | None:
    """The training framework ``script`` imports, if any."""
    text = script.read_text()
    return next((fw for fw in FRAMEWORKS if re.search(rf"^(from|import) {fw}\b", text, re.MULTILINE)), None)


def framework_installed(fw: str) -> bool:
    return importlib.util.find_spec(fw) is not None


def import_example_framework(script: Path, fw: str) -> None:
    """Import the framework modules ``script`` imports under the test stand-ins (tests/frameworks/models.py: torchtune
    and OLMo-core import, at load, packages that building a model never uses and CI does not install); the script
    then runs unchanged, finding them imported."""
    from tests.frameworks.models import _stubbed

    with _stubbed(fw):
        for m in re.findall(rf"^(?:from|import) ({fw}[\w.]*)", script.read_text(), re.MULTILINE):
            importlib.import_module(m)


#: a framework example in a fresh interpreter: its framework's modules imported under the stand-ins, then the script
_RUN_STUBBED = """
import runpy, sys
from pathlib import Path
sys.path.insert(0, {root!r})
from tests.test_examples import import_example_framework
fw, script = sys.argv[1], sys.argv[2]
sys.argv = [script, *sys.argv[3:]]
import_example_framework(Path(script), fw)
runpy.run_path(script, run_name="__main__")
"""


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(script, tmp_path):
    cmd = [sys.executable, str(script)]
    if fw := example_framework(script):
        if not framework_installed(fw):
            pytest.skip(f"{fw} is not installed (pip install --no-deps, see pyproject's `frameworks` extra)")
        cmd = [sys.executable, "-c", _RUN_STUBBED.format(root=str(Path(__file__).parent.parent)), fw, str(script)]
    proc = subprocess.run([*cmd, "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip()
