"""The CLI: `depthrewrite inspect SPEC` and `depthrewrite convert` (the demo: tests/test_demo.py)."""

from __future__ import annotations

import pytest

from depthrewrite.cli import main


def test_inspect_hf_llama(capsys):
    """The foundation's 'done when': 4-layer Llama, 8 sublayers alternating, source = embedding, final = model.norm."""
    assert main(["inspect", "hf:llama"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("LlamaForCausalLM: 8 sublayers (4 attention, 4 mlp)")
    assert "stream source: `embedding` (model.embed_tokens)" in out
    assert "final norm:    model.norm" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[2] for r in rows] == ["attention", "mlp"] * 4
    assert [r[1] for r in rows][:2] == ["model.layers.0.self_attn", "model.layers.0.mlp"]


def test_inspect_resizes_and_prints_graph(capsys, tmp_path):
    dot = tmp_path / "c.dot"
    assert main(["inspect", "depthrewrite.testing:nanogpt", "--layers", "3", "--hidden", "32", "--graph", "--save", str(dot)]) == 0
    out = capsys.readouterr().out
    assert "GPT: 6 sublayers" in out and "hidden size 32" in out
    assert "<< residual add 5" in out and dot.exists()


def test_inspect_refusal_exits_2_with_message(capsys):
    assert main(["inspect", "hf:bert"]) == 2
    err = capsys.readouterr().err
    assert "NotPreNormError" in err and "PostNorm" in err


@pytest.mark.parametrize("spec", ["llama", "hf:not_a_model", "nosuchmodule:factory"])
def test_bad_spec(spec, capsys):
    assert main(["inspect", spec]) == 2
    assert "ConfigError" in capsys.readouterr().err


def test_convert_prints_the_site_report(capsys):
    assert main(["convert", "hf:llama", "--scheme", "attnres", "--blocks", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("LlamaForCausalLM -> Block AttnRes (S=2 sublayers per block)")
    assert "new parameters:" in out and "stored depth state per token: 5 x d=64" in out
    assert "output  model.norm" in out


def test_convert_bad_blocks_exits_2(capsys):
    assert main(["convert", "hf:llama", "--blocks", "0"]) == 2
    assert "blocks must be an integer >= 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, head",
    [
        (["--scheme", "msar"], "Qwen2ForCausalLM -> Full MSAR, m=4 streams (kernels 4/8/12, conv on kv, sigmoid mixer)"),
        (["--scheme", "msar", "--blocks", "2", "--streams", "3", "-o", "conv_on=k"], "Qwen2ForCausalLM -> Block MSAR (S=4"),
        (["--scheme", "mhc"], "Qwen2ForCausalLM -> mHC, n=4 streams, 20 Sinkhorn iterations, mean collapse"),
        (["--scheme", "mhc", "-o", "sinkhorn_iters=5", "--streams", "2"], "Qwen2ForCausalLM -> mHC, n=2 streams, 5 Sinkhorn"),
    ],
)
def test_convert_other_schemes(argv, head, capsys):
    assert main(["convert", "hf:qwen2", *argv]) == 0
    out = capsys.readouterr().out
    assert out.startswith(head) and "new parameters:" in out


def test_convert_bad_option_syntax(capsys):
    assert main(["convert", "hf:qwen2", "--scheme", "mhc", "-o", "nonsense"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err


@pytest.mark.parametrize("spec", ["hf:llama", "timm:vit_tiny_patch16_224"])
def test_convert_moda(spec, capsys):
    assert main(["convert", spec, "--scheme", "moda", "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "-> MoDA, attention + FFN kv_proj slots" in out and "transient depth KV per token" in out
