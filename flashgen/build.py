"""The build stage: config -> kernel library in the cache, without torch's headers.

Stages, each inspectable in the cache entry: ``emit`` (``<name>.cu``), ``compile`` (nvcc
to a shared library ``<name>.so`` holding the device code and the C launcher of
:mod:`flashgen.emit.abi`; the exact command is kept in the entry as a repro). The
library is loaded by the one launcher of :mod:`flashgen.launcher`, built once.

The cache key is computed *without emitting*: the canonical config, a fingerprint
of the generator's own source (:data:`GENERATOR_PACKAGES`),
the nvcc flags and the nvcc installation, and the target arch. A change to the
emitter changes every key; nothing outside the generator does. A cache hit reads
one small record and loads the library: no emitter, no compiler.
"""
from __future__ import annotations

import functools
import hashlib
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs

from . import cache
from .dsl import configs
from .dsl.configs import AnyConfig
from .engines import emit, engine_of, verify
from .ptxas import PtxasStats, parse_ptxas
from .targets import TARGETS, of_capability
from .toolchain import find_nvcc, nvcc_identity, require_nvcc

#: Flags every compile of an emitted kernel uses (flashgen check too); builds add line info for profilers.
NVCC_FLAGS = ("-O3", "-std=c++17", "--expt-relaxed-constexpr")
BUILD_FLAGS = NVCC_FLAGS + ("-lineinfo",)
#: A shared library with the CUDA runtime linked in statically: it needs neither torch nor a libcudart on the path.
LIBRARY_FLAGS = ("-shared", "-Xcompiler", "-fPIC", "--cudart", "static")
#: ptxas's report of every build, kept with the kernel (:attr:`Built.ptxas`)
REPORT_FLAGS = ("-Xptxas", "-v")
#: The packages and modules whose source determines the emitted text (the emitter imports nothing else of flashgen).
GENERATOR_PACKAGES = ("dsl", "emit", "engines", "attention", "mods")
GENERATOR_MODULES = ("targets.py",)


class BuildError(RuntimeError):
    """nvcc failed, or the config cannot be built for the GPU; the message holds the source path and a repro command."""


def nvcc_command(cu_path: Path, capability: tuple[int, int], out: str = "kernel.o") -> str:
    """The nvcc command that compiles the kernel translation unit alone, with the register report."""
    return shlex.join(["nvcc", *BUILD_FLAGS, of_capability(capability).gencode, "-Xptxas", "-v", "-c", str(cu_path), "-o", out])


def library_command(name: str, capability: tuple[int, int]) -> list[str]:
    """The nvcc command, run in the entry's folder, that builds ``name``'s library (the build stage's ``compile``).
    Relative paths: the line info of the library names ``<name>.cu`` wherever the entry lies."""
    return [_nvcc(), *BUILD_FLAGS, *LIBRARY_FLAGS, *REPORT_FLAGS, of_capability(capability).gencode, f"{name}.cu",
            "-o", f"{name}.so"]


def repro(folder: Path, name: str, capability: tuple[int, int]) -> str:
    """A shell command that rebuilds ``name``'s library in ``folder``."""
    return f"cd {shlex.quote(str(folder))} && {shlex.join(library_command(name, capability))}"


def check_capability(cfg: AnyConfig, capability: tuple[int, int]) -> None:
    """BuildError when ``cfg``'s engine cannot run on a GPU of ``capability``."""
    engine = engine_of(cfg)
    if not engine.runs_on(of_capability(capability)):
        major, minor = capability
        raise BuildError(f"{cfg.short_form()} is a {engine.name}-engine kernel: it needs {engine.needs}, "
                         f"not {major}.{minor}" + (f"; {engine.hint}" if engine.hint else ""))


def _nvcc() -> str:
    return require_nvcc(BuildError, "building a kernel needs the CUDA compiler")


