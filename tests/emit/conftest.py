"""Fixtures of the emitter tests: memoized emission and PTX (both are pure functions of a config)."""
from __future__ import annotations

import pytest

from flashgen.check import ptx_text, source_of


@pytest.fixture(scope="session")
def source():
    """``source(cfg)`` -> KernelSource, emitted once per session (``flashgen.check.source_of``)."""
    return source_of


@pytest.fixture(scope="session")
def ptx(tmp_path_factory, nvcc):
    """``ptx(cfg, arch="sm_90a")`` -> the PTX text from ``nvcc -ptx`` (skips without nvcc)."""
    workdir = tmp_path_factory.mktemp("ptx")

    def get(cfg, arch="sm_90a"):
        return ptx_text(cfg, arch, workdir)

    return get
