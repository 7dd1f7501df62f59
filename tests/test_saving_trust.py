"""from_pretrained() treats the recipe's ``original_class`` as untrusted: it imports only transformers' model classes,
or classes of a package the caller names in ``allowed_modules=``; any other module is refused before it is imported."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

import depthrewrite as dr
from depthrewrite.demo.zoo import hf_model
from depthrewrite.errors import ConfigError
from depthrewrite.testing import nanogpt

FLAG = "_depthrewrite_trust_test_imported"


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A module on sys.path that records being imported and provides a from_pretrained that records being called."""
    pkg = tmp_path / "plantedpkg_dr"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(textwrap.dedent(f"""
        import builtins, torch
        setattr(builtins, {FLAG!r}, True)
        from depthrewrite.testing import nanogpt

        class Model(torch.nn.Module):
            @classmethod
            def from_pretrained(cls, directory, **kw):
                setattr(builtins, {FLAG!r} + "_loader", True)
                return nanogpt(n_layer=2, n_embd=32)

        def factory():
            return None
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    import builtins

    for flag in (FLAG, FLAG + "_loader"):
        monkeypatch.delattr(builtins, flag, raising=False)
    yield "plantedpkg_dr.mod"
    for name in ("plantedpkg_dr.mod", "plantedpkg_dr"):
        sys.modules.pop(name, None)
    for flag in (FLAG, FLAG + "_loader"):
        if hasattr(builtins, flag):
            delattr(builtins, flag)


def _imported() -> bool:
    import builtins

    return bool(getattr(builtins, FLAG, False))


def _saved_nanogpt(directory):
    conv = dr.convert(nanogpt(n_layer=2, n_embd=32), "attnres")
    conv.save_pretrained(directory)
    return conv


def _set_class(directory, value) -> None:
    path = directory / "depthrewrite.json"
    recipe = json.loads(path.read_text())
    recipe["original_class"] = value
    path.write_text(json.dumps(recipe))


@pytest.mark.parametrize("name", ["plantedpkg_dr.mod:Model", "plantedpkg_dr.mod:factory"])
def test_a_recipe_naming_another_module_is_refused_before_import(planted, tmp_path, name):
    out = tmp_path / "ckpt"
    _saved_nanogpt(out)
    _set_class(out, name)
    with pytest.raises(ConfigError, match=r"model=.*allowed_modules"):
        dr.from_pretrained(out)
    assert not _imported(), "from_pretrained imported the module a checkpoint named"
    assert "plantedpkg_dr.mod" not in sys.modules


@pytest.mark.parametrize("name", [
    "transformers.models.llama.modeling_llama:LlamaConfig",  # in transformers, but not a PreTrainedModel
    "transformers.utils:os.system",                           # reaches another module through an attribute
    "transformers..x:Y", "transformers.models:_private", "no-colon", "", None, 42,
])
def test_malformed_or_non_model_transformers_names_are_refused(tmp_path, name):
    out = tmp_path / "ckpt"
    _saved_nanogpt(out)
    _set_class(out, name)
    with pytest.raises(ConfigError, match="model="):
        dr.from_pretrained(out)


def test_a_lookalike_prefix_is_not_transformers(planted, tmp_path):
    out = tmp_path / "ckpt"
    _saved_nanogpt(out)
    _set_class(out, "transformersx.mod:Model")
    with pytest.raises(ConfigError, match="transformers does not provide"):
        dr.from_pretrained(out)


def test_allowed_modules_is_the_explicit_opt_in(planted, tmp_path):
    out = tmp_path / "ckpt"
    _saved_nanogpt(out)
    _set_class(out, "plantedpkg_dr.mod:Model")
    with pytest.raises(ConfigError):  # a sibling package name does not allow it
        dr.from_pretrained(out, allowed_modules=("plantedpkg",))
    assert not _imported()
    back = dr.from_pretrained(out, allowed_modules=("plantedpkg_dr",))
    import builtins

    assert _imported() and getattr(builtins, FLAG + "_loader", False) and dr.is_converted(back)


def test_model_keyword_imports_nothing(planted, tmp_path):
    out = tmp_path / "ckpt"
    _saved_nanogpt(out)
    _set_class(out, "plantedpkg_dr.mod:Model")
    back = dr.from_pretrained(out, model=nanogpt(n_layer=2, n_embd=32))
    assert dr.is_converted(back) and not _imported()


def test_transformers_models_still_load(tmp_path):
    conv = dr.convert(hf_model("llama", layers=2).eval(), "attnres")
    conv.save_pretrained(tmp_path)
    recipe = json.loads((tmp_path / "depthrewrite.json").read_text())
    assert recipe["original_class"].startswith("transformers.")
    back = dr.from_pretrained(tmp_path)
    assert type(back).__name__ == "LlamaForCausalLM"
