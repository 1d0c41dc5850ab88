"""tests/mods: the example mods of examples/mods.py, loaded by path (examples/ is no package)."""
from __future__ import annotations

import importlib.util
import pathlib

import pytest

EXAMPLES_PATH = pathlib.Path(__file__).resolve().parents[2] / "examples" / "mods.py"


@pytest.fixture(scope="session")
def examples():
    spec = importlib.util.spec_from_file_location("flashgen_example_mods", EXAMPLES_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
