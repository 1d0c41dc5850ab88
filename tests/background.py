"""Slow builds (nvcc, g++, the launcher) started when collection ends, in a worker process, so that
they run beside the tests that need no compiler; a module's fixture then takes its build's result.

A test module declares its builds with a top-level function ``background_builds(folder) ->
{key: build}``: each build is a picklable call without arguments (``functools.partial`` of a
top-level function, e.g. ``subprocess.run`` or ``flashgen.check.check_configs``) that writes only
under ``folder``, a fresh folder of its own. The conftest runs the modules that declare builds
last, and submits their builds in that order to :class:`Background`; a fixture calls
``background.result(module, key)``. A build that no worker has started by then runs in the test
process instead, beside the worker (so the last builds use both CPUs). The workers are
:mod:`flashgen.workers`' processes: they ignore Ctrl-C, and :meth:`Background.stop`, run when the
session ends or is interrupted, ends them with whatever they started.
"""
from __future__ import annotations

import concurrent.futures as cf
import functools
import os
import subprocess
from pathlib import Path
from typing import Any, Callable

from flashgen import workers

#: the module-level function a test module declares its builds with
HOOK = "background_builds"


def worker_count() -> int:
    """One CPU stays with the tests themselves."""
    return max(1, (os.cpu_count() or 1) - 1)


class Background:
    """The builds of the session's modules, keyed by (module name, build key)."""

    def __init__(self, make_folder: Callable[[str], Path], jobs: int | None = None) -> None:
        self._make_folder = make_folder
        self.jobs = worker_count() if jobs is None else jobs
        self._pool: cf.ProcessPoolExecutor | None = None
        self._builds: dict[tuple[str, str], Callable[[], Any]] = {}
        self._futures: dict[tuple[str, str], cf.Future] = {}
        self._folders: dict[str, Path] = {}

    def declare(self, module: Any, start: bool) -> None:
        """Record ``module``'s builds (none when it declares none); ``start`` submits them to the workers."""
        hook = getattr(module, HOOK, None)
        if hook is None:
            return
        folder = self._folders[module.__name__] = self._make_folder(module.__name__)
        for key, build in hook(folder).items():
            self._builds[(module.__name__, key)] = build
            if start and self.jobs > 0:
                if self._pool is None:
                    self._pool = workers.process_pool(self.jobs)
                self._futures[(module.__name__, key)] = workers.submit(self._pool, build)

    @property
    def started(self) -> bool:
        """Whether a worker was given a build."""
        return self._pool is not None

    def folder(self, module: Any) -> Path:
        """The folder ``module``'s builds write under."""
        if module.__name__ not in self._folders:
            self.declare(module, start=False)
        return self._folders[module.__name__]

    def result(self, module: Any, key: str) -> Any:
        """The result of ``module``'s build ``key``: awaited when a worker runs it, else computed here."""
        name = module.__name__
        if (name, key) not in self._builds:
            self.declare(module, start=False)
        fut = self._futures.pop((name, key), None)
        if fut is None or fut.cancel():
            return self._builds[(name, key)]()
        return fut.result()

    def stop(self) -> None:
        """End the workers at once; builds not taken are dropped."""
        if self._pool is not None:
            workers.stop_pool(self._pool)
            self._pool = None
        self._futures.clear()


def cubin_build(folder: Path, key: str, text: str, arch: str, nvcc: str) -> Callable[[], subprocess.CompletedProcess]:
    """A build for ``background_builds``: kernel source ``text`` written to ``folder/key/k.cu`` and compiled for ``arch``,
    device code only (``nvcc -cubin -Xptxas -v``: the completed process's output holds ptxas's statistics)."""
    from flashgen.check import compile_command

    sub = folder / key
    sub.mkdir()
    (sub / "k.cu").write_text(text)
    argv = compile_command(nvcc, sub / "k.cu", arch, sub / "k.cubin", device_only=True)
    return functools.partial(subprocess.run, argv, capture_output=True, text=True)


def config_checks(configs, archs) -> Callable[[Path], dict]:
    """A module's ``background_builds`` (assign it at module level): ``flashgen check`` of each config alone for
    ``archs``, uncached, keyed by the config's mangled name; no builds without nvcc. :func:`check_results` reads them."""
    def background_builds(folder: Path) -> dict:
        from flashgen.check import check_configs
        from flashgen.toolchain import find_nvcc

        if find_nvcc() is None:
            return {}
        return {cfg.mangle(): functools.partial(check_configs, [cfg], tuple(archs), jobs=1, workdir=folder, use_cache=False)
                for cfg in configs}
    return background_builds


def check_results(background: "Background", module: Any, configs) -> dict:
    """{(config, arch): its :class:`flashgen.check.CheckResult`} of the builds of :func:`config_checks`."""
    return {(r.cfg, r.arch): r for cfg in configs for r in background.result(module, cfg.mangle())}
