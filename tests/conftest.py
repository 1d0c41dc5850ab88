"""Shared test setup: ``gpu`` and ``nvcc`` markers skip, with a stated reason, where they cannot run.

* ``@pytest.mark.gpu`` tests are skipped when ``torch.cuda.is_available()`` is false
  (torch is imported only if such a test was collected).
* ``@pytest.mark.nvcc`` tests are skipped when no nvcc is found (``flashgen.toolchain.find_nvcc``:
  ``$FLASHGEN_NVCC``, PATH, ``$CUDA_HOME/bin``); tests that need the compiler's path
  take the ``nvcc`` fixture, which skips the same way.
* Test modules that declare slow builds (``background_builds``, see ``tests/background.py``) run
  last, and their builds start in a worker process as soon as collection ends: they overlap with
  every test before them. The ``background`` fixture hands a module its builds' results.
"""
from __future__ import annotations

import os
import shutil
import sys

import pytest

from background import HOOK, Background

_BACKGROUND = pytest.StashKey[Background]()

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
    # stable: the modules keep their order among themselves, and a module's tests stay together
    items.sort(key=lambda item: hasattr(getattr(item, "module", None), HOOK))
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


def _modules(items) -> list:
    return list(dict.fromkeys(m for m in (getattr(item, "module", None) for item in items) if m is not None))


def pytest_collection_finish(session):
    config = session.config
    # the folder maker of the tmp_path_factory fixture (which cannot be requested before a test runs)
    bg = Background(config._tmp_path_factory.mktemp)
    config.stash[_BACKGROUND] = bg
    if config.option.collectonly or session.testsfailed:  # nothing will run (a failed collection stops the run)
        return
    for module in _modules(session.items):
        bg.declare(module, start=True)
    if bg.started:
        _leave_cpus_to(bg.jobs)


def _leave_cpus_to(workers: int) -> None:
    """Torch's threads (here and in the processes the tests start) take only the CPUs the build workers
    leave: two OpenMP threads on one free CPU spin at each barrier (a 5 s training took 25 s)."""
    threads = max(1, (os.cpu_count() or 1) - workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)


def pytest_sessionfinish(session):
    bg = session.config.stash.get(_BACKGROUND, None)
    if bg is not None:
        bg.stop()


@pytest.fixture(scope="session")
def background(request) -> Background:
    """The session's builds (``tests/background.py``): ``background.result(module, key)``."""
    return request.config.stash[_BACKGROUND]
