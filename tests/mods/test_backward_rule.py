"""The backward's score rule as the emitters render it (``ScoreMask.to_cpp(backward=True)``, ``recompute_cpp``,
then ``bwd_prob``, ``bwd_dscore`` and ``score_grad_cpp``), compiled for the host, equals the numpy twin the
backward simulators run (:func:`flashgen.sim.backward_cta.backward_scores`: with mods the forward's
:meth:`ScoreMask.apply`; the Recompute rule at ``scale_log2`` = log2(e) with a score_mod;
:func:`~flashgen.sim.backward_cta.backward_dscores`: ScoreGrad, then :meth:`ScoreMask.score_grad`).

Per case a few hundred values, each with its own query row, key, batch, query head, sequence lengths and
built-in mask arguments (rows past seq_q and keys past seq_k in masked blocks), for every derivative kind
(``KernelMods.derivative_kind``: a bias, a function of the indices alone, a derivative of the indices, one
that reads the score, fused into the recompute as the emitters do) with and without a mask_mod. The mods'
values are filled from the launcher's words by the backward's fill lines.

Compared stage by stage from the same inputs: the recomputed score bit for bit, P within 1 ulp (the host's
exp2f against the model of ``ex2.approx``), dS from the C++'s own P bit for bit; a tanh-using score_mod
(softcap) within 4 ulp where tanh enters (glibc's tanhf and numpy's float32 tanh differ, see
tests/mods/test_examples.py), and its derivative 1 - tanh^2 within 8 ulp of 1 (relative to P (dP - D)).
"""
from __future__ import annotations

import importlib.util
import pathlib
import types

import numpy as np
import pytest
import torch

from flashgen.attention.backward import Recompute, ScoreGrad
from flashgen.attention.query_blocks import QueryBlocks
from flashgen.attention.score_mask import ScoreMask
from flashgen.dsl.config import LOG2E
from flashgen.mods.kernel_mods import prepare_mods
from flashgen.sim.backward_cta import BwdProblem, backward_dscores, backward_scores

from host import HEAD, _array as array, build_and_run, f32, needs_gxx, ulps, words_cpp  # tests/mods is on sys.path

pytestmark = needs_gxx

_spec = importlib.util.spec_from_file_location("flashgen_example_mods", pathlib.Path(__file__).resolve().parents[2] / "examples" / "mods.py")
EX = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(EX)

B_R, B_C, SCALE, N = 16, 16, 0.3, 320
_TABLE = torch.tensor([0.5, 1.5, -1.0, 2.0, 0.25, 1.0, -0.5])


def _by_table(score, b, h, q_idx, kv_idx):
    return score * _TABLE[(q_idx + 2 * kv_idx + h) % 7]


def _indices_only(score, b, h, q_idx, kv_idx):
    return (q_idx - kv_idx) * 0.25 + h * 1.0


def _by_side(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx >= kv_idx, score * 2.0, -score)


#: (built-in mask, score_mod, mask_mod, derivative kind): indices stay below 64, inside every example's tables
COMBOS = {
    "causal": ("causal", None, None, "one"),
    "alibi+window": ("window", EX.alibi(4), None, "one"),
    "relative_bias+document_mask": ("none", EX.relative_bias(64, seed=2), EX.document_mask((10, 17, 5, 40)), "one"),
    "prefix_lm+causal": ("causal", None, EX.prefix_lm(9), "one"),
    "indices_only": ("none", _indices_only, None, "zero"),
    "by_table+window": ("window", _by_table, None, "indices"),
    "by_side+sliding_window_sinks": ("none", _by_side, EX.sliding_window_sinks(5, 2), "indices"),
    "softcap+causal": ("causal", EX.softcap(2.0), None, "score"),
    "softcap+document_mask": ("none", EX.softcap(1.5), EX.document_mask((3, 30, 31)), "score"),
}