@functools.lru_cache(maxsize=None)
def generator_fingerprint() -> str:
    """A hash of the generator's source files (:data:`GENERATOR_PACKAGES`, :data:`GENERATOR_MODULES`)."""
    here = Path(__file__).parent
    h = hashlib.sha256()
    paths = [p for package in GENERATOR_PACKAGES for p in sorted((here / package).rglob("*"))]
    for path in paths + [here / m for m in GENERATOR_MODULES]:
        if path.is_file() and path.suffix in (".py", ".lark"):
            h.update(str(path.relative_to(here)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def cache_key(cfg: AnyConfig, capability: tuple[int, int], mods: Any = None) -> str:
    """The cache entry of ``cfg`` built for ``capability``, computed without emitting (the config's
    record names its kind, so a backward config's key is never a forward one's); ``mods``: the
    score_mod / mask_mod compiled in (their structure, :attr:`flashgen.mods.KernelMods.key`)."""
    nvcc = find_nvcc()
    flags = " ".join(BUILD_FLAGS + LIBRARY_FLAGS + REPORT_FLAGS)
    parts = (json.dumps(configs.to_record(cfg), sort_keys=True), generator_fingerprint(), flags,
             nvcc_identity(nvcc) if nvcc else "no nvcc", of_capability(capability).arch) + ((mods.key,) if mods else ())
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:24]


@attrs.define
class Built:
    """A kernel library in the cache (``directory``): its source, library and build record."""

    cfg: AnyConfig
    name: str
    key: str
    directory: Path
    capability: tuple[int, int]
    compile_seconds: float
    cache_hit: bool
    mods: Any = None  # the score_mod / mask_mod compiled in (flashgen.mods.KernelMods), or None
    ptxas: tuple[PtxasStats, ...] = ()  # ptxas's report per entry function (none from an entry built before it was kept)

    @property
    def cu_path(self) -> Path:
        return self.directory / f"{self.name}.cu"

    @property
    def library(self) -> Path:
        return self.directory / f"{self.name}.so"

    @property
    def command(self) -> str:
        """The nvcc command that built the library (run it in ``directory`` to reproduce the build)."""
        return repro(self.directory, self.name, self.capability)

    def source(self) -> str:
        """The emitted CUDA source, as compiled."""
        return self.cu_path.read_text()

    def register_problems(self) -> list[str]:
        """What ptxas reported that costs speed, per entry function (:meth:`PtxasStats.problems`): local memory
        and wgmma serialized for want of registers; empty for a clean kernel."""
        return [p for e in self.ptxas for p in e.problems()]


def build(cfg: AnyConfig, capability: tuple[int, int] | None = None, verbose: bool = False, mods: Any = None) -> Built:
    """Find ``cfg``'s kernel library in the cache, or build it, for ``capability`` (default: the current GPU);
    ``mods``: a forward kernel's score_mod / mask_mod (:class:`flashgen.mods.KernelMods`)."""
    capability = tuple(capability) if capability is not None else _current_capability()
    check_capability(cfg, capability)
    key = cache_key(cfg, capability, mods)
    name = cfg.mangle() if mods is None else mods.kernel_name(cfg.mangle())
    entry = cache.root() / key
    record = cache.read_entry(entry, (f"{name}.so", f"{name}.cu"))
    if record is not None:
        return Built(cfg, name, key, entry, capability, record["seconds"], True, mods, _stats(record))
    label = cfg.short_form() + (f" with {mods.describe()}" if mods else "")
    if verbose:
        cache.warn(f"building {label} -> {entry}")
    t0 = time.perf_counter()
    with cache.staging(entry) as tmp:
        stats = tuple(parse_ptxas(_compile(cfg, name, capability, tmp, final=entry, mods=mods) or ""))
        seconds = round(time.perf_counter() - t0, 2)
        cache.write_record(tmp, {"config": configs.to_record(cfg), "short_form": cfg.short_form(), "name": name,
                                 "arch": of_capability(capability).arch, "seconds": seconds,
                                 "command": repro(entry, name, capability), "ptxas": [attrs.asdict(e) for e in stats]}
                           | ({"mods": mods.key} if mods else {}),
                           (f"{name}.so", f"{name}.cu"))
    built = Built(cfg, name, key, entry, capability, seconds, False, mods, stats)
    if verbose:
        cache.warn(f"compiled {name} in {seconds:.1f} s")
        for problem in built.register_problems():  # slower than it could be: local memory or serialized wgmma
            cache.warn(f"{label}: ptxas: {problem}")
    return built


def _stats(record: dict) -> tuple[PtxasStats, ...]:
    """The ptxas report a cache record keeps (none in a record written before builds kept it)."""
    return tuple(PtxasStats(**e) for e in record.get("ptxas", ()))


_EXAMPLE = list(TARGETS.values())[-1]  # the newest target, as the example of a name


def _current_capability() -> tuple[int, int]:
    import torch

    if not torch.cuda.is_available():
        raise BuildError("no CUDA device here: to build ahead of time for a GPU that is not here, run "
                         f"'flashgen build CFG --arch {_EXAMPLE.name}' (or call flashgen.build.build(cfg, "
                         f"capability={_EXAMPLE.capability}))")
    return tuple(torch.cuda.get_device_capability())


def _compile(cfg: AnyConfig, name: str, capability: tuple[int, int], folder: Path, final: Path, mods: Any = None) -> str:
    """Verify ``cfg``'s plan (the proofs the emitter relies on), emit it into ``folder`` and compile its library
    there: nvcc's log (ptxas's report in it); BuildError with a repro command on failure."""
    from .sim.verify import VerificationError

    try:
        verify(cfg)
    except VerificationError as exc:
        raise BuildError(f"{cfg.short_form()} failed verification, so it is not built:\n{exc}") from None
    cu = folder / f"{name}.cu"
    source = emit(cfg, mods)
    if source.name != name:
        raise BuildError(f"{cfg.short_form()}: the emitter named the kernel {source.name}, the build expected {name}")
    cu.write_text(source.text)
    proc = subprocess.run(library_command(name, capability), capture_output=True, text=True, cwd=folder)
    if proc.returncode != 0:
        kept = final.with_name(f"{final.name}.failed")  # the staged source, kept for the repro command
        cache.remove(kept)
        shutil.copytree(folder, kept)
        raise BuildError(f"building {cfg.short_form()} failed (nvcc exit {proc.returncode}).\n  source: {kept / cu.name}\n"
                         f"  reproduce: {repro(kept, name, capability)}\n{(proc.stderr or proc.stdout).strip()}")
    return proc.stdout + proc.stderr


def _build_worker(args: tuple[dict, tuple[int, int]]) -> tuple[str, float, bool, str, list[str]]:
    cfg_dict, capability = args
    cfg = configs.from_dict(cfg_dict)
    try:
        built = build(cfg, capability)
        return cfg.short_form(), built.compile_seconds, built.cache_hit, "", built.register_problems()
    except (BuildError, cache.CacheError) as exc:
        return cfg.short_form(), 0.0, False, str(exc), []


def job_label(cfg: AnyConfig, capability: tuple[int, int]) -> str:
    return f"{cfg.short_form()} for {of_capability(capability).name}"


def build_jobs(jobs: list[tuple[AnyConfig, tuple[int, int]]], workers: int | None = None,
               progress: bool = True) -> dict[tuple[AnyConfig, tuple[int, int]], str]:
    """Build (config, capability) pairs in parallel processes, a progress line per kernel; {job: error} of
    failures. Ctrl-C or SIGTERM stops every build at once (:mod:`flashgen.workers`); finished ones stay cached."""
    from .workers import run_parallel

    done = 0

    def report(index: int, result: tuple[str, float, bool, str, list[str]]) -> None:
        nonlocal done
        done += 1
        if progress:
            _, seconds, hit, err, problems = result
            status = "FAILED" if err else ("in the cache" if hit else f"{seconds:.1f} s")
            status += f" (ptxas: {'; '.join(problems)})" if problems else ""
            print(f"[flashgen] [{done}/{len(jobs)}] {job_label(*jobs[index])}: {status}", file=sys.stderr, flush=True)

    results = run_parallel(_build_worker, [(configs.to_record(c), tuple(cap)) for c, cap in jobs], workers, report)
    return {job: err for job, (_, _, _, err, _) in zip(jobs, results) if err}


def build_many(cfgs: list[AnyConfig], capability: tuple[int, int], jobs: int | None = None,
               progress: bool = True) -> dict[str, str]:
    """Build many configs for one GPU in parallel processes (warming the cache); {short form: error} of failures."""
    failures = build_jobs([(c, tuple(capability)) for c in cfgs], jobs, progress)
    return {cfg.short_form(): err for (cfg, _), err in failures.items()}
