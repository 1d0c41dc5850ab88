"""``flashgen.dsl``'s exports: every name resolves, and importing the package pulls neither torch nor the plans."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import flashgen.dsl as dsl

ROOT = Path(__file__).resolve().parents[2]


def _fresh_python(code: str) -> dict:
    """Run ``code`` in a new interpreter (this checkout first on the path); it prints one JSON value."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, cwd=ROOT)
    return json.loads(out.stdout)


@pytest.mark.parametrize("name", dsl.__all__)
def test_every_export_is_its_modules_object(name):
    value = getattr(dsl, name)
    home = importlib.import_module(getattr(value, "__module__", None) or "flashgen.dsl")
    assert home.__name__.startswith("flashgen.dsl.")
    assert getattr(home, name) is value


def test_star_import_gives_all_and_unknown_names_fail():
    space: dict = {}
    exec("from flashgen.dsl import *", space)
    assert set(dsl.__all__) <= set(space)
    with pytest.raises(AttributeError, match="Layuot"):
        dsl.Layuot  # noqa: B018
    with pytest.raises(ImportError):
        exec("from flashgen.dsl import Layuot", {})


def test_importing_the_package_pulls_neither_torch_nor_the_plans():
    seen = _fresh_python(
        "import json, sys; import flashgen.dsl; "
        "print(json.dumps([m for m in ('torch', 'flashgen.dsl.plan', 'flashgen.dsl.hopper_plan', "
        "'flashgen.dsl.notation') if m in sys.modules]))")
    assert seen == []


def test_using_every_export_pulls_no_torch():
    seen = _fresh_python("import json, sys; from flashgen.dsl import *; print(json.dumps('torch' in sys.modules))")
    assert seen is False
