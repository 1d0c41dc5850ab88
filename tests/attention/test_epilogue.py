"""The epilogue's math (flashgen.attention.epilogue): its rendered C++, run on the host as one warp in
lockstep, equals its numpy evaluator bit for bit (row sums over the lanes, 1/l with the empty-row
policy, the LSE, O's normalisation), on random and edge inputs (empty rows, -inf maxima, tiny and
huge sums); both engines' kernels carry their plan's rule."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashgen.attention.epilogue import Epilogue, epilogue
from flashgen.attention.softmax import SCALE_ROW_CPP
from flashgen.dsl.config import KernelConfig, default_configs, kernel_progression
from flashgen.engines import emit, make_plan

from host_warp import GXX, LANES, HostWarp, build, needs_gxx  # tests/attention is on sys.path (pytest's prepend mode)

O_VALUES = 16
RULES = [Epilogue((1, 2), True), Epilogue((1, 2), False), Epilogue((1, 2), True, "nan"), Epilogue((4, 1, 16), True)]

DRIVER = r"""
constexpr int NO = %(no)d;
// per lane: row_max[2], row_sum[2], scale, NO values of O -> l[2], inv[2], lse[2], O / l
void lane_main(const float* in, char* out) {
    float row_max[2], row_sum[2], o[NO];
    row_max[0] = *in++; row_max[1] = *in++; row_sum[0] = *in++; row_sum[1] = *in++;
    const float scale = *in++;
    for (float& v : o) v = *in++;
    for (uint32_t h = 0; h < 2; ++h) {
        const float l = epilogue_row_sum(row_sum[h]);
        const float inv = epilogue_inv(l);
        scale_row(o, h, inv);
        out_f32(out, l); out_f32(out, inv); out_f32(out, epilogue_lse(row_max[h], l, scale));
    }
    for (float v : o) out_f32(out, v);
}
"""

f32 = np.float32


def background_builds(folder):
    """One host program per rule."""
    if GXX is None:
        return {}
    builds = {}
    for i, rule in enumerate(RULES):
        (folder / str(i)).mkdir()
        builds[str(i)] = build(folder / str(i), rule.to_cpp() + "\n" + SCALE_ROW_CPP, DRIVER % {"no": O_VALUES}, 5 + O_VALUES, 6 + O_VALUES)
    return builds


@pytest.fixture(scope="module", params=range(len(RULES)),
                ids=lambda i: f"lanes{'_'.join(map(str, RULES[i].lanes))}-{'exp2' if RULES[i].exp2 else 'expf'}-{RULES[i].empty_rows}")
def compiled(request, background):
    if GXX is None:
        pytest.skip("no host C++ compiler (g++) on PATH")
    return RULES[request.param], HostWarp(background.result(request.module, str(request.param)), 5 + O_VALUES, 6 + O_VALUES)


def evaluate(rule: Epilogue, row_max, row_sum, scale, o) -> np.ndarray:
    out = []
    for h in range(2):
        l = rule.row_sum(row_sum[:, h])
        inv = rule.inv(l)
        o = rule.normalize(o, h, inv)
        out += [l, inv, rule.lse(row_max[:, h], l, scale)]
    return np.concatenate([np.stack(out, axis=1), o], axis=1)


def _check(compiled, cases) -> None:
    rule, warp = compiled
    packed = [np.concatenate([m, s, np.full((LANES, 1), k, f32), o], axis=1) for m, s, k, o in cases]
    got = warp.run(np.stack(packed))
    for n, (m, s, k, o) in enumerate(cases):
        np.testing.assert_array_equal(got[n], evaluate(rule, m, s, k, o), err_msg=f"case {n}")


@st.composite
def cases(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    row_max = (rng.standard_normal((LANES, 2)) * draw(st.sampled_from([1.0, 100.0, 1e30]))).astype(f32)
    row_max[rng.random(row_max.shape) < 0.1] = -np.inf
    row_sum = (rng.random((LANES, 2)) * draw(st.sampled_from([1.0, 1e4, 1e-38, 1e37]))).astype(f32)
    row_sum[rng.random(row_sum.shape) < draw(st.sampled_from([0.0, 0.3]))] = 0  # lanes without a kept score
    scale = f32(draw(st.one_of(st.just(0.08838835), st.floats(1e-3, 10))))
    o = (rng.standard_normal((LANES, O_VALUES)) * 50).astype(f32)
    return row_max, row_sum, scale, o


@needs_gxx
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_host_compiled_epilogue_equals_the_evaluator(compiled, data):
    _check(compiled, [data.draw(cases()) for _ in range(3)])


@needs_gxx
def test_empty_rows(compiled):
    """A row no lane kept a score of: l = 0, O by the policy (0 or NaN), LSE -inf."""
    rule, _ = compiled
    row_max, row_sum = np.full((LANES, 2), -np.inf, f32), np.zeros((LANES, 2), f32)
    o = np.zeros((LANES, O_VALUES), f32)
    _check(compiled, [(row_max, row_sum, f32(0.1), o)])
    got = evaluate(rule, row_max, row_sum, f32(0.1), o)
    lse, out = got[:, [2, 5]], got[:, 6:]
    assert np.all(lse == -np.inf)
    assert np.all(out == 0) if rule.empty_rows == "zero" else np.all(np.isnan(out))


def test_lse_units_follow_the_softmax():
    """exp2 keeps the max in raw S units (the LSE scales it), expf in scaled units."""
    l = np.full(LANES, np.e, f32)
    m = np.full(LANES, 4.0, f32)
    assert np.allclose(Epilogue((1, 2), True).lse(m, l, 0.5), 3.0)
    assert np.allclose(Epilogue((1, 2), False).lse(m, l, 0.5), 5.0)


def test_rejects_an_unknown_empty_row_policy():
    with pytest.raises(ValueError, match="empty_rows"):
        Epilogue((1, 2), True, "ones")


@pytest.mark.parametrize("cfg", [default_configs()[0], kernel_progression()[0], KernelConfig.wgmma("fp16", persistent=True)], ids=str)
def test_kernels_carry_their_plans_rule(cfg):
    plan = make_plan(cfg)
    text = emit(cfg).text
    assert epilogue(plan).to_cpp() in text
    assert "epilogue_lse(" in text[text.index("__global__"):]
