"""The online softmax rule (flashgen.attention.softmax): its rendered C++, run on the host as one
warp in lockstep, equals its numpy evaluator bit for bit on random and edge inputs (fully masked
rows, -inf, large magnitudes, the first block); the reduction order is the documented one; both
engines' kernels carry the rule of their plan."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashgen.attention.softmax import OnlineSoftmax, online_softmax, scale_row
from flashgen.dsl.config import KernelConfig, default_configs, kernel_progression
from flashgen.engines import emit, make_plan

from host_warp import GXX, LANES, HostWarp, build, needs_gxx  # tests/attention is on sys.path (pytest's prepend mode)

BLOCKS = 3  # key blocks per case: the first may be a row's first
O_VALUES = 12  # an O fragment of 3 chunks

#: the shipped plans' rules (mma.sync exp2 and expf, wgmma B_c 128 and 176) and two of other shapes
RULES = [
    online_softmax(make_plan(default_configs()[0])),
    online_softmax(make_plan(kernel_progression()[0])),
    online_softmax(make_plan(KernelConfig.wgmma("fp16"))),
    online_softmax(make_plan(KernelConfig.wgmma("fp16", B_c=176))),
    OnlineSoftmax(3, (4, 1), True),
    OnlineSoftmax(1, (8,), False),
]

DRIVER = r"""
constexpr int N = 4 * SOFTMAX_CHUNKS, NO = %(no)d, BLOCKS = %(blocks)d;
// per lane: BLOCKS x N scores, NO values of O, row_max[2], row_sum[2], k, first (0/1)
void lane_main(const float* in, char* out) {
    float s[BLOCKS][N], o[NO], row_max[2], row_sum[2];
    for (auto& blk : s) for (float& v : blk) v = *in++;
    for (float& v : o) v = *in++;
    row_max[0] = *in++; row_max[1] = *in++; row_sum[0] = *in++; row_sum[1] = *in++;
    const float k = *in++;
    const bool first = *in++ != 0.f;
    for (int b = 0; b < BLOCKS; ++b) {
        for (uint32_t h = 0; h < 2; ++h) {
            const bool fresh = first && b == 0;  // the caller's rule: a row's first block leaves O alone
            float neg_m;
            const float corr = softmax_max_step(s[b], h, row_max[h], k, neg_m);
            if (!fresh) scale_row(o, h, corr);
            softmax_exp_step(s[b], h, row_sum[h], k, neg_m, corr, fresh);
            out_f32(out, corr);
        }
        for (float v : s[b]) out_f32(out, v);
        for (uint32_t h = 0; h < 2; ++h) { out_f32(out, row_max[h]); out_f32(out, row_sum[h]); }
    }
    for (float v : o) out_f32(out, v);
}
"""


def _n_in(rule: OnlineSoftmax) -> int:
    return BLOCKS * rule.values + O_VALUES + 6


def _n_out(rule: OnlineSoftmax) -> int:
    return BLOCKS * (2 + rule.values + 4) + O_VALUES


def background_builds(folder):
    """One host program per rule."""
    if GXX is None:
        return {}
    builds = {}
    for i, rule in enumerate(RULES):
        (folder / str(i)).mkdir()
        builds[str(i)] = build(folder / str(i), rule.to_cpp(), DRIVER % {"no": O_VALUES, "blocks": BLOCKS}, _n_in(rule), _n_out(rule))
    return builds


@pytest.fixture(scope="module", params=range(len(RULES)),
                ids=lambda i: f"chunks{RULES[i].chunks}-lanes{'_'.join(map(str, RULES[i].lanes))}-{'exp2' if RULES[i].exp2 else 'expf'}")
def compiled(request, background):
    if GXX is None:
        pytest.skip("no host C++ compiler (g++) on PATH")
    rule = RULES[request.param]
    return rule, HostWarp(background.result(request.module, str(request.param)), _n_in(rule), _n_out(rule))


def evaluate(rule: OnlineSoftmax, s, o, row_max, row_sum, k, first) -> np.ndarray:
    """The driver's walk with the numpy evaluators: ``[32, n_out]`` for one case."""
    out = []
    row_max, row_sum = row_max.copy(), row_sum.copy()
    for b in range(BLOCKS):
        p, corrs = s[b], []
        fresh = first and b == 0
        for h in range(2):
            p, row_max[:, h], row_sum[:, h], corr = rule.update(p, h, row_max[:, h], row_sum[:, h], k, fresh)
            if not fresh:
                o = scale_row(o, h, corr)
            corrs.append(corr)
        stats = np.stack([row_max[:, 0], row_sum[:, 0], row_max[:, 1], row_sum[:, 1]], axis=1)
        out += [np.stack(corrs, axis=1), p, stats]
    return np.concatenate(out + [o], axis=1)


def _pack(rule, s, o, row_max, row_sum, k, first) -> np.ndarray:
    lanes = [s.transpose(1, 0, 2).reshape(LANES, -1), o, row_max, row_sum,
             np.full((LANES, 1), k, np.float32), np.full((LANES, 1), float(first), np.float32)]
    return np.concatenate(lanes, axis=1).astype(np.float32)


def _check(compiled, cases) -> None:
    rule, warp = compiled
    got = warp.run(np.stack([_pack(rule, *c) for c in cases]))
    for n, case in enumerate(cases):
        want = evaluate(rule, *case)
        np.testing.assert_array_equal(got[n], want, err_msg=f"case {n}")


# ---- inputs ------------------------------------------------------------------------------------

