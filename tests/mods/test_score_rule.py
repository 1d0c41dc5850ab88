"""The per-value score rule both forward emitters place around the S GEMM (``ScoreMask.bits_cpp`` and
``init_cpp`` before it, the GEMM adding onto the accumulator where ``s_gemm_adds_cpp`` says so, then
``apply_cpp``), compiled for the host, equals its numpy twin ``ScoreMask.apply(..., forward=True)`` bit for bit (a
tanh-using score_mod within 4 ulp: glibc's tanhf and numpy's float32 tanh differ, see tests/mods/test_examples.py).

One fragment per case: 4 threads x 4 rows x (B_c / 8 n tiles x 2 values), thread ``l`` holding the
columns ``2 l + 8 t + e`` of the block as the MMA C maps do; rows run past seq_q and columns past
seq_k; masked and unmasked blocks; the built-in masks x the example mods, the mods' values filled
from the launcher's words by the emitted fill lines.
"""
from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest

from flashgen.attention.score_mask import ScoreMask
from flashgen.mods.kernel_mods import prepare_mods

from host import HEAD, _array as array, build_and_run, f32, needs_gxx, ulps, words_cpp  # tests/mods is on sys.path

pytestmark = needs_gxx

_spec = importlib.util.spec_from_file_location("flashgen_example_mods", pathlib.Path(__file__).resolve().parents[2] / "examples" / "mods.py")
EX = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(EX)

B_R, B_C, ROWS, LANES = 16, 16, 4, 4
SCALE = 0.125

#: (built-in mask, score_mod, mask_mod): indices stay below 64, inside every example's tables
COMBOS = {
    "none": ("none", None, None),
    "causal": ("causal", None, None),
    "softcap": ("none", EX.softcap(3.0), None),
    "alibi+causal": ("causal", EX.alibi(4), None),
    "relative_bias+window": ("window", EX.relative_bias(64, seed=2), None),
    "document_mask": ("none", None, EX.document_mask((10, 17, 5, 40))),
    "prefix_lm+window": ("window", None, EX.prefix_lm(9)),
    "alibi+document_mask+causal": ("causal", EX.alibi(4), EX.document_mask((3, 30, 31))),
    "softcap+sliding_window_sinks": ("none", EX.softcap(2.0), EX.sliding_window_sinks(5, 2)),
}


def _cases(rng, n=48):
    """(q_row0, j, seq_q, seq_k, offset, left, right, b, h, masked) rows."""
    out = []
    for _ in range(n):
        q_row0, j = int(rng.integers(0, 44)), int(rng.integers(0, 3))
        seq_q = int(rng.integers(max(1, q_row0 - 2), q_row0 + ROWS + 3))
        seq_k = int(rng.integers(1, 3 * B_C + 1))
        out.append((q_row0, j, seq_q, seq_k, int(rng.integers(-6, 7)), int(rng.integers(-1, 9)), int(rng.integers(-1, 9)),
                    int(rng.integers(0, 2)), int(rng.integers(0, 4)), int(rng.integers(0, 2))))
    return out


