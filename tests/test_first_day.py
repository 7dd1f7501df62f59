"""What a first day with depthrewrite runs into: explain() before the first call, save_rewritten's side files, the
CLI's options and messages, the examples' --help and output folders."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import depthrewrite as dr
from depthrewrite.demo.zoo import hf_model

ROOT = Path(__file__).parent.parent
IDS = torch.randint(0, 256, (2, 8))


@pytest.fixture(scope="module")
def conv():
    torch.manual_seed(0)
    return dr.convert(hf_model("llama", layers=2).eval(), "attnres", blocks=2)


# ---- explain() ----------------------------------------------------------------------------------------------------


def test_explain_before_the_first_call_says_not_compiled_yet_only(conv, fresh_backend):
    text = str(dr.explain(torch.compile(conv, backend="depthrewrite")))
    assert "not compiled yet" in text and "compiled with backend='depthrewrite'" not in text
    assert "depth_attn ×4" in text  # what the backend will do


def test_explain_names_the_original_class_and_the_block_size(conv):
    first = str(dr.explain(conv)).splitlines()[0]
    assert "LlamaForCausalLM" in first and "ConvertedLlamaForCausalLM" not in first
    assert "S=1 sublayers per block" in first or "S=2 sublayers per block" in first
    assert "S=None" not in first


def test_explain_after_a_call_says_compiled(conv, fresh_backend):
    compiled = torch.compile(conv, backend="depthrewrite", options={"inner": "eager"})
    with torch.no_grad():
        compiled(IDS)
    exp = dr.explain(compiled)
    text = str(exp)
    assert "compiled with backend='depthrewrite'" in text and "not compiled" not in text
    assert exp.graphs and not exp.pending


def test_explain_of_another_backend_says_which(conv, fresh_backend):
    text = str(dr.explain(torch.compile(conv, backend="eager")))
    assert "backend='eager', not 'depthrewrite'" in text and "not compiled yet" not in text


def test_the_report_describes_the_real_block_size(conv):
    r = conv.report()
    assert r.describe() == r.config.describe(r.block_size) and "S=None" not in r.describe()


# ---- save_rewritten -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".png", ".svg", ".dot", ".txt"])
def test_save_rewritten_writes_dot_and_txt_beside(conv, tmp_path, suffix):
    from depthrewrite.views.draw import save_rewritten

    path = save_rewritten(conv, tmp_path / f"attnres{suffix}")
    assert path == tmp_path / f"attnres{suffix}" and path.stat().st_size > 0
    assert (tmp_path / "attnres.dot").read_text().startswith('digraph "rewritten"')
    assert "depth_attn" in (tmp_path / "attnres.txt").read_text()


def test_save_rewritten_refuses_a_format_before_writing(conv, tmp_path):
    from depthrewrite.views.draw import save_rewritten

    with pytest.raises(dr.ConfigError, match="use .svg"):
        save_rewritten(conv, tmp_path / "g.jpg")
    assert not list(tmp_path.iterdir())


# ---- the CLI --------------------------------------------------------------------------------------------------------


def test_an_unknown_hf_type_is_a_short_message_with_close_names(capsys):
    from depthrewrite.cli import main

    assert main(["inspect", "hf:nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "unknown Hugging Face model type 'nonexistent'" in err and len(err) < 400
    assert main(["convert", "hf:lama", "--scheme", "attnres"]) == 2
    err = capsys.readouterr().err
    assert "did you mean llama" in err and len(err) < 400


def test_full_graph_implies_graph(capsys):
    from depthrewrite.cli import main

    assert main(["inspect", "hf:llama", "--layers", "1"]) == 0
    plain = capsys.readouterr().out
    assert main(["inspect", "hf:llama", "--layers", "1", "--full-graph"]) == 0
    full = capsys.readouterr().out
    assert "<< final norm" not in plain and "<< final norm" in full
    assert main(["inspect", "hf:llama", "--layers", "1", "--graph"]) == 0
    chain_only = capsys.readouterr().out
    assert len(full.splitlines()) > len(chain_only.splitlines())


def _bash_ok(line: str) -> bool:
    return subprocess.run(["bash", "-n", "-c", line], capture_output=True).returncode == 0


def test_every_o_example_is_valid_shell():
    import re

    from depthrewrite.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    help_text = " ".join(sub.choices["convert"].format_help().split())
    assert "-o 'kernel_sizes=(4,8,12)'" in help_text
    examples = re.findall(r"-o ('[^']*'|\S+)", help_text)
    docs = (ROOT / "docs" / "cli.md").read_text()
    examples += re.findall(r"`-o ([^`]+)`", docs)
    assert len(examples) >= 6
    for e in examples:
        assert _bash_ok(f"depthrewrite convert hf:llama -o {e}"), e
    assert not _bash_ok("depthrewrite convert hf:llama -o kernel_sizes=(4,8,12)")  # what the docs said before


# ---- the examples' --help -----------------------------------------------------------------------------------------

EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
from tests.test_examples import example_framework, framework_installed, import_example_framework  # noqa: E402


@pytest.fixture(scope="module")
def example_help():
    """``--help`` of every example, run in this process as ``__main__`` (argparse exits before any work)."""
    import contextlib
    import io
    import os
    import runpy

    out = {}
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "200"
    try:
        for path in EXAMPLES:
            fw = example_framework(path)
            if fw is not None and not framework_installed(fw):
                continue  # a training framework's example: CI installs the framework (tests/test_examples.py)
            buf = io.StringIO()
            argv, sys.argv = sys.argv, [str(path), "--help"]
            try:
                if fw is not None:
                    import_example_framework(path, fw)  # under the test stand-ins, as tests/test_examples.py runs it
                with contextlib.redirect_stdout(buf), pytest.raises(SystemExit) as stop:
                    runpy.run_path(str(path), run_name="__main__")
            finally:
                sys.argv = argv
            assert stop.value.code in (0, None), path.stem
            out[path.stem] = buf.getvalue()
    finally:
        if old is None:
            os.environ.pop("COLUMNS")
        else:
            os.environ["COLUMNS"] = old
    return out


def _option_entries(text: str) -> dict[str, str]:
    """``--help``'s options section: option name -> its line and the more indented lines under it, joined."""
    import re

    entries: dict[str, str] = {}
    last = None
    for line in text.split("options:", 1)[1].splitlines():
        m = re.match(r"  (-[-\w]+)", line)
        if m:
            last = m.group(1)
            entries[last] = line.strip()
        elif line.startswith("   ") and last is not None:
            entries[last] += " " + line.strip()
    return entries