def _values(rng, sm: ScoreMask, mask_values: "dict | None" = None) -> dict:
    """Per value: (i, j, b, h, seq_q, seq_k, offset, left, right, masked) and the fp32 inputs s, lse, dp, D.
    An unmasked block (the built-in rule keeps it whole: no mask_mod) has no row past seq_q or key past seq_k.
    With a mask_mod, some values the built-in rule and the mask_mod keep are unmasked: items the block mask calls
    full (their own loop, without the mask_mod)."""
    n = lambda lo, hi: rng.integers(lo, hi, N).astype(np.int32)  # noqa: E731
    v = {"i": n(0, 44), "j": n(0, 52), "b": n(0, 2), "h": n(0, 4), "seq_q": n(1, 41), "seq_k": n(1, 49), "offset": n(-6, 7),
         "left": n(-1, 12), "right": n(-1, 12)}
    v["masked"] = np.array([sm.backward_masked(bool(x)) for x in rng.integers(0, 2, N)])
    plain = ~v["masked"]
    v["seq_q"][plain] = np.maximum(v["seq_q"][plain], v["i"][plain] + 1)
    v["seq_k"][plain] = np.maximum(v["seq_k"][plain], v["j"][plain] + 1)
    for name, scale in (("s", 6.0), ("lse", 2.0), ("dp", 1.0), ("D", 1.0)):
        v[name] = (scale * rng.standard_normal(N)).astype(np.float32)
    if sm.mask_mod is not None:
        for n in np.flatnonzero(rng.integers(0, 2, N)):
            at = {k: int(v[k][n]) for k in _INT_FIELDS[:-1]}
            v["masked"][n] = not sm.keep_scores(np.array([at["i"]]), np.array([at["j"]]), True, at["b"], at["h"], at["seq_q"], at["seq_k"],
                                          (at["offset"], at["left"], at["right"]), (None, mask_values))[0]
    return v


_INT_FIELDS = ("i", "j", "b", "h", "seq_q", "seq_k", "offset", "left", "right", "masked")


def _source(sm: ScoreMask, words: list[str], n_words: int, v: dict) -> str:
    fused = sm.derivative_reads_score
    grad = "g" if fused else ""
    body = ["float g = 0.f; (void)g;  // d score_mod / d score (kept from the recompute where it reads the score)",
            # as the emitters place it: without a mask_mod, an unmasked item's variant apart (backward_items_cpp)
            *sm.backward_items_cpp(lambda lines: lines, lambda masked: sm.recompute_cpp("s", "qi", "key", "batch", "head", "g", masked)),
            "const float prob = bwd_prob(s, p.scale_log2, bwd_lse_log2(lse));",
            "float ds = bwd_dscore(prob, dpv, dd);",
            *sm.score_grad_cpp("ds", "prob", "qi", "key", "batch", "head", grad),
            "out[0] = s; out[1] = prob; out[2] = ds;"]
    ints = np.stack([v[k].astype(np.int64) for k in _INT_FIELDS], axis=1)
    floats = np.stack([v[k] for k in ("s", "lse", "dp", "D")], axis=1)
    return f"""{HEAD}
constexpr uint32_t B_r = {B_R}, B_c = {B_C};
{sm.to_cpp(backward=True)}
{Recompute().to_cpp()}
{ScoreGrad().to_cpp()}
struct Params {{
    int seq_q, seq_k, mask_offset, window_left, window_right; float scale, scale_log2;
{chr(10).join('    ' + l for l in sm.params_cpp(backward=True))}
}};
struct Args {{ const long long* mod_words; int n_mod_words; float softmax_scale; const int* block_mask; int seq_q = 1, seq_k = 1; }};
static int fill(Params& p, const Args* a) {{
    p.scale = a->softmax_scale; p.scale_log2 = a->softmax_scale * {LOG2E!r}f;  // the launch's, before the mods' lines
{chr(10).join('    ' + l for l in (sm.fill_cpp(backward=True)))}
    return 0;
}}
static void value(const Params& p, bool masked, int qi, int key, int batch, int head, float s, float lse, float dpv, float dd,
                  float* out) {{
    (void)masked; (void)batch; (void)head;
{chr(10).join('    ' + l for l in body)}
}}
{chr(10).join(words)}
{array("ints", "int", ints.ravel())}
{array("floats", "float", floats.ravel())}
int main() {{
    for (int n = 0; n < {N}; ++n) {{
        const int* c = ints + {len(_INT_FIELDS)} * n;
        const float* f = floats + 4 * n;
        Params p{{}};
        const Args a{{words, {n_words}, {f32(SCALE)}, nullptr}};
        if (fill(p, &a)) return 2;
        p.seq_q = c[4]; p.seq_k = c[5]; p.mask_offset = c[6]; p.window_left = c[7]; p.window_right = c[8];
        float out[3];
        value(p, c[9] != 0, c[0], c[1], c[2], c[3], f[0], f[1], f[2], f[3], out);
        for (int k = 0; k < 3; ++k) {{ unsigned u; std::memcpy(&u, out + k, 4); std::printf("%u\\n", u); }}
    }}
    return 0;
}}
"""


