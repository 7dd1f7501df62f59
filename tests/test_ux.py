"""Small things a user hit (issue #12, item 6): specs in the Python API, factories in the current folder, timm image
sizes, scheme-name aliases and case, and the top-level --help text."""

from __future__ import annotations

import sys

import pytest

import depthrewrite as dr
from depthrewrite.capture import example_inputs_for
from depthrewrite.cli import main
from depthrewrite.testing import nanogpt
from depthrewrite.passes.rewrite import scheme_config
from depthrewrite.demo.zoo import build, timm_model


# -- 1. the Python API takes the CLI's model specs ------------------------------------------------------------------
def test_inspect_takes_a_spec():
    report = dr.inspect("hf:llama")
    assert report.model_class == "LlamaForCausalLM" and report.num_sublayers == 8


def test_convert_takes_a_spec():
    converted = dr.convert("depthrewrite.testing:nanogpt", "attnres")
    assert converted.report().model_class == "GPT"


def test_convert_takes_a_timm_spec():
    pytest.importorskip("timm")
    converted = dr.convert("timm:vit_tiny_patch16_224", "attnres", blocks=4)
    report = converted.report()
    assert report.model_class == "VisionTransformer" and len(report.chain.sublayers) == 24


def test_bad_spec_in_the_api_is_a_config_error():
    with pytest.raises(dr.ConfigError, match="must look like"):
        dr.inspect("llama")


# -- 2. module:factory finds a module in the current folder, as python -m does --------------------------------------
def test_factory_in_the_current_folder(tmp_path, monkeypatch, capsys):
    (tmp_path / "myfactories_ux.py").write_text(
        "from depthrewrite.testing import nanogpt\n\ndef build(n_layer=2):\n    return nanogpt(n_layer=n_layer)\n"
    )
    monkeypatch.chdir(tmp_path)
    # as under the `depthrewrite` console script: neither '' nor the current folder on sys.path
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "myfactories_ux", raising=False)
    assert main(["inspect", "myfactories_ux:build", "--layers", "1"]) == 0
    assert capsys.readouterr().out.startswith("GPT: 2 sublayers")
    assert str(tmp_path) not in sys.path  # only while importing and calling the factory
    model = build("myfactories_ux:build", layers=3)
    assert len(model.transformer.h) == 3


# -- 3. timm example inputs follow the size the model was built for -------------------------------------------------
def test_timm_vit_with_its_own_img_size():
    pytest.importorskip("timm")
    model = timm_model("vit_tiny_patch16_224", layers=2, img_size=32)
    (x,), _ = example_inputs_for(model)
    assert tuple(x.shape) == (2, 3, 32, 32)
    assert dr.inspect(model).num_sublayers == 4


def test_timm_vit_other_channels_and_rectangular():
    pytest.importorskip("timm")
    model = timm_model("vit_tiny_patch16_224", layers=1, img_size=(32, 48), in_chans=1)
    (x,), _ = example_inputs_for(model)
    assert tuple(x.shape) == (2, 1, 32, 48)


# -- 4. scheme names: block-* aliases and any case ------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, expected",
    [
        ("block-attnres", dr.AttnResConfig(blocks=4)),
        ("Block-AttnRes", dr.AttnResConfig(blocks=4)),
        ("block_attnres", dr.AttnResConfig(blocks=4)),
        ("block-msar", dr.MSARConfig(blocks=4)),
        ("AttnRes", dr.AttnResConfig()),
        ("MSAR", dr.MSARConfig()),
        ("mHC", dr.MHCConfig()),
        ("MoDA", dr.MoDAConfig()),
    ],
)
def test_scheme_names(name, expected):
    assert scheme_config(name) == expected


def test_alias_defaults_yield_to_explicit_options():
    assert scheme_config("block-attnres", blocks=2) == dr.AttnResConfig(blocks=2)
    assert scheme_config("block-attnres", block_size=3) == dr.AttnResConfig(block_size=3)
    assert scheme_config("Block-MSAR", streams=2, blocks=8) == dr.MSARConfig(streams=2, blocks=8)


def test_unknown_scheme_lists_the_aliases():
    with pytest.raises(dr.ConfigError, match="block-attnres"):
        scheme_config("attn-res")


def test_convert_with_an_alias_matches_the_demo_variant():
    from depthrewrite.demo.train import VARIANTS

    v = VARIANTS["block-attnres"]
    assert scheme_config("block-attnres") == scheme_config(v.scheme, **v.options)
    converted = dr.convert(nanogpt(n_layer=4), "Block-AttnRes")
    assert converted.report().block_size == 2


@pytest.mark.parametrize("scheme, head", [("Block-AttnRes", "-> Block AttnRes (S=2"), ("block-msar", "-> Block MSAR (S=2"),
                                          ("MHC", "-> mHC, n=4")])
def test_cli_scheme_aliases_and_case(scheme, head, capsys):
    assert main(["convert", "depthrewrite.testing:nanogpt", "--layers", "4", "--scheme", scheme]) == 0
    assert head in capsys.readouterr().out.splitlines()[0]


# -- 5. --help shows a description for users ------------------------------------------------------------------------
def test_top_level_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "Nothing else lives here" not in out and "lives here" not in out
    assert "depth-mixing" in out and "block-attnres" in out
