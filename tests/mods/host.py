"""Runs rendered mods on the host: one g++ program evaluates each over a grid of indices.

The kernel's qualifiers are defined away for g++ (as the other host tests of emitted rules do);
``-ffp-contract=off`` keeps g++ from fusing a multiply and an add, which the device code forbids
with ``__fmul_rn``-style intrinsics (ops.py). Results come back as raw bits, so floats compare
exactly.
"""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
import torch

GXX = shutil.which("g++") or shutil.which("c++")
needs_gxx = pytest.mark.skipif(GXX is None, reason="no host C++ compiler (g++) on PATH")
HOST = "#define __host__\n#define __device__\n#define __forceinline__ inline\n#include <cstdio>\n#include <cstring>\n"
_CTYPE = {"fp32": "float", "int32": "int", "bool": "bool"}


def _array(name: str, ctype: str, values: np.ndarray) -> str:
    if ctype == "float":
        items = ", ".join(f"{float(v).hex()}f" if np.isfinite(v) else ("NAN" if np.isnan(v) else ("INFINITY" if v > 0 else "-INFINITY"))
                          for v in values)
    elif ctype == "bool":
        items = ", ".join("true" if v else "false" for v in values)
    else:
        items = ", ".join(str(int(v)) for v in values)
    return f"static const {ctype} {name}[] = {{{items or '0'}}};"


def _storage(t: torch.Tensor) -> tuple[np.ndarray, tuple]:
    """The memory a strided tensor spans (from its first element) and its strides, so the
    rendered strided loads are exercised as the kernel will run them."""
    n = sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1
    return torch.as_strided(t, (n,), (1,), t.storage_offset()).numpy(), t.stride()


def _setup(i: int, mod, args) -> list:
    lines, name = [], f"m{i}"
    for a, v in zip(mod.scalars, args.scalars):
        lines.append(f"  a{i}.{a.name} = {float(v).hex() + 'f' if a.dtype == 'fp32' else int(v)};")
    for a, t in zip(mod.tensors, args.tensors):
        flat, strides = _storage(t)
        lines.insert(0, "  " + _array(f"{name}_{a.name}", _CTYPE[a.dtype], flat))
        lines.append(f"  a{i}.{a.name} = {name}_{a.name};")
        lines += [f"  a{i}.{a.name}_s{d} = {s};" for d, s in enumerate(strides)]
    return [f"  {name}_args a{i}; std::memset(&a{i}, 0, sizeof a{i});"] + lines


def run(mods: list, shape: tuple, score: np.ndarray, tmp_path) -> list:
    """Each ``(mod, args)`` rendered as ``m<i>`` and evaluated at every (b, h, q_idx, kv_idx) of
    ``shape``; returns arrays of ``shape`` (float32 / int32 / bool as the function returns)."""
    src = [HOST] + [mod.to_cpp(f"m{i}") for i, (mod, _) in enumerate(mods)]
    main = ["int main() {", "  " + _array("score", "float", score.astype(np.float32).ravel())]
    for i, (mod, args) in enumerate(mods):
        main += _setup(i, mod, args)
    B, H, Q, K = shape
    main.append(f"  for (int b = 0; b < {B}; ++b) for (int h = 0; h < {H}; ++h) for (int q = 0; q < {Q}; ++q) "
                f"for (int k = 0; k < {K}; ++k) {{ const int at = ((b * {H} + h) * {Q} + q) * {K} + k; (void)at;")
    for i, (mod, _) in enumerate(mods):
        call = f"m{i}({'score[at], ' if mod.kind == 'score' else ''}b, h, q, k, a{i})"
        if mod.kind == "score":
            main.append(f"    {{ const float r = {call}; unsigned u; std::memcpy(&u, &r, 4); std::printf(\"%u\\n\", u); }}")
        else:
            main.append(f"    std::printf(\"%d\\n\", (int){call});")
    main += ["  }", "  return 0;", "}"]
    (tmp_path / "mods.cpp").write_text("\n".join(src + main) + "\n")
    exe = tmp_path / "mods"
    res = subprocess.run([GXX, "-std=c++17", "-O1", "-ffp-contract=off", "-Wall", "-Werror", "-Wno-unused-function",
                          "mods.cpp", "-o", str(exe)], cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
    out = np.array(subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split(), dtype=np.uint64)
    per = out.reshape(-1, len(mods))
    return [per[:, i].astype(np.uint32).view(np.float32).reshape(shape) if mod.kind == "score"
            else per[:, i].astype(bool).reshape(shape) for i, (mod, _) in enumerate(mods)]


def grid(shape: tuple) -> tuple:
    """FlexAttention's broadcast index arrays (int32) for ``shape`` = (B, H, Sq, Sk)."""
    return tuple(np.arange(n, dtype=np.int32).reshape([n if d == i else 1 for d in range(4)]) for i, n in enumerate(shape))


def ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance in fp32 units in the last place (0 for equal bits, NaN == NaN)."""
    def ordered(x):
        i = np.asarray(x, np.float32).view(np.int32).astype(np.int64)
        return np.where(i < 0, -(2**31) - i, i)
    both_nan = np.isnan(a) & np.isnan(b)
    return np.where(both_nan, 0, np.abs(ordered(a) - ordered(b)))