def _source(sm: ScoreMask, fill: list[str], words: list[str], n_words: int, cases, scores) -> str:
    # each lane (a thread's first column, 2 lane) in turn, as the kernels' threads: the rows loop inside
    where = dict(loops=[f"for (uint32_t r = 0; r < {ROWS}; ++r)"],
                 i="q_row0 + int(r)", c0="j * int(B_c) + int(2 * lane)", b="bb", h="hh")
    # the GEMM's part: the raw scores onto where the accumulator starts (0 unless init_cpp put a bias there)
    gemm = ["for (uint32_t v = 0; v < sizeof(Frag) / 4; ++v)",
            f"    if ({sm.s_gemm_adds_cpp()}) (&acc[0][0][0][0])[v] += (&start[0][0][0][0])[v];"]
    rule = (sm.bits_cpp(bits="mask_bits[lane][r]", **where) + sm.init_cpp(value="start[lane][r][{t}][e]", **where)
            + ["}"] + gemm + ["for (uint32_t lane = 0; lane < 4; ++lane) {"]
            + sm.apply_cpp(value="acc[lane][r][{t}][e]", bits="mask_bits[lane][r]", **where))
    lanes = ["for (uint32_t lane = 0; lane < 4; ++lane) {"] + ["    " + l for l in rule] + ["}"]
    tile = sm.bias_tile_cpp("bb", "hh")  # the tile's values of a bias, as the emitters place them
    body = "\n".join("    " + l for l in [f"uint64_t mask_bits[4][{ROWS}];", "(void)mask_bits;", "Frag start{};"] + tile + lanes)
    return f"""{HEAD}
constexpr uint32_t B_r = {B_R}, B_c = {B_C};
{sm.to_cpp()}
struct Params {{
    int seq_q, seq_k, mask_offset, window_left, window_right; float scale, scale_log2;
{chr(10).join('    ' + l for l in sm.params_cpp())}
}};
struct Args {{ const long long* mod_words; int n_mod_words; float softmax_scale; const int* block_mask; int seq_q = 1, seq_k = 1; }};
static int fill(Params& p, const Args* a) {{
    (void)a;
{chr(10).join('    ' + l for l in fill)}
    return 0;
}}
using Frag = float[{LANES}][{ROWS}][B_c / 8][2];
template <class M> void rule(const Params& p, M masked, int q_row0, int j, int bb, int hh, Frag& acc) {{
    (void)bb; (void)hh;
{body}
}}
{chr(10).join(words)}
{array("cases", "int", np.array(cases).ravel())}
{array("scores", "float", scores.ravel())}
int main() {{
    for (int n = 0; n < {len(cases)}; ++n) {{
        const int* c = cases + 10 * n;
        Params p{{}};
        const Args a{{words, {n_words}, {f32(SCALE)}, nullptr}};
        if (fill(p, &a)) return 2;
        p.seq_q = c[2]; p.seq_k = c[3]; p.mask_offset = c[4]; p.window_left = c[5]; p.window_right = c[6];
        Frag acc;
        std::memcpy(acc, scores + n * sizeof(Frag) / 4, sizeof acc);
        if (c[9]) rule(p, std::true_type{{}}, c[0], c[1], c[7], c[8], acc);
        else rule(p, std::false_type{{}}, c[0], c[1], c[7], c[8], acc);
        for (int v = 0; v < int(sizeof(Frag) / 4); ++v) {{ unsigned u; std::memcpy(&u, &acc[0][0][0][0] + v, 4); std::printf("%u\\n", u); }}
    }}
    return 0;
}}
"""


@pytest.mark.parametrize("combo", list(COMBOS))
def test_rendered_rule_equals_numpy(combo, tmp_path):
    kind, score_fn, mask_fn = COMBOS[combo]
    mods, (sa, ma) = prepare_mods(score_fn, mask_fn) if score_fn or mask_fn else (None, (None, None))
    sm = ScoreMask(kind, B_R, B_C, mods)
    rng = np.random.default_rng(len(combo))
    cases = _cases(rng)
    scores = (4 * rng.standard_normal((len(cases), LANES, ROWS, B_C // 8, 2))).astype(np.float32)
    words, n_words = words_cpp(mods, sa, ma) if mods is not None else (["static const long long* words = nullptr;"], 0)
    got = np.array(build_and_run(tmp_path, _source(sm, sm.fill_cpp(), words, n_words, cases, scores)), dtype=np.uint64)
    got = got.astype(np.uint32).view(np.float32).reshape(scores.shape)
    lane, r, t, e = np.ix_(*(np.arange(n) for n in scores.shape[1:]))
    values = (sa.values() if sa else None, ma.values() if ma else None)
    want = np.empty_like(scores)
    for n, (q_row0, j, seq_q, seq_k, off, left, right, b, h, masked) in enumerate(cases):
        want[n] = sm.apply(scores[n], q_row0 + r, j * B_C + 2 * lane + 8 * t + e, bool(masked), b=b, h=h, seq_q=seq_q,
                           seq_k=seq_k, mask_args=(off, left, right), mod_values=values, scale=SCALE, forward=True)
    assert (np.isneginf(want) == np.isneginf(got)).all()
    if score_fn is not None and "tanh" in mods.score.canonical:
        assert ulps(got, want).max() <= 4
    else:
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.isneginf(want).any() or kind == "none" and mask_fn is None  # the cases reach the mask
