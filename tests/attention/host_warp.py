"""Run a rule object's rendered C++ on the host, one warp of 32 lanes in lockstep.

The rule's ``__device__`` functions are compiled unchanged with g++: ``__shfl_xor_sync`` is a real
exchange between 32 threads meeting at a barrier (so the butterfly runs as on the GPU, every lane
at the same step), ``ex2_approx`` / ``expf`` / ``logf`` are the correctly rounded fp32 results the
numpy evaluators model (the PTX helper is an instruction, not part of the rule). A driver reads
fp32 bit patterns per lane from stdin and writes fp32 bit patterns back, so a compiled rule is run
once per example (hypothesis) without recompiling.
"""
from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

GXX = shutil.which("g++") or shutil.which("c++")
needs_gxx = pytest.mark.skipif(GXX is None, reason="no host C++ compiler (g++) on PATH")

LANES = 32

PRELUDE = r"""#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>
#define __device__
#define __host__
#define __forceinline__ inline
// the fp32 results the numpy evaluators model: correctly rounded, ex2 flushing subnormals
static float host_expf(float x) { return float(std::exp(double(x))); }
static float host_logf(float x) { return float(std::log(double(x))); }
static float ex2_approx(float x) {
    if (std::fabs(x) < 1.17549435e-38f) x = 0.f;
    const float y = float(std::exp2(double(x)));
    return std::fabs(y) < 1.17549435e-38f ? 0.f : y;
}
static float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
#define expf host_expf
#define logf host_logf
// one warp in lockstep: each shuffle publishes every lane's value, then reads the partner's
static thread_local int t_lane;
static float g_slot[32];
static std::barrier<>* g_sync;
static float __shfl_xor_sync(unsigned, float v, int m) {
    g_slot[t_lane] = v;
    g_sync->arrive_and_wait();
    const float r = g_slot[t_lane ^ m];
    g_sync->arrive_and_wait();
    return r;
}
static float in_f32() { uint32_t u; if (std::scanf("%x", &u) != 1) std::abort(); float f; std::memcpy(&f, &u, 4); return f; }
static void out_f32(char* line, float f) { uint32_t u; std::memcpy(&u, &f, 4); std::sprintf(line + std::strlen(line), "%08x ", u); }
"""

MAIN = r"""
int main() {
    int cases;
    if (std::scanf("%d", &cases) != 1) return 1;
    std::barrier<> sync(32);
    g_sync = &sync;
    for (int n = 0; n < cases; ++n) {
        std::vector<std::vector<float>> in(32, std::vector<float>(IN_PER_LANE));
        for (auto& lane : in) for (auto& v : lane) v = in_f32();
        std::vector<std::vector<char>> out(32, std::vector<char>(9 * OUT_PER_LANE + 1, 0));
        std::vector<std::thread> warp;
        for (int l = 0; l < 32; ++l)
            warp.emplace_back([&, l] { t_lane = l; lane_main(in[l].data(), out[l].data()); });
        for (auto& t : warp) t.join();
        for (auto& line : out) std::printf("%s\n", line.data());
    }
    return 0;
}
"""


def build(folder: Path, rule_cpp: str, driver: str, n_in: int, n_out: int) -> functools.partial:
    """Write the program of ``rule_cpp`` + a per-lane driver ``void lane_main(const float* in, char* out)``
    (reading ``n_in`` floats, writing ``n_out`` with ``out_f32``) into ``folder``; returns the g++ run
    (a picklable call: a background build) that compiles it to ``folder / "warp"``."""
    src = folder / "warp.cpp"
    src.write_text(PRELUDE + rule_cpp + "\n" + driver + f"\nconstexpr int IN_PER_LANE = {n_in}, OUT_PER_LANE = {n_out};\n" + MAIN)
    argv = [GXX, "-std=c++20", "-O1", "-ffp-contract=off", "-Wno-unknown-pragmas", "-pthread", str(src), "-o", str(folder / "warp")]
    return functools.partial(subprocess.run, argv, capture_output=True, text=True)


class HostWarp:
    """The program :func:`build` compiled (``compiled``: its g++ run), reading ``n_in`` and writing
    ``n_out`` floats per lane."""

    def __init__(self, compiled: subprocess.CompletedProcess, n_in: int, n_out: int):
        assert compiled.returncode == 0, compiled.stderr[-4000:]
        self.n_in, self.n_out = n_in, n_out
        self.exe = Path(compiled.args[-1])

    def run(self, lanes_in: np.ndarray) -> np.ndarray:
        """``[cases, 32, n_in]`` float32 in -> ``[cases, 32, n_out]`` float32 out."""
        x = np.ascontiguousarray(lanes_in, dtype=np.float32)
        assert x.shape[1:] == (LANES, self.n_in), x.shape
        text = f"{x.shape[0]}\n" + " ".join(f"{u:x}" for u in x.view(np.uint32).ravel())
        res = subprocess.run([str(self.exe)], input=text, capture_output=True, text=True, check=True, timeout=60)
        words = res.stdout.split()
        return np.array([int(w, 16) for w in words], dtype=np.uint32).view(np.float32).reshape(x.shape[0], LANES, self.n_out)
