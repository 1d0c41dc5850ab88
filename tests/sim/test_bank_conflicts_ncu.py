"""The simulator's shared-memory bank conflicts against Nsight Compute's counts measured on a GPU.

``docs/results/bank_conflicts_ncu.json`` holds, per config, what ncu measured for one launch
(``benchmarks/ncu_banks.py`` wrote it); the simulator's prediction for that launch must still
equal the hardware's numbers.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from flashgen.dsl import parse_config

ROOT = Path(__file__).resolve().parents[2]
MEASURED = json.loads((ROOT / "docs/results/bank_conflicts_ncu.json").read_text())


def _ncu_banks():
    spec = importlib.util.spec_from_file_location("ncu_banks", ROOT / "benchmarks/ncu_banks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("row", MEASURED, ids=[r["config"] for r in MEASURED])
def test_simulated_bank_conflicts_equal_nsight_computes(row):
    predicted = _ncu_banks().predict(parse_config(row["config"]))
    assert predicted == {key: int(value) for key, value in row["measured"].items()}
