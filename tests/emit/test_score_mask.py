"""The emitted score-mask functions (C++, compiled for the host) equal the plan's ScoreMask.

``score_row_range``, ``kv_block_range`` and ``block_needs_mask`` are rendered from the
plan's ScoreMask; the kernel masks, skips and bounds key blocks with them. Every answer
over a grid of lengths, offsets, window sizes, rows and blocks must equal the Python rule,
and the block functions must agree with the per-score rule they summarise.
"""
from __future__ import annotations

import itertools
import shutil
import subprocess

import pytest

from flashgen.dsl.config import KernelConfig
from flashgen.dsl.plan import make_plan
from flashgen.engines import emit

GXX = shutil.which("g++") or shutil.which("c++")
pytestmark = pytest.mark.skipif(GXX is None, reason="no host C++ compiler (g++) on PATH")

SEQ_QS = (1, 37, 128, 200)
SEQ_KS = (1, 64, 91, 300)
WINDOWS = ((-1, -1), (-1, 0), (17, 5), (0, 0), (64, -1), (3, 100))


def _grid(seq_q, seq_k):
    offsets = sorted({0, seq_k - seq_q, 5, -7})
    return offsets


@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_emitted_mask_functions_equal_the_plan(mask, tmp_path):
    cfg = KernelConfig(dtype="fp16", B_r=64, B_c=32, Q_mma_load_K_tiles=2, mask=mask)
    sm = make_plan(cfg).score_mask
    src = emit(cfg)
    (tmp_path / "k.cu").write_text(src.text)
    cases = []
    for sq, sk in itertools.product(SEQ_QS, SEQ_KS):
        for off in _grid(sq, sk):
            for left, right in (WINDOWS if mask == "window" else ((-1, -1),)):
                for q0 in range(0, sq, cfg.B_r):
                    cases.append((q0, sq, sk, off, left, right))
    lines = ["#include \"k.cu\"", "#include <cstdio>", f"using namespace {src.name};", "int main() {"]
    lines.append("  static const int cases[][6] = {" + ", ".join("{%d,%d,%d,%d,%d,%d}" % c for c in cases) + "};")
    lines.append(
        """  for (const auto& c : cases) {
    int jb0, jb1; kv_block_range(c[0], c[1], c[2], c[3], c[4], c[5], &jb0, &jb1);
    std::printf("R %d %d\\n", jb0, jb1);
    for (int jb = 0; jb * (int)B_c < c[2]; ++jb) std::printf("N %d\\n", (int)block_needs_mask(jb, c[0], c[1], c[2], c[3], c[4], c[5]));
    for (int i = c[0]; i < c[0] + (int)B_r && i < c[1]; ++i) { int lo, hi; score_row_range(i, c[2], c[3], c[4], c[5], &lo, &hi); std::printf("S %d %d\\n", lo, hi); }
  }
  return 0;
}"""
    )
    (tmp_path / "main.cpp").write_text("\n".join(lines))
    exe = tmp_path / "mask"
    res = subprocess.run([GXX, "-std=c++17", "-O1", "-x", "c++", "-DFLASHGEN_INDEX_ONLY", "main.cpp", "-o", str(exe)],
                         cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    got = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split("\n")
    want = []
    for q0, sq, sk, off, left, right in cases:
        b0, b1 = sm.block_range(q0, sq, sk, off, left, right)
        want.append(f"R {b0} {b1}")
        rows = range(q0, min(q0 + cfg.B_r, sq))
        for jb in range(-(-sk // cfg.B_c)):
            need = sm.block_needs_mask(jb, q0, sq, sk, off, left, right)
            want.append(f"N {int(need)}")
            cols = range(jb * cfg.B_c, (jb + 1) * cfg.B_c)
            all_kept = all(sm.keep(i, j, sk, off, left, right) for i in rows for j in cols)
            assert need or all_kept, f"block {jb} skips the mask but drops a score: {(q0, sq, sk, off, left, right)}"
            any_kept = any(sm.keep(i, j, sk, off, left, right) for i in rows for j in cols)
            if any_kept:
                assert b0 <= jb < b1, f"block {jb} holds kept scores but lies outside [{b0}, {b1})"
        for i in rows:
            lo, hi = sm.row_range(i, sk, off, left, right)
            want.append(f"S {lo} {hi}")
    assert got[: len(want)] == want


def _block_mask_rows(n_kb: int, count: int, seed: int) -> list[list[int]]:
    """Block-mask rows as ``<name>_mask_blocks`` makes them: random classes (empty ones frequent), then
    ``[lo, hi)`` of the non-empty blocks (``[0, 0)`` when none)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        classes = [int(c) for c in rng.choice(3, size=n_kb, p=(0.6, 0.2, 0.2))]
        kept = [kb for kb, c in enumerate(classes) if c]
        rows.append([kept[0] if kept else 0, kept[-1] + 1 if kept else 0] + classes)
    return rows


def test_emitted_block_mask_walk_equals_the_simulators(tmp_path):
    """``block_mask_clip`` and the walk ``block_mask_next`` makes from it, compiled for the host, equal
    :func:`flashgen.sim.block_mask.clip` / :func:`~flashgen.sim.block_mask.walk`, and the walk is exactly
    the blocks of ``[begin, end)`` the row does not call empty (a row without any: no block)."""
    import importlib.util
    import pathlib

    from flashgen.mods.kernel_mods import prepare_mods
    from flashgen.sim import block_mask as bm

    spec = importlib.util.spec_from_file_location("ex", pathlib.Path(__file__).resolve().parents[2] / "examples" / "mods.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    mods, _ = prepare_mods(mask_mod=ex.sliding_window_sinks())
    src = emit(KernelConfig(dtype="fp16", B_r=64, B_c=32, Q_mma_load_K_tiles=2), mods)
    # the block mask's functions as emitted (the mods' own C++ is device code: left out of the host build)
    start = src.text.index("// ---- block mask:")
    end = src.text.index("\n", src.text.index("bool block_mask_partial(", start))
    (tmp_path / "k.cu").write_text("#define __host__\n#define __device__\n#define __forceinline__ inline\n#include <stdint.h>\n"
                                   f"constexpr uint32_t B_r = 64, B_c = 32;\n{src.text[start:end]}\n")
    n_kb = 9
    rows = _block_mask_rows(n_kb, 60, seed=1) + [[0, 0] + [0] * n_kb]
    ranges = [(b, e) for b in range(n_kb + 1) for e in range(b, n_kb + 1)]
    lines = ["#include \"k.cu\"", "#include <cstdio>", "int main() {",
             f"  static const int rows[][{2 + n_kb}] = {{" + ", ".join("{" + ",".join(map(str, r)) + "}" for r in rows) + "};",
             "  static const int ranges[][2] = {" + ", ".join("{%d,%d}" % r for r in ranges) + "};",
             """  for (const auto& r : rows)
    for (const auto& g : ranges) {
      int b = g[0], e = g[1];
      block_mask_clip(r, &b, &e);
      std::printf("C %d %d W", b, e);
      for (int j = b; j < e; j = block_mask_next(r, j, e)) std::printf(" %d", j);
      std::printf("\\n");
    }
  int b = 2, e = 5;
  block_mask_clip(nullptr, &b, &e);
  std::printf("N %d %d %d\\n", b, e, block_mask_next(nullptr, 3, 5));
  return 0;
}"""]
    (tmp_path / "main.cpp").write_text("\n".join(lines))
    exe = tmp_path / "walk"
    res = subprocess.run([GXX, "-std=c++17", "-O1", "-x", "c++", "-DFLASHGEN_INDEX_ONLY", "main.cpp", "-o", str(exe)],
                         cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    got = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines()
    import numpy as np

    want = []
    for r, (b, e) in itertools.product(rows, ranges):
        row = np.array(r, np.int32)
        cb, ce = bm.clip(row, b, e)
        walk = bm.walk(row, b, e)
        assert walk == [j for j in range(b, e) if r[2 + j] != 0]  # every non-empty block of the range, nothing else
        assert (cb, ce) == ((walk[0], walk[-1] + 1) if walk else (cb, cb))
        want.append(f"C {cb} {ce} W" + "".join(f" {j}" for j in walk))
    want.append("N 2 5 4")
    assert got == want
