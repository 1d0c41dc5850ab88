"""``flashgen check``: compile emitted kernels with nvcc and report ptxas's resource usage.

For each (config, arch) the kernel translation unit is compiled alone::

    nvcc -O3 -std=c++17 --expt-relaxed-constexpr -Xptxas -v -c \
         -gencode=arch=compute_90a,code=sm_90a <name>.cu -o <name>.sm_90a.o

(``-cubin`` instead of ``-c`` for a config's later archs: its host code is compiled once) and ptxas's ``-v`` report is parsed (:func:`flashgen.ptxas.parse_ptxas`) into registers, spill
stores/loads, stack frame and static shared memory; the table adds the config's
dynamic shared memory. Compiles run in worker processes (:func:`flashgen.workers.run_parallel`:
Ctrl-C and SIGTERM end them and their nvcc at once). A failing compile reports the
``.cu`` path and the exact command. A (config, arch) pair that cannot exist, a wgmma
kernel for sm_80, is not compiled (:func:`plan_checks` says why).

Work folders live under ``$FLASHGEN_CACHE/check`` (default ``~/.cache/flashgen/check``),
one per kernel text and compiler: ``<name>-<key>/`` with the ``.cu``, the objects and
the ptxas logs. The key hashes the source text, the flags and ``nvcc --version``, so a
successful result found there is reused (``use_cache=False`` recompiles).
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import itertools
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Sequence

import attrs

from .build import NVCC_FLAGS
from .ptxas import PtxasStats, combined, parse_ptxas
from .dsl.configs import AnyConfig
from .emit.source import KernelSource
from .engines import emit_named, engine_of
from .targets import CHECK_DEFAULT, TARGETS, UnknownTarget, named as target_named
from .toolchain import require_nvcc
from .workers import run_parallel

#: The targets check compiles for (:data:`flashgen.targets.TARGETS`: the gencode flags compile() builds with).
ARCHS = tuple(TARGETS)
DEFAULT_ARCHS = CHECK_DEFAULT
PTXAS_VERBOSE = ("-Xptxas", "-v")
COMPILE_TIMEOUT_S = 900


class CheckError(RuntimeError):
    """The check cannot run: nvcc is missing or cannot be run, or nothing can be compiled for
    the chosen archs (not a failing kernel: those are CheckResults)."""


# ---- nvcc ------------------------------------------------------------------------------


def _nvcc() -> str:
    return require_nvcc(CheckError)


@functools.lru_cache(maxsize=None)
def nvcc_version(nvcc: str) -> str:
    try:
        res = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except OSError as exc:
        raise CheckError(f"cannot run {nvcc}: {exc.strerror or exc}") from None
    return res.stdout.strip().splitlines()[-1] if res.stdout.strip() else "unknown"


def _target(arch: str):
    try:
        return target_named(arch)
    except UnknownTarget as exc:
        raise CheckError(str(exc)) from None


def compile_command(nvcc: str, cu: Path, arch: str, out: Path, device_only: bool = False) -> list[str]:
    """The argv that compiles one kernel for ``arch`` with ptxas's resource report; ``device_only``: the
    device code alone, to a cubin (the same report in about 40% of the time: no host compile)."""
    return [nvcc, *NVCC_FLAGS, *PTXAS_VERBOSE, "-cubin" if device_only else "-c", _target(arch).gencode, str(cu),
            "-o", str(out)]


def ptx_command(nvcc: str, cu: Path, arch: str, out: Path) -> list[str]:
    """The argv that writes the PTX of ``cu`` for ``arch`` (compute_80 / compute_90a)."""
    return [nvcc, *NVCC_FLAGS, "-ptx", f"-arch=compute_{_target(arch).name.removeprefix('sm_')}", str(cu), "-o", str(out)]


# ---- results ----------------------------------------------------------------------------


@attrs.frozen
class CheckResult:
    """One (config, arch) compile: ``ok`` and ptxas's numbers (``stats``: of the whole file, see
    :func:`combined`; ``entries``: per entry function), or the failure and its repro."""

    cfg: AnyConfig
    arch: str
    ok: bool
    stats: PtxasStats | None
    cu_path: Path
    command: str  # the exact nvcc command line (shell-quoted)
    log: str  # nvcc's stdout + stderr
    seconds: float
    cached: bool = False
    entries: tuple[PtxasStats, ...] = ()

    @property
    def dynamic_smem(self) -> int:
        return self.cfg.smem_bytes

    @property
    def main_static_smem(self) -> int:
        """ptxas's static shared memory of the entry that is launched with the dynamic bytes (the file's ``kernel``),
        not of a backward's preprocess or dQ conversion, which launch with none; every entry's most where no entry
        has that name."""
        main = [e.static_smem for e in self.entries if _is_main_kernel(e.function)]
        return main[0] if main else (self.stats.static_smem if self.stats else 0)

    @property
    def smem_bytes(self) -> int:
        """Shared memory per CTA of the main kernel, static (ptxas) + dynamic (the config's tiles), or of another
        entry of the file (its static bytes alone) where that is more."""
        return max([self.dynamic_smem + self.main_static_smem, *(e.static_smem for e in self.entries)])

    @property
    def smem_limit(self) -> int:
        """The shared memory one block may have on this arch."""
        return _target(self.arch).smem_per_block

    @property
    def fits_smem(self) -> bool:
        """Whether a launch on this arch gets the kernel's shared memory (it compiles either way)."""
        return self.smem_bytes <= self.smem_limit

    def to_dict(self) -> dict:
        d = {
            "name": self.cfg.mangle(),
            "short_form": self.cfg.short_form(),
            "arch": self.arch,
            "ok": self.ok,
            "cu_path": str(self.cu_path),
            "command": self.command,
            "seconds": round(self.seconds, 2),
            "cached": self.cached,
            "dynamic_smem_bytes": self.dynamic_smem,
            "smem_limit_bytes": self.smem_limit,
            "fits_smem": self.fits_smem,
        }
        if self.stats:
            d.update(
                registers=self.stats.registers,
                spill_stores=self.stats.spill_stores,
                spill_loads=self.stats.spill_loads,
                stack_frame=self.stats.stack_frame,
                static_smem_bytes=self.main_static_smem,
                smem_bytes=self.smem_bytes,
                barriers=self.stats.barriers,
                wgmma_serialized=self.stats.serialized,
                functions=[attrs.asdict(e) for e in self.entries],
            )
        else:
            d["error"] = _error_lines(self.log)
        return d


def _error_lines(log: str, limit: int = 20) -> str:
    lines = [l for l in log.splitlines() if "error" in l.lower() or "fatal" in l.lower()]
    return "\n".join((lines or log.splitlines())[:limit])


# ---- compiling ---------------------------------------------------------------------------


def default_workdir() -> Path:
    from . import cache

    return cache.root() / "check"


@functools.lru_cache(maxsize=512)
def source_of(cfg: AnyConfig, mods: tuple = (None, None)) -> KernelSource:
    """``emit(cfg)``, memoized: emit is pure, so a process may keep what it emitted. ``mods``: the
    (score_mod, mask_mod) specs the kernel is built with (:mod:`flashgen.mods.spec`)."""
    return emit_named(cfg, mods)


def _private(path: Path) -> Path:
    """A temporary name next to ``path`` that no other process or thread writes (then os.replace)."""
    return path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def _kernel_dir(workdir: Path, src: KernelSource, nvcc: str, what: str) -> Path:
    h = hashlib.sha256()
    for part in (src.text, " ".join(NVCC_FLAGS), what, nvcc_version(nvcc)):
        h.update(part.encode())
        h.update(b"\0")
    d = workdir / f"{src.name}-{h.hexdigest()[:12]}"
    d.mkdir(parents=True, exist_ok=True)
    cu = d / f"{src.name}.cu"
    if not cu.exists() or cu.read_text() != src.text:
        tmp = _private(cu)
        tmp.write_text(src.text)
        os.replace(tmp, cu)  # atomic: a concurrent checker never sees half a file
    return d


def _compile_one(task: tuple[AnyConfig, str, str, Path, bool, bool, tuple]) -> CheckResult:  # worker of run_parallel
    cfg, arch, nvcc, workdir, use_cache, device_only, mods = task
    src = source_of(cfg, mods)
    d = _kernel_dir(workdir, src, nvcc, "check")
    cu = d / f"{src.name}.cu"
    obj = d / f"{src.name}.{arch}.{'cubin' if device_only else 'o'}"
    log_path = d / f"{src.name}.{arch}.ptxas.txt"
    argv = compile_command(nvcc, cu, arch, obj, device_only)
    command = shlex.join(argv)
    built = [d / f"{src.name}.{arch}.{ext}" for ext in ("o", "cubin")]  # either gives the same ptxas report
    if use_cache and log_path.exists() and any(b.exists() for b in built):
        log = log_path.read_text()
        stats = parse_ptxas(log)
        if stats:
            return CheckResult(cfg, arch, True, combined(stats), cu, command, log, 0.0, cached=True, entries=tuple(stats))
    t0 = time.perf_counter()
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        log, ok = res.stdout + res.stderr, res.returncode == 0
    except subprocess.TimeoutExpired:
        log, ok = f"nvcc did not finish within {COMPILE_TIMEOUT_S} s", False
    except OSError as exc:
        log, ok = f"cannot run nvcc: {exc.strerror or exc}", False
    seconds = time.perf_counter() - t0
    stats = parse_ptxas(log) if ok else []
    if ok and not stats:
        ok = False
        log += "\nflashgen: ptxas printed no resource report for the kernel (is -Xptxas -v honoured?)"
    if ok:
        tmp = _private(log_path)
        tmp.write_text(log)
        os.replace(tmp, log_path)
    else:
        log_path.unlink(missing_ok=True)
    return CheckResult(cfg, arch, ok, combined(stats) if stats else None, cu, command, log, seconds, entries=tuple(stats))


def arch_refusal(cfg: AnyConfig, arch: str) -> str | None:
    """Why ``cfg`` cannot be compiled for ``arch``; None when it can."""
    return engine_of(cfg).refusal(_target(arch))


def plan_checks(
    cfgs: Iterable[AnyConfig], archs: Sequence[str]
) -> tuple[list[tuple[AnyConfig, str]], list[tuple[AnyConfig, str, str]]]:
    """The (config, arch) pairs to compile, in that order, and those that cannot be, with why."""
    tasks, refused = [], []
    for cfg, arch in itertools.product(dict.fromkeys(cfgs), dict.fromkeys(archs)):
        why = arch_refusal(cfg, arch)
        if why:
            refused.append((cfg, arch, why))
        else:
            tasks.append((cfg, arch))
    return tasks, refused


def check_configs(
    cfgs: Iterable[AnyConfig],
    archs: Sequence[str] = DEFAULT_ARCHS,
    jobs: int | None = None,
    workdir: "str | Path | None" = None,
    use_cache: bool = True,
    progress: Callable[[CheckResult, int, int], None] | None = None,
    mods: tuple = (None, None),
) -> list[CheckResult]:
    """Compile every (config, arch) of :func:`plan_checks` with nvcc in ``jobs`` processes
    (default: cpu count); the pairs it refuses are left out. A config's host code is compiled with
    its first arch only (the others: device code alone, the same ptxas report). ``mods``: the
    (score_mod, mask_mod) specs every kernel is built with (:mod:`flashgen.mods.spec`; None: none).

    Returns the results in (config, arch) order. Raises CheckError when nvcc is missing
    or an arch is unknown; a failing compile is a result with ``ok=False``.
    """
    for arch in archs:
        _target(arch)
    nvcc = _nvcc()
    nvcc_version(nvcc)
    workdir = Path(workdir) if workdir is not None else default_workdir()
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckError(f"cannot create the work folder {workdir}: {exc.strerror or exc}") from None
    tasks, _ = plan_checks(cfgs, archs)
    done = itertools.count(1)

    def report(i: int, res: CheckResult) -> None:
        progress(res, next(done), len(tasks))  # type: ignore[misc]

    # the host code (the launcher) is the same for every arch: compiled once, with a config's first arch
    first = {cfg: arch for cfg, arch in reversed(tasks)}
    work = [(cfg, arch, nvcc, workdir, use_cache, first[cfg] != arch, tuple(mods)) for cfg, arch in tasks]
    return run_parallel(_compile_one, work, jobs, report if progress else None)


def ptx_text(cfg: AnyConfig, arch: str | None = None, workdir: "str | Path | None" = None) -> str:
    """The PTX nvcc generates for ``cfg`` on ``arch`` (default: its engine's target; ``nvcc -ptx``), cached like the checks."""
    arch = arch or engine_of(cfg).target.name
    nvcc = _nvcc()
    src = source_of(cfg)
    workdir = Path(workdir) if workdir is not None else default_workdir()
    d = _kernel_dir(workdir, src, nvcc, "ptx")
    cu = d / f"{src.name}.cu"
    out = d / f"{src.name}.{arch}.ptx"
    if out.exists():
        return out.read_text()
    argv = ptx_command(nvcc, cu, arch, _private(out))
    res = subprocess.run(argv, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    if res.returncode != 0:
        raise CheckError(
            f"nvcc -ptx failed for {cfg.short_form()} ({arch})\n  source: {cu}\n  reproduce: {shlex.join(argv)}\n"
            f"{_error_lines(res.stdout + res.stderr)}"
        )
    os.replace(argv[-1], out)
    return out.read_text()


# ---- report -----------------------------------------------------------------------------


def format_table(results: Sequence[CheckResult]) -> str:
    """One row per (config, arch): registers, spills, stack, shared memory, status."""
    head = ("config", "arch", "regs", "spill st", "spill ld", "stack", "smem", "status")
    rows = []
    for r in results:
        if r.stats:
            s = r.stats
            status = ", ".join(([] if s.clean else ["LOCAL MEMORY"]) + (["WGMMA SERIALIZED"] if s.serialized else [])
                               + ([] if r.fits_smem else [f"SMEM > {r.smem_limit}"]))
            status = status or "ok"
            rows.append((r.cfg.short_form(), r.arch, str(s.registers), str(s.spill_stores), str(s.spill_loads),
                         str(s.stack_frame), _smem(r), status))
        else:
            rows.append((r.cfg.short_form(), r.arch, "-", "-", "-", "-", f"{r.dynamic_smem}", "FAILED"))
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]
    right = {2, 3, 4, 5, 6}

    def fmt(row: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    lines = [fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]
    return "\n".join(lines)


def _is_main_kernel(function: str) -> bool:
    """Whether an entry is an emitted file's main kernel, ``<kernel name>::kernel``: the last name of its mangled
    nested name (``_ZN`` then length-prefixed names) is ``kernel``."""
    if not function.startswith("_ZN"):
        return function == "kernel"
    names, i = [], 3
    while i < len(function) and function[i].isdigit():
        j = i
        while function[j].isdigit():
            j += 1
        names.append(function[j:j + int(function[i:j])])
        i = j + int(function[i:j])
    return names[-1:] == ["kernel"]


def _smem(r: CheckResult) -> str:
    static = r.main_static_smem
    return f"{r.smem_bytes}" if not static else f"{r.smem_bytes} ({static} static)"


def failure_report(r: CheckResult) -> str:
    return (
        f"{r.cfg.short_form()} failed to compile for {r.arch}\n"
        f"  source:    {r.cu_path}\n"
        f"  reproduce: {r.command}\n"
        + "\n".join("  | " + l for l in _error_lines(r.log).splitlines())
    )


# ---- command line -----------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", nargs="+", default=list(DEFAULT_ARCHS), choices=list(ARCHS), metavar="ARCH",
                   help=f"targets to compile for (default: {' '.join(DEFAULT_ARCHS)}; choices: {', '.join(ARCHS)})")
    from .options import positive_int

    p.add_argument("-j", "--jobs", type=positive_int, default=None, metavar="N",
                   help="parallel nvcc processes (default: the number of CPUs)")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    p.add_argument("--workdir", type=Path, default=None, metavar="DIR",
                   help="where the .cu files, objects and ptxas logs go (default: $FLASHGEN_CACHE/check)")
    p.add_argument("--no-cache", action="store_true", help="recompile even when an identical kernel was checked before")
    p.add_argument("--fail-on-spill", action="store_true",
                   help="also exit non-zero when a kernel spills or has a stack frame")


def refusal_lines(refused: Sequence[tuple[AnyConfig, str, str]], verbose: bool = False) -> list[str]:
    """The pairs :func:`plan_checks` refused: a count per (arch, reason), or (``verbose``) each config."""
    if verbose:
        return [f"not compiled for {arch}: {cfg.short_form()}: {why}" for cfg, arch, why in refused]
    counts = Counter((arch, why) for _, arch, why in refused)
    return [f"{n} config(s) not compiled for {arch}: {why}" for (arch, why), n in counts.items()]


def run(cfgs: Sequence[AnyConfig], args: argparse.Namespace) -> int:
    """Check ``cfgs`` as the options in ``args`` say; print the table (stdout) and failures (stderr).

    Notes and progress go to stderr unless ``args.quiet``; CheckError when no pair can be compiled.
    """
    tasks, refused = plan_checks(cfgs, args.arch)
    if not tasks:
        why = Counter(why for _, _, why in refused)
        raise CheckError(f"nothing to compile for --arch {' '.join(args.arch)}: "
                         + "; ".join(f"{reason} ({n} config(s))" for reason, n in why.items()))
    from .options import progress_of

    note = progress_of(args) or (lambda msg: None)
    for line in refusal_lines(refused, args.verbose):
        note(line)

    def progress(r: CheckResult, done: int, n: int) -> None:
        if r.ok and r.stats:
            what = f"{r.stats.registers} regs, {r.stats.spill_stores + r.stats.spill_loads} B spills"
            what += ", wgmma serialized" if r.stats.serialized else ""
            what += " (cached)" if r.cached else f" ({r.seconds:.1f} s)"
        else:
            what = "FAILED"
        note(f"[{done}/{n}] {r.arch} {r.cfg.mangle()}: {what}")

    jobs = min(args.jobs or os.cpu_count() or 1, len(tasks))
    note(f"compiling {len(tasks)} kernel(s) with {jobs} job(s)")
    mods = getattr(args, "mods", (None, None))
    if mods != (None, None):
        note("every kernel built with " + " and ".join(f"{k}_mod {v}" for k, v in zip(("score", "mask"), mods) if v))
    results = check_configs(cfgs, args.arch, args.jobs, args.workdir, not args.no_cache, progress, mods)
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=2, sort_keys=True))
    else:
        print(format_table(results))
    failed = [r for r in results if not r.ok]
    for r in failed:
        print(failure_report(r), file=sys.stderr)
    spilled = [r for r in results if r.stats and not r.stats.clean]
    for r in results:
        if r.ok and not r.fits_smem:
            note(f"{r.cfg.short_form()} needs {r.smem_bytes} bytes of shared memory per block; {r.arch} gives "
                 f"{r.smem_limit}: it compiles but cannot launch there")
    if failed:
        print(f"flashgen: error: {len(failed)} of {len(results)} compile(s) failed", file=sys.stderr)
        return 1
    if spilled and args.fail_on_spill:
        print(f"flashgen: error: {len(spilled)} kernel(s) use local memory (spills or a stack frame)", file=sys.stderr)
        return 1
    return 0