def test_every_example_help_has_a_description_and_defaults(example_help):
    import ast

    for path in EXAMPLES:
        if path.stem not in example_help:  # a framework's example, the framework not installed
            continue
        text = example_help[path.stem]
        first = ast.get_docstring(ast.parse(path.read_text())).splitlines()[0]
        assert first in text, path.stem
        options = {k: v for k, v in _option_entries(text).items() if k != "-h"}
        assert options, path.stem
        for entry in options.values():  # every option has a help string (which carries its default)
            assert "(default:" in entry, (path.stem, entry)


def test_examples_write_into_folders_of_their_own(example_help):
    import re

    outs = {}
    for name, text in example_help.items():
        m = re.search(r"\(default: ([^)]+)\)$", _option_entries(text).get("--out", ""))
        if m and m.group(1) != "None":
            outs[name] = m.group(1)
    assert len(outs) >= 5, outs
    assert not any("depthrewrite-demo" in o for o in outs.values()), outs
    assert len(set(outs.values())) == len(outs), outs


# ---- refusals raised in api.py (owned elsewhere) --------------------------------------------------------------------


def test_the_already_converted_refusal_names_the_real_block_size(conv):
    with pytest.raises(dr.ConfigError, match="already converted") as err:
        dr.convert(conv, "attnres", blocks=2, pipeline_stages=2)
    assert "S=None" not in str(err.value) and conv.report().describe() in str(err.value)


def test_converting_a_non_module_is_a_config_error():
    with pytest.raises(dr.ConfigError, match="nn.Module"):
        dr.convert(42, "attnres")
