"""The CUDA compiler flashgen builds and checks kernels with: where it is and which one it is."""
from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path


def find_nvcc() -> str | None:
    """``$FLASHGEN_NVCC``, else ``nvcc`` on PATH, else ``$CUDA_HOME/bin/nvcc``; None if none."""
    env = os.environ.get("FLASHGEN_NVCC")
    if env:
        return env if Path(env).exists() else None
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return None


#: What to say when no nvcc is found.
NOT_FOUND = "nvcc not found on PATH (set FLASHGEN_NVCC or CUDA_HOME to point at a CUDA toolkit)"


def require_nvcc(error: type[Exception], why: str = "") -> str:
    """The nvcc path, or ``error`` saying none was found (and ``why`` it is needed)."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise error(NOT_FOUND + (f": {why}" if why else ""))
    return nvcc


@functools.lru_cache(maxsize=None)
def nvcc_identity(nvcc: str) -> str:
    """The installation behind an nvcc path (resolved path, size, modification time): a new toolkit
    changes it. Cheap (one stat), so a cache key can hold it without running the compiler."""
    path = Path(nvcc).resolve()
    st = path.stat()
    return f"{path}:{st.st_size}:{st.st_mtime_ns}"