f32 = np.float32
SPECIAL = np.array([-np.inf, 0.0, -0.0, 1e30, -1e30, 3.0e38, -3.0e38, 1e-40, 88.0, -88.0], f32)


@st.composite
def cases(draw, rule: OnlineSoftmax):
    """One case: scores of every lane and block (random at a drawn magnitude, with -inf and special
    values sprinkled in and whole rows masked), O, the row state (fresh when ``first``), ``k``."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    magnitude = draw(st.sampled_from([1.0, 30.0, 1e4, 1e30]))
    s = (rng.standard_normal((BLOCKS, LANES, rule.values)) * magnitude).astype(f32)
    s[rng.random(s.shape) < draw(st.sampled_from([0.0, 0.1, 0.9]))] = -np.inf
    spots = rng.random(s.shape) < draw(st.sampled_from([0.0, 0.05]))
    s[spots] = rng.choice(SPECIAL, spots.sum())
    # whole rows masked in some blocks: every value of row half h in every lane
    for b, h in draw(st.lists(st.tuples(st.integers(0, BLOCKS - 1), st.integers(0, 1)), max_size=3)):
        s[b][:, [4 * c + 2 * h + e for c in range(rule.chunks) for e in range(2)]] = -np.inf
    o = (rng.standard_normal((LANES, O_VALUES)) * 10).astype(f32)
    first = draw(st.booleans())
    if first:  # a fresh row: nothing seen yet
        row_max, row_sum = np.full((LANES, 2), -np.inf, f32), np.zeros((LANES, 2), f32)
    else:
        row_max = (rng.standard_normal((LANES, 2)) * magnitude).astype(f32)
        row_max[rng.random(row_max.shape) < 0.2] = -np.inf
        row_sum = (rng.random((LANES, 2)) * 1e4).astype(f32)
    k = draw(st.one_of(st.just(0.08838835 * 1.442695), st.floats(1e-3, 20)))
    return s, o, row_max, row_sum, f32(k), first


@needs_gxx
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_host_compiled_update_equals_the_evaluator(compiled, data):
    rule, _ = compiled
    _check(compiled, [data.draw(cases(rule)) for _ in range(3)])


@needs_gxx
def test_edge_rows(compiled):
    """A row masked in its first block (p = 0, sum 0, max -inf), then kept scores; huge scores; a
    row whose max moves up in a later block."""
    rule, _ = compiled
    n = rule.values
    s = np.zeros((BLOCKS, LANES, n), f32)
    s[0] = -np.inf
    s[1] = np.linspace(-5, 5, LANES * n, dtype=f32).reshape(LANES, n)
    s[2] = 3.0e38
    fresh = (np.full((LANES, 2), -np.inf, f32), np.zeros((LANES, 2), f32))
    o = np.ones((LANES, O_VALUES), f32)
    _check(compiled, [(s, o, *fresh, f32(0.127), True), (s[::-1].copy(), o, *fresh, f32(0.127), True),
                      (s, o, *fresh, f32(1.0), False)])


# ---- the rule's properties (evaluator only) ------------------------------------------------------


def test_tree_order_is_the_balanced_one():
    """Sums run as a balanced tree in column order: 2^24 + 1 + 1 + 1 gives 2^24 + 2 (left to right
    would give 2^24)."""
    rule = OnlineSoftmax(2, (1, 2))
    p = np.zeros((1, 8), f32)
    p[0, [0, 1, 4, 5]] = [2.0**24, 1, 1, 1]
    assert rule.thread_sum(p, 0)[0] == 2.0**24 + 2
    assert rule.thread_sum(p, 1)[0] == 0


@pytest.mark.parametrize("exp2", [True, False])
def test_first_block_skip_changes_nothing_on_a_fresh_row(exp2):
    """Why the first block may skip the rescale: a fresh row's factor only scales zeros."""
    rule = OnlineSoftmax(4, (1, 2), exp2)
    rng = np.random.default_rng(0)
    s = rng.standard_normal((LANES, rule.values)).astype(f32)
    s[:8] = -np.inf  # rows with nothing kept yet
    fresh = np.full(LANES, -np.inf, f32), np.zeros(LANES, f32)
    a = rule.update(s, 0, *fresh, f32(0.2), True)
    b = rule.update(s, 0, *fresh, f32(0.2), False)
    for x, y in zip(a[:3], b[:3]):
        np.testing.assert_array_equal(x, y)
    assert np.all(b[3] == 0)  # the factor a caller would have applied to the (zero) O


def test_masked_row_gives_zero_probabilities_and_no_nan():
    rule = OnlineSoftmax(2, (1, 2))
    s = np.full((LANES, 8), -np.inf, f32)
    p, m, l, corr = rule.update(s, 1, np.full(LANES, -np.inf, f32), np.zeros(LANES, f32), f32(0.1), False)
    assert np.all(p[:, [2, 3, 6, 7]] == 0) and np.all(m == -np.inf) and np.all(l == 0)
    assert not np.isnan(corr).any()


# ---- the engines carry their plan's rule ---------------------------------------------------------


@pytest.mark.parametrize("cfg", [default_configs()[0], kernel_progression()[0], KernelConfig.wgmma("bf16", B_c=176)], ids=str)
def test_kernels_carry_their_plans_rule(cfg):
    plan = make_plan(cfg)
    text = emit(cfg).text
    assert online_softmax(plan).to_cpp() in text
    kernel = text[text.index("__global__"):]
    assert "softmax_max_step(" in kernel and "softmax_exp_step(" in kernel