def _numpy(sm: ScoreMask, v: dict, values: tuple, prob_cpp: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The simulators' twin (:func:`backward_scores`, the Recompute rule, :func:`backward_dscores`), value by
    value: the recomputed score, P, and dS from the C++'s P."""
    plan = types.SimpleNamespace(score_mask=sm, query_blocks=QueryBlocks(sm), score_grad=ScoreGrad())
    y, ds = np.empty(N, np.float32), np.empty(N, np.float32)
    for n in range(N):
        one = lambda k: v[k][n:n + 1]  # noqa: E731
        prob = BwdProblem(int(v["seq_q"][n]), int(v["seq_k"][n]), 0, *(int(v[k][n]) for k in ("offset", "left", "right")),
                          b=int(v["b"][n]), h0=0, mod_values=values)
        head, ij = int(v["h"][n]), (one("i"), one("j"))
        y[n] = backward_scores(plan, prob, one("s"), *ij, head, bool(v["masked"][n]), SCALE)[0]
        ds[n] = backward_dscores(plan, prob, prob_cpp[n:n + 1], one("dp"), one("D"), one("s"), *ij, head, SCALE)[0]
    rec = Recompute()
    prob = rec.evaluate(y, rec.scale_log2(1.0 if sm.score_mod is not None else SCALE), rec.lse_log2(v["lse"]))
    return y, prob, ds


@pytest.mark.parametrize("combo", list(COMBOS))
def test_rendered_backward_rule_equals_numpy(combo, tmp_path):
    kind, score_fn, mask_fn, derivative = COMBOS[combo]
    mods, (sa, ma) = prepare_mods(score_fn, mask_fn) if score_fn or mask_fn else (None, (None, None))
    sm = ScoreMask(kind, B_R, B_C, mods)
    assert (mods.derivative_kind if mods is not None else "one") == derivative
    v = _values(np.random.default_rng(len(combo)), sm, ma.values() if ma else None)
    assert (~v["masked"]).any()  # both loops reached (with a mask_mod: full items', without it)
    words, n_words = words_cpp(mods, sa, ma) if mods is not None else (["static const long long* words = nullptr;"], 0)
    got = np.array(build_and_run(tmp_path, _source(sm, words, n_words, v)), dtype=np.uint64).astype(np.uint32).view(np.float32)
    y_cpp, prob_cpp, ds_cpp = got.reshape(N, 3).T
    values = (sa.values() if sa else None, ma.values() if ma else None)
    y, prob, ds = _numpy(sm, v, tuple({} if x is None else x for x in values), prob_cpp)
    tanh = score_fn is not None and "tanh" in mods.score.canonical
    assert (np.isneginf(y) == np.isneginf(y_cpp)).all()
    assert ulps(y_cpp, y).max() <= (4 if tanh else 0)
    if tanh:  # P = 2^(y log2e - lse log2e): a few ulp of y move P by up to |y log2e| times as many
        np.testing.assert_allclose(prob_cpp, prob, rtol=2e-6, atol=0)
    else:
        assert ulps(prob_cpp, prob).max() <= 1
    plain = ScoreGrad().evaluate(prob_cpp, v["dp"], v["D"])
    if tanh and derivative == "score":  # 1 - t^2 from t within 4 ulp: off by at most 8 ulp of 1, times P (dP - D)
        assert (np.abs(ds_cpp - ds) <= 2.0 ** -20 * np.abs(plain)).all()
    else:
        assert ulps(ds_cpp, ds).max() == 0
    # the cases reach the mask and the chain rule
    assert np.isneginf(y).any() and (prob > 0).any()
    kept = prob_cpp != 0
    assert (ds_cpp[kept] == 0).all() if derivative == "zero" else (ds_cpp[kept] != 0).any()
    assert np.array_equal(ds_cpp[kept], plain[kept]) == (derivative == "one")
