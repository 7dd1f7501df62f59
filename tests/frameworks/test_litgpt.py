"""Every scheme converts litgpt 0.5.13: GPT(Config.from_name(...)) for Pythia, Phi-2, Llama-3.2 and Gemma-2, exact at init, and trains one step (tests/frameworks/contract.py)."""

from __future__ import annotations

import importlib.util

import pytest

from .contract import SCHEMES, check_init, check_training_step
from .models import cases

FRAMEWORK = "litgpt"
pytestmark = pytest.mark.skipif(importlib.util.find_spec(FRAMEWORK) is None, reason=f"{FRAMEWORK} is not installed")


@pytest.mark.parametrize("scheme, options, tol", SCHEMES)
@pytest.mark.parametrize("name", cases(FRAMEWORK))
def test_exact_at_init(name, scheme, options, tol):
    check_init(FRAMEWORK, name, scheme, options, tol)


@pytest.mark.parametrize("scheme, options, tol", SCHEMES)
@pytest.mark.parametrize("name", cases(FRAMEWORK))
def test_training_step(name, scheme, options, tol):
    check_training_step(FRAMEWORK, name, scheme, options)
