"""Host builds of a ScoreMask's C++ for tests: the rule's functions, the mods' parameters filled from
the launcher's words by ``KernelMods.fill_cpp``, and a driver the test writes (g++, no GPU).

The kernel's qualifiers are defined away; ``-ffp-contract=off`` keeps g++ from fusing what the
device code keeps apart (``__fmul_rn``-style helpers). Floats travel as hex literals and come back
as raw bits, so they compare exactly.
"""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import torch

GXX = shutil.which("g++") or shutil.which("c++")
HEAD = """#define __host__
#define __device__
#define __forceinline__ inline
#define cudaErrorInvalidValue 1
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cmath>
#include <type_traits>"""
CTYPE = {torch.float32: "float", torch.int32: "int", torch.bool: "bool"}


def f32(v) -> str:
    v = np.float32(v)
    if np.isnan(v):
        return "NAN"
    if np.isinf(v):
        return "INFINITY" if v > 0 else "-INFINITY"
    return f"{float(v).hex()}f"


def array(name: str, ctype: str, values) -> str:
    values = np.asarray(values).ravel()
    fmt = {"float": f32, "bool": lambda v: "true" if v else "false"}.get(ctype, lambda v: str(int(v)))
    return f"static const {ctype} {name}[] = {{{', '.join(fmt(v) for v in values) or '0'}}};"


def storage(t: torch.Tensor) -> np.ndarray:
    """The memory a strided tensor spans from its first element (what its pointer and strides address)."""
    t = t.detach().cpu()
    n = sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1
    return torch.as_strided(t, (n,), (1,), t.storage_offset()).numpy()


def words_cpp(mods, score_args, mask_args) -> tuple[list[str], int]:
    """C++ declaring ``long long words[]`` as the launcher passes them (:meth:`KernelMods.pack`'s scalar
    words, then each tensor's pointer and strides) and the word count."""
    scalars, tensors = mods.pack(score_args, mask_args)
    lines = [array(f"tensor{n}", CTYPE[t.dtype], storage(t)) for n, t in enumerate(tensors)]
    words = [str(w) + "LL" for w in scalars]
    for n, t in enumerate(tensors):
        words += [f"(long long)(intptr_t)tensor{n}"] + [f"{s}LL" for s in t.stride()]
    lines.append(f"static const long long words[] = {{{', '.join(words) or '0'}}};")
    return lines, len(words)


def build_and_run(tmp_path, source: str) -> list[str]:
    (tmp_path / "rule.cpp").write_text(source)
    exe = tmp_path / "rule"
    res = subprocess.run([GXX, "-std=c++17", "-O1", "-ffp-contract=off", "rule.cpp", "-o", str(exe)],
                         cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
    return subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()
