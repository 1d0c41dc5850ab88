"""Shared test setup: ``gpu`` and ``nvcc`` markers skip, with a stated reason, where they cannot run.

* ``@pytest.mark.gpu`` tests are skipped when ``torch.cuda.is_available()`` is false
  (torch is imported only if such a test was collected).
* ``@pytest.mark.nvcc`` tests are skipped when no nvcc is found (``flashgen.toolchain.find_nvcc``:
  ``$FLASHGEN_NVCC``, PATH, ``$CUDA_HOME/bin``); tests that need the compiler's path
  take the ``nvcc`` fixture, which skips the same way.
"""
from __future__ import annotations

import shutil

import pytest

GPU_REASON = "needs a CUDA GPU"
NVCC_REASON = "nvcc not found on PATH"


def _find_nvcc() -> str | None:
    try:
        from flashgen.toolchain import find_nvcc
    except Exception:  # a broken import must not hide every test behind a conftest error
        return shutil.which("nvcc")
    return find_nvcc()


NVCC = _find_nvcc()


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items and not _cuda_available():
        skip = pytest.mark.skip(reason=GPU_REASON)
        for item in gpu_items:
            item.add_marker(skip)
    if NVCC is None:
        skip = pytest.mark.skip(reason=NVCC_REASON)
        for item in items:
            if item.get_closest_marker("nvcc"):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def nvcc() -> str:
    """The nvcc executable; skips the test when there is none."""
    if NVCC is None:
        pytest.skip(NVCC_REASON)
    return NVCC
