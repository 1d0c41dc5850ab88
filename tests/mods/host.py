"""Runs rendered mods on the host (g++) or a GPU (nvcc): one program evaluates each over a grid.

The kernel's qualifiers are defined away for g++ (as the other host tests of emitted rules do);
``-ffp-contract=off`` keeps g++ from fusing a multiply and an add: the host side of ops.py's contract
rounds every operation, as numpy does (the device may fuse them). Results come back as raw bits, so
host floats compare exactly.
"""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
import torch

GXX = shutil.which("g++") or shutil.which("c++")
needs_gxx = pytest.mark.skipif(GXX is None, reason="no host C++ compiler (g++) on PATH")
HOST = "#define __host__\n#define __device__\n#define __forceinline__ inline"
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


def _setup(i: int, mod, args, device: bool) -> list:
    lines, name = [], f"m{i}"
    for a, v in zip(mod.scalars, args.scalars):
        lines.append(f"  a{i}.{a.name} = {float(v).hex() + 'f' if a.dtype == 'fp32' else int(v)};")
    for a, t in zip(mod.tensors, args.tensors):
        flat, strides = _storage(t)
        lines.insert(0, "  " + _array(f"{name}_{a.name}", _CTYPE[a.dtype], flat))
        arr = f"{name}_{a.name}"
        lines.append(f"  a{i}.{a.name} = {f'to_device({arr}, sizeof {arr})' if device else arr};")
        lines += [f"  a{i}.{a.name}_s{d} = {s};" for d, s in enumerate(strides)]
    return [f"  {name}_args a{i}; std::memset(&a{i}, 0, sizeof a{i});"] + lines


def _call(i: int, mod, scale: float = 1.0) -> str:
    """The function at (b, h, q, k), its indices as a base and an offset (as the kernels pass them): splitting
    conversions of index arithmetic (flashgen.mods.ranges) must not change a bit; a score_mod sees the score
    times ``scale`` (passed apart, as the kernels pass softmax_scale)."""
    score = f"score[at], {float(scale).hex()}f, " if mod.kind == "score" else ""
    return f"m{i}_at({score}b, h, q - q % 3, q % 3, k - k % 4, k % 4, a{i})"


def _host_main(mods: list, shape: tuple, scale: float = 1.0) -> list:
    main = []
    B, H, Q, K = shape
    main.append(f"  for (int b = 0; b < {B}; ++b) for (int h = 0; h < {H}; ++h) for (int q = 0; q < {Q}; ++q) "
                f"for (int k = 0; k < {K}; ++k) {{ const int at = ((b * {H} + h) * {Q} + q) * {K} + k; (void)at;")
    for i, (mod, _) in enumerate(mods):
        call = _call(i, mod, scale)
        if mod.kind == "score":
            main.append(f"    {{ const float r = {call}; unsigned u; std::memcpy(&u, &r, 4); std::printf(\"%u\\n\", u); }}")
        else:
            main.append(f"    std::printf(\"%d\\n\", (int){call});")
    return main + ["  }"]


def _device_main(mods: list, shape: tuple) -> list:
    """One thread per (b, h, q, k); results as bits, copied back and printed in the host's order."""
    B, H, Q, K = shape
    n, m = B * H * Q * K, len(mods)
    params = "".join(f", m{i}_args a{i}" for i in range(m))
    kernel = [f"__global__ void eval_all(const float* score, unsigned* out{params}) {{",
              f"  const int at = blockIdx.x * blockDim.x + threadIdx.x; if (at >= {n}) return;",
              f"  const int k = at % {K}, q = at / {K} % {Q}, h = at / {K * Q} % {H}, b = at / {K * Q * H};"]
    for i, (mod, _) in enumerate(mods):
        conv = "__float_as_uint" if mod.kind == "score" else "(unsigned)"
        kernel.append(f"  out[at * {m} + {i}] = {conv}({_call(i, mod)});")
    launch = ["  unsigned* out; cudaMalloc(&out, sizeof(unsigned) * " + str(n * m) + ");",
              f"  eval_all<<<{(n + 255) // 256}, 256>>>(to_device(score, sizeof score), out{''.join(f', a{i}' for i in range(m))});",
              f"  static unsigned host_out[{n * m}]; cudaMemcpy(host_out, out, sizeof host_out, cudaMemcpyDeviceToHost);",
              "  if (cudaGetLastError() != cudaSuccess) return 1;",
              f"  for (int i = 0; i < {n * m}; ++i) std::printf(\"%u\\n\", host_out[i]);"]
    return kernel + ["}"], launch


