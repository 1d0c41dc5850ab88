"""The build stage: emitted source -> torch extension, cached on disk by content hash.

Stages (each inspectable on the returned :class:`Built`): ``emit`` (the .cu and the
binding .cpp, written under the cache entry), ``compile`` (nvcc + host compiler via
``torch.utils.cpp_extension.load``), ``load`` (the torch operator library). The cache key
hashes the source, the binding, the flags, torch and CUDA versions and the target
arch, so a second process finds the finished build and only imports it. torch's
build lock makes two processes building the same key at once safe.
"""
from __future__ import annotations

import hashlib
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import attrs

from .dsl.config import KernelConfig
from .emit.kernel import KernelSource, emit

#: Flags every compile of an emitted kernel uses (flashgen check too); builds add line info for profilers.
NVCC_FLAGS = ("-O3", "-std=c++17", "--expt-relaxed-constexpr")
BUILD_FLAGS = NVCC_FLAGS + ("-lineinfo",)


class BuildError(RuntimeError):
    """nvcc or the host compiler failed; the message holds the source path and a repro command."""


def cache_root() -> Path:
    return Path(os.environ.get("FLASHGEN_CACHE", Path.home() / ".cache" / "flashgen"))


def arch_flags(capability: tuple[int, int]) -> tuple[str, str]:
    """(TORCH_CUDA_ARCH_LIST entry, nvcc -gencode flag) for a compute capability."""
    major, minor = capability
    suffix = "a" if (major, minor) == (9, 0) else ""  # sm_90a: the Hopper-only instructions
    return f"{major}.{minor}{suffix}", f"-gencode=arch=compute_{major}{minor}{suffix},code=sm_{major}{minor}{suffix}"


def nvcc_command(cu_path: Path, capability: tuple[int, int], out: str = "kernel.o") -> str:
    """The nvcc command that compiles the kernel translation unit alone (to reproduce failures)."""
    _, gencode = arch_flags(capability)
    return shlex.join(["nvcc", *BUILD_FLAGS, gencode, "-Xptxas", "-v", "-c", str(cu_path), "-o", out])


@attrs.define
class Built:
    cfg: KernelConfig
    source: KernelSource
    key: str
    directory: Path
    library: Any  # the path of the loaded operator library
    compile_seconds: float
    cache_hit: bool

    @property
    def cu_path(self) -> Path:
        return self.directory / f"{self.source.name}.cu"


def _key(source: KernelSource, capability: tuple[int, int]) -> str:
    import torch

    h = hashlib.sha256()
    for part in (source.text, source.binding, " ".join(BUILD_FLAGS), torch.__version__, str(torch.version.cuda), arch_flags(capability)[0]):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def build(cfg: KernelConfig, capability: tuple[int, int] | None = None, verbose: bool = False) -> Built:
    """Build (or find in the cache) the extension for ``cfg`` on ``capability`` (default: current GPU)."""
    import torch
    from torch.utils import cpp_extension

    if capability is None:
        if not torch.cuda.is_available():
            raise BuildError("no CUDA device: pass capability=(major, minor) to build for a GPU that is not here")
        capability = torch.cuda.get_device_capability()
    if cfg.is_wgmma and tuple(capability) != (9, 0):
        raise BuildError(
            f"{cfg.short_form()} is a wgmma-engine (Hopper) kernel: it needs compute capability 9.0 (sm_90a), "
            f"not {capability[0]}.{capability[1]}; use an engine=mma_sync config on this GPU"
        )
    source = emit(cfg)
    key = _key(source, capability)
    directory = cache_root() / key
    directory.mkdir(parents=True, exist_ok=True)
    cu = directory / f"{source.name}.cu"
    cpp = directory / "binding.cpp"
    for path, text in ((cu, source.text), (cpp, source.binding)):
        if not path.exists() or path.read_text() != text:
            tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
            tmp.write_text(text)
            os.replace(tmp, path)  # atomic: a concurrent builder never sees half a file
    done_marker = directory / "BUILT"
    cache_hit = done_marker.exists()
    arch_list, gencode = arch_flags(capability)
    old_arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
    t0 = time.perf_counter()
    if verbose and not cache_hit:
        print(f"[flashgen] building {cfg.short_form()} -> {directory}", file=sys.stderr, flush=True)
    try:
        module = cpp_extension.load(
            name=f"flashgen_{key}",
            sources=[str(cu), str(cpp)],
            extra_cuda_cflags=list(BUILD_FLAGS),
            extra_cflags=["-O2"],
            build_directory=str(directory),
            verbose=False,
            is_python_module=False,  # a library of torch operators (torch.ops.flashgen.<name>)
        )
    except (RuntimeError, OSError, ImportError) as exc:
        raise BuildError(
            f"building {cfg.short_form()} failed.\n  source: {cu}\n  reproduce: {nvcc_command(cu, capability)}\n"
            f"  build dir: {directory}\n{exc}"
        ) from exc
    finally:
        if old_arch is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = old_arch
    seconds = time.perf_counter() - t0
    done_marker.write_text(f"{seconds:.2f}\n")
    if verbose:
        what = "loaded from cache" if cache_hit else "compiled"
        print(f"[flashgen] {what} {source.name} in {seconds:.1f} s", file=sys.stderr, flush=True)
    return Built(cfg, source, key, directory, module, seconds, cache_hit)


def _build_worker(args: tuple[dict, tuple[int, int]]) -> tuple[str, float, str]:
    cfg_dict, capability = args
    cfg = KernelConfig.from_dict(cfg_dict)
    try:
        built = build(cfg, capability)
        return cfg.short_form(), built.compile_seconds, ""
    except BuildError as exc:
        return cfg.short_form(), 0.0, str(exc)


def build_many(cfgs: list[KernelConfig], capability: tuple[int, int], jobs: int | None = None, progress: bool = True) -> dict[str, str]:
    """Build many configs in parallel processes (warming the cache); returns {short form: error} for failures."""
    import concurrent.futures as cf
    import multiprocessing as mp

    jobs = jobs or max(1, min(len(cfgs), (os.cpu_count() or 2) // 2))
    os.environ.setdefault("MAX_JOBS", "2")  # each build compiles 2 files; keep the total near the core count
    failures: dict[str, str] = {}
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        futures = [pool.submit(_build_worker, (c.to_dict(), capability)) for c in cfgs]
        for i, fut in enumerate(cf.as_completed(futures), 1):
            name, seconds, err = fut.result()
            if err:
                failures[name] = err
            if progress:
                status = "FAILED" if err else f"{seconds:.0f} s"
                print(f"[flashgen] built {i}/{len(cfgs)}: {name} ({status})", file=sys.stderr, flush=True)
    return failures
