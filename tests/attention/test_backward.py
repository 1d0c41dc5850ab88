"""The backward's element-wise rules (flashgen.attention.backward): the C++ the kernels are emitted
with, compiled for the host, agrees with the numpy evaluation the simulator runs; and the rules
compute the gradient's terms."""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from flashgen.attention.backward import Recompute, RowDot, ScoreGrad

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to run the emitted C++ rule")
HOST = "#define __host__\n#define __device__\n#define __forceinline__ inline\n"  # the kernel's qualifiers, for g++


def _run_cpp(tmp_path, rules: str, main: str, stdin: str) -> np.ndarray:
    """Compile ``rules`` + ``main`` for the host, feed ``stdin``; the printed fp32 bit patterns."""
    src = tmp_path / "rule.cpp"
    src.write_text("#include <math.h>\n#include <stdio.h>\n#include <stdint.h>\n#include <string.h>\n" + HOST + rules
                   + "\nstatic float rd() { uint32_t u; if (scanf(\"%u\", &u) != 1) return 0; float f; memcpy(&f, &u, 4); return f; }\n"
                   + "static void wr(float f) { uint32_t u; memcpy(&u, &f, 4); printf(\"%u\\n\", u); }\n"
                   + "int main() {\n" + main + "    return 0;\n}\n")
    exe = tmp_path / "rule"
    subprocess.run(["g++", "-std=c++17", "-O1", "-ffp-contract=off", "-Wall", "-Werror", "-Wno-unused-function", "-o", str(exe), str(src)],
                   check=True)
    out = subprocess.run([str(exe)], input=stdin, check=True, capture_output=True, text=True).stdout
    return np.array([int(x) for x in out.split()], dtype=np.uint32).view(np.float32)


def _words(x: np.ndarray) -> str:
    return " ".join(str(int(u)) for u in np.asarray(x, np.float32).ravel().view(np.uint32))


def _ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    ia = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
    ib = np.asarray(b, np.float32).view(np.int32).astype(np.int64)
    return np.abs(ia - ib)


@needs_gxx
@pytest.mark.parametrize("d", [8, 40, 64, 128, 200])
def test_emitted_row_dot_partials_agree_with_numpy(tmp_path, d):
    """Every lane's fmaf partial of D = rowsum(dO * O), bit for bit, for head sizes with empty lanes
    (d < lanes * vec) and ragged last chunks."""
    rule = RowDot()
    rng = np.random.default_rng(d)
    rows = 5
    do = rng.standard_normal((rows, d)).astype(np.float32)
    o = rng.standard_normal((rows, d)).astype(np.float32)
    main = (f"    static float a[{d}], b[{d}];\n    for (int r = 0; r < {rows}; ++r) {{\n"
            f"        for (int c = 0; c < {d}; ++c) a[c] = rd();\n        for (int c = 0; c < {d}; ++c) b[c] = rd();\n"
            f"        for (int l = 0; l < ROWDOT_LANES; ++l) wr(rowdot_partial(a, b, l, {d}));\n    }}\n")
    stdin = " ".join(_words(do[r]) + " " + _words(o[r]) for r in range(rows))
    got = _run_cpp(tmp_path, rule.to_cpp(), main, stdin).reshape(rows, rule.lanes)
    assert np.array_equal(got.view(np.uint32), rule.partials(do, o).view(np.uint32))


def test_row_dot_is_the_row_sum_of_products():
    rule = RowDot(lanes=4, vec=8)
    rng = np.random.default_rng(1)
    do, o = rng.standard_normal((7, 72)).astype(np.float32), rng.standard_normal((7, 72)).astype(np.float32)
    want = (do.astype(np.float64) * o).sum(axis=1)
    np.testing.assert_allclose(rule.evaluate(do, o), want, rtol=1e-5, atol=1e-5)
    assert rule.masks == (2, 1)
    with pytest.raises(ValueError, match="lanes=6"):
        RowDot(lanes=6)


def _scores(rng, n):
    s = (rng.standard_normal(n) * 4).astype(np.float32)
    s[::7] = -np.inf  # masked scores
    lse = (rng.standard_normal(n) * 3).astype(np.float32)
    lse[::11] = -np.inf  # rows without a kept key
    return s, lse


@needs_gxx
def test_emitted_recompute_agrees_with_numpy(tmp_path):
    """bwd_lse_log2 bit for bit; bwd_prob within 1 ulp (the host's exp2f against the correctly
    rounded 2^x the simulator models ex2.approx with); 0 for masked scores and empty rows."""
    rule = Recompute()
    rng = np.random.default_rng(2)
    n = 400
    s, lse = _scores(rng, n)
    scale_log2 = rule.scale_log2(0.125)
    main = (f"    for (int i = 0; i < {n}; ++i) {{ const float s = rd(), lse = rd(); const float l2 = bwd_lse_log2(lse);\n"
            f"        wr(l2); wr(bwd_prob(s, {float(scale_log2)!r}f, l2)); }}\n")
    got = _run_cpp(tmp_path, rule.to_cpp(), main, " ".join(f"{_words(a)} {_words(b)}" for a, b in zip(s, lse))).reshape(n, 2)
    l2 = rule.lse_log2(lse)
    assert np.array_equal(got[:, 0].view(np.uint32), l2.view(np.uint32))
    p = rule.evaluate(s, scale_log2, l2)
    assert (_ulps(got[:, 1], p) <= 1).all()
    assert (p[np.isneginf(s) | np.isneginf(lse)] == 0).all()


def test_recompute_gives_the_softmax():
    """P from the row's lse equals softmax(scale * S) over the kept keys."""
    rng = np.random.default_rng(3)
    s = (rng.standard_normal((6, 40)) * 3).astype(np.float32)
    s[:, 30:] = -np.inf
    scale = 0.2
    x = scale * s.astype(np.float64)
    lse = np.log(np.exp(x).sum(axis=1))
    rule = Recompute()
    p = rule.evaluate(s, rule.scale_log2(scale), rule.lse_log2(lse.astype(np.float32)[:, None]))
    np.testing.assert_allclose(p, np.exp(x - lse[:, None]), rtol=2e-6, atol=1e-7)


@needs_gxx
def test_emitted_score_grad_agrees_with_numpy(tmp_path):
    rule = ScoreGrad()
    rng = np.random.default_rng(4)
    n = 300
    p, dp, d = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    main = (f"    for (int i = 0; i < {n}; ++i) {{ const float p = rd(), dp = rd(), d = rd();\n"
            f"        wr(bwd_dscore(p, dp, d)); wr(bwd_grad_scaled(dp, 0.3f)); }}\n")
    got = _run_cpp(tmp_path, rule.to_cpp(), main, " ".join(f"{_words(a)} {_words(b)} {_words(c)}" for a, b, c in zip(p, dp, d)))
    got = got.reshape(n, 2)
    assert np.array_equal(got[:, 0].view(np.uint32), rule.evaluate(p, dp, d).view(np.uint32))
    assert np.array_equal(got[:, 1].view(np.uint32), rule.scaled(dp, np.float32(0.3)).view(np.uint32))
