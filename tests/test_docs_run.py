"""Every ```python block of README.md and docs/*.md runs as written: the blocks of one file in order, in one fresh
namespace per file, in a scratch working directory (they write out/, chain.svg, ...).

A block that cannot run here (a fragment of a distributed program, it needs a GPU or a download) is marked on the line
before its fence::

    <!-- skip-test: why -->

A block that is a whole script to launch (a distributed training script) is marked with the command that runs it::

    <!-- run-test: torchrun --standalone --nproc-per-node 2 train.py aot_eager -->

The block is written to the file the command names (``train.py``, in the scratch directory) and the command runs
there in processes of its own (``torchrun`` is this interpreter's ``-m torch.distributed.run``, ``python`` this
interpreter); it must exit 0 within SCRIPT_TIMEOUT seconds. Such a block runs in its place in the page's order and
shares no namespace with the page's other blocks.

Pages whose blocks are fragments today (they use a ``model`` they never build) are listed in FRAGMENTS: they are
expected to fail, strictly, so making one runnable makes this test say to take it off the list."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP = re.compile(r"^<!--\s*skip-test\b.*-->\s*$")
SCRIPT = re.compile(r"^<!--\s*run-test:\s*(?P<cmd>.+?)\s*-->\s*$")
SCRIPT_TIMEOUT = 300

#: page -> why its blocks do not run as written yet (pages other sessions own; each needs a line building `model`, or
#: a skip-test marker / a ```text fence for pseudo-code)
FRAGMENTS: dict[str, str] = {}


def python_blocks(page: Path) -> list[tuple[int, str, bool | str]]:
    """``(line, code, how)`` per ```python block of ``page``, in order: ``how`` is False (run it in the page's
    namespace), True (skip-test) or a run-test command (a script to launch)."""
    blocks = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i + 1
            prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "").strip()
            j = start
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            script = SCRIPT.match(prev)
            how = script["cmd"] if script else bool(SKIP.match(prev))
            blocks.append((start + 1, "\n".join(lines[start:j]) + "\n", how))
            i = j
        i += 1
    return blocks


def script_argv(cmd: str) -> tuple[list[str], str]:
    """The argv a run-test command stands for, and the script file it names (the one ``.py`` argument)."""
    words = shlex.split(cmd)
    scripts = [w for w in words[1:] if w.endswith(".py")]
    if not words or words[0] not in ("torchrun", "python") or len(scripts) != 1:
        raise ValueError(f"run-test: expected `torchrun ... SCRIPT.py ...` or `python SCRIPT.py ...`, got {cmd!r}")
    head = [sys.executable, "-m", "torch.distributed.run"] if words[0] == "torchrun" else [sys.executable]
    return head + words[1:], scripts[0]


def run_script(cmd: str, code: str, where: str, cwd: Path) -> None:
    """Write ``code`` to the script ``cmd`` names, in ``cwd``, and run ``cmd`` there; AssertionError with the
    output's tail unless it exits 0 in time. Every process it starts is in a session of its own, ended with it."""
    argv, script = script_argv(cmd)
    (cwd / script).write_text(code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=SCRIPT_TIMEOUT)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{where}: `{cmd}` ran past {SCRIPT_TIMEOUT} s:\n{out[-4000:]}") from None
    finally:
        if proc.poll() is None:  # interrupted (KeyboardInterrupt)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode != 0:
        raise AssertionError(f"{where}: `{cmd}` exited {proc.returncode}:\n{out[-4000:]}")


RUNNABLE = [p for p in PAGES if any(how is not True for _, _, how in python_blocks(p))]


def test_the_block_parser():
    text = ("a\n<!-- skip-test: torchrun -->\n```python\nx = 1\n```\n\n```python\ny = 2\n```\n```bash\nz\n```\n"
            "<!-- run-test: torchrun --nproc-per-node 2 t.py a -->\n\n```python\nw = 3\n```\n")
    page = Path(__file__).parent / "_blocks_probe.md"
    try:
        page.write_text(text)
        assert python_blocks(page) == [(4, "x = 1\n", True), (8, "y = 2\n", False),
                                       (16, "w = 3\n", "torchrun --nproc-per-node 2 t.py a")]
    finally:
        page.unlink()
    argv, script = script_argv("torchrun --standalone --nproc-per-node 2 train.py aot_eager")
    assert argv == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    "train.py", "aot_eager"] and script == "train.py"
    assert script_argv("python t.py")[0] == [sys.executable, "t.py"]
    with pytest.raises(ValueError):
        script_argv("bash t.sh")


@pytest.mark.parametrize(
    "page",
    [pytest.param(p, marks=pytest.mark.xfail(strict=True, reason=FRAGMENTS[str(p.relative_to(ROOT))]))
     if str(p.relative_to(ROOT)) in FRAGMENTS else p for p in RUNNABLE],
    ids=[str(p.relative_to(ROOT)) for p in RUNNABLE],
)
def test_page_runs_as_written(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))  # a page may import tests.conftest
    torch.manual_seed(0)
    namespace: dict = {"__name__": "__doc_page__"}
    name = str(page.relative_to(ROOT))
    for line, code, how in python_blocks(page):
        if how is True:
            continue
        if how:
            run_script(how, code, f"{name}, the ```python block at line {line}", tmp_path)
            continue
        try:
            exec(compile(code, f"{name}:{line}", "exec"), namespace)
        except ImportError as e:
            if "depthrewrite" in str(e) or getattr(e, "name", None) in ("depthrewrite", "torch"):
                raise
            # an optional third-party package missing or broken in this environment (peft with an old torchao):
            # the blocks before ran; the rest of the page needs it
            pytest.skip(f"{name}, the ```python block at line {line} needs a package this environment lacks: {e}")
        except Exception as e:
            raise AssertionError(f"{name}, the ```python block at line {line}: {type(e).__name__}: {e}") from e
