"""tests/sim: ``@pytest.mark.slow`` tests run only with ``FLASHGEN_SLOW=1`` (or ``-m slow``).

The default run of tests/sim stays within about two minutes on a 2-core machine,
Numba compilation included.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if os.environ.get("FLASHGEN_SLOW") == "1" or "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow simulator test: set FLASHGEN_SLOW=1 (or select it with -m slow)")
    for item in items:
        if item.get_closest_marker("slow") and HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)