TO_DEVICE = """template <class T> const T* to_device(const T* host, size_t bytes) {
  void* dev; cudaMalloc(&dev, bytes); cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice); return (const T*)dev;
}"""


def run(mods: list, shape: tuple, score: np.ndarray, tmp_path, nvcc: "str | None" = None, arch: str = "native",
        scale: float = 1.0) -> list:
    """Each ``(mod, args)`` rendered as ``m<i>`` and evaluated at every (b, h, q_idx, kv_idx) of
    ``shape``, on the host with g++, or on the GPU when ``nvcc`` is given (compiled for ``arch``,
    e.g. "sm_90a", with the kernels' default nvcc semantics: no fast math), a score_mod on ``score``
    times ``scale`` (fp32, passed apart as the kernels do); returns arrays of ``shape`` (float32 / bool
    as the function returns)."""
    device = nvcc is not None
    src = ([] if device else [HOST]) + ["#include <cstdio>\n#include <cstring>"]
    src += [mod.to_cpp(f"m{i}") for i, (mod, _) in enumerate(mods)]
    main = ["int main() {", "  " + _array("score", "float", score.astype(np.float32).ravel())]
    for i, (mod, args) in enumerate(mods):
        main += _setup(i, mod, args, device)
    if device:
        kernel, body = _device_main(mods, shape)
        src += [TO_DEVICE] + kernel
        main += body
    else:
        main += _host_main(mods, shape, scale)
    main += ["  return 0;", "}"]
    (tmp_path / "mods.cu").write_text("\n".join(src + main) + "\n")
    exe = tmp_path / "mods"
    cmd = ([nvcc, "-O3", "-std=c++17", f"-arch={arch}"] if device else
           [GXX, "-std=c++17", "-O1", "-ffp-contract=off", "-Wall", "-Werror", "-Wno-unused-function", "-x", "c++"])
    res = subprocess.run(cmd + ["mods.cu", "-o", str(exe)], cwd=tmp_path, capture_output=True, text=True)
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


# ---- the rule and the mods' parameters as a kernel's host code fills them (tests/mods/test_score_rule.py,
# test_kernel_mods.py): qualifiers defined away, cudaErrorInvalidValue a plain number
HEAD = HOST + """
#define cudaErrorInvalidValue 1
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cmath>
#include <type_traits>"""


def f32(v) -> str:
    v = np.float32(v)
    if np.isnan(v):
        return "NAN"
    if np.isinf(v):
        return "INFINITY" if v > 0 else "-INFINITY"
    return f"{float(v).hex()}f"


def words_cpp(mods, score_args, mask_args) -> tuple[list[str], int]:
    """C++ declaring ``long long words[]`` as the launcher passes them (:meth:`KernelMods.pack`'s scalar
    words, then each tensor's pointer and strides) and the word count."""
    scalars, tensors = mods.pack(score_args, mask_args)
    ctype = {torch.float32: "float", torch.int32: "int", torch.bool: "bool"}
    lines = [_array(f"tensor{n}", ctype[t.dtype], _storage(t.detach().cpu())[0]) for n, t in enumerate(tensors)]
    words = [str(w) + "LL" for w in scalars]
    for n, t in enumerate(tensors):
        words += [f"(long long)(intptr_t)tensor{n}"] + [f"{s}LL" for s in t.stride()]
    lines.append(f"static const long long words[] = {{{', '.join(words) or '0'}}};")
    return lines, len(words)


def build_and_run(tmp_path, source: str) -> list[str]:
    """Compile ``source`` with g++ (no FMA contraction) and run it: its output's words."""
    (tmp_path / "rule.cpp").write_text(source)
    exe = tmp_path / "rule"
    res = subprocess.run([GXX, "-std=c++17", "-O1", "-ffp-contract=off", "rule.cpp", "-o", str(exe)],
                         cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
    return subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()
