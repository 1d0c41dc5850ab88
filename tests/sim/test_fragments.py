"""Fragments through the simulated MMA: S = Q K^T and O = P V bit-exact against numpy.

Reference and simulator both form each k16 step as fp32(acc + exact 16-term sum);
with the test data (|x| in [2^-6, ~5]) float64 holds those sums exactly, so the two
agree bit for bit unless the plan feeds the wrong elements to the MMA.
"""
from __future__ import annotations

import attrs
import numpy as np
import pytest

from flashgen.dsl.atoms.copy import SM2RF, ldmatrix_x4_rows_then_cols
from flashgen.dsl.config import ConfigError, default_configs, kernel_progression
from flashgen.dsl.notation import parse_config
from flashgen.dsl.plan import OperandLoad, make_plan
from flashgen.sim import fragments as fr
from flashgen.sim import hardware as hw

FIRST = kernel_progression()[0]

CONFIGS = [
    FIRST,  # not swizzled, everything loaded at once, Q resident
    kernel_progression()[4],  # 2-tile steps, register double buffering
    default_configs()[0],  # B_r=128, V whole, double buffered
    default_configs()[3],  # bf16, 2_2_2 + buffer
    parse_config("(BF16, 128, 128, 32, 8): async+eager+swizzled+load_0_2_2_tiles+opt_softmax"),
    parse_config("(FP16, 128, 64, 128, 4): async+eager+load_4_4_8_tiles+buffer"),
    parse_config("(BF16, 128, 64, 32, 4): swizzled+load_2_2_2_tiles"),  # synchronous copies
    FIRST.replace(d_head=64, B_c=32, swizzled=True),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_S_and_O_bit_exact(cfg):
    res = fr.check_fragments(make_plan(cfg))
    assert res["S"].ok, res["S"].detail
    assert res["O"].ok, res["O"].detail


def test_chunked_reference_is_numpy_product_for_exact_data():
    """Sanity: with small-integer data every sum is exact, so the reference is Q @ K^T itself."""
    rng = np.random.default_rng(0)
    a = rng.integers(-4, 5, (16, 64)).astype(np.float64)
    b = rng.integers(-4, 5, (64, 8)).astype(np.float64)
    assert np.array_equal(fr.chunked_reference(a, b), (a @ b).astype(np.float32))


def test_acc_matrix_round_trip():
    m = np.arange(32 * 64, dtype=np.float32).reshape(32, 64)
    acc = fr.matrix_to_acc(m)
    assert acc.shape == (2, 8, 32, 4)
    assert np.array_equal(fr.acc_to_matrix(acc), m)
    assert acc[1, 2, 5, 3] == m[16 + 9, 16 + 3]  # tile (1, 2), lane 5 reg 3 -> row 9, col 3 of the tile


# ---------------------------------------------------------------------- broken plans are caught


def _with_copy(plan, op, **changes):
    load = plan.s2r[op]
    return attrs.evolve(plan, s2r={**plan.s2r, op: attrs.evolve(load, copy=attrs.evolve(load.copy, **changes))})


def test_wrong_K_matrix_order_is_caught():
    """K with the A operand's matrix order: each warp still gets every K element once
    (coverage passes), but B registers 1 and 2 swap roles, so S is wrong."""
    plan = make_plan(FIRST)
    part = attrs.evolve(plan.s2r["K"].copy.partition, tv=ldmatrix_x4_rows_then_cols("ldsm_B?"))
    res = fr.check_S(_with_copy(plan, "K", partition=part))
    assert not res.ok and "differ" in res.detail


def test_V_without_trans_is_caught():
    plan = make_plan(FIRST)
    res = fr.check_O(_with_copy(plan, "V", atom=SM2RF(4, trans=False)))
    assert not res.ok and "differ" in res.detail


def test_wrong_b_register_roles_are_caught(monkeypatch):
    monkeypatch.setattr(OperandLoad, "b_operand_regs", staticmethod(lambda nt: (nt // 2, (2 * (nt % 2) + 1, 2 * (nt % 2)))))
    res = fr.check_fragments(make_plan(FIRST))
    assert not res["S"].ok and not res["O"].ok


def test_wrong_accumulator_reuse_is_caught(monkeypatch):
    monkeypatch.setattr(fr, "accumulator_as_a_operand", lambda n, reg: (reg % 2, 2 * (reg // 2)))
    assert not fr.check_O(make_plan(FIRST)).ok


def test_k_step_that_does_not_divide_B_c_is_caught():
    """B_c=48 with a V k step of 32 (4 tiles): 48 // 32 = 1 step would drop 16 keys per
    block (what the emitter's ``steps = B_c // k_step`` did before the config rules
    required the step to divide the reduction); the simulator refuses and says why."""
    plan = make_plan(parse_config("(FP16, 128, 128, 48, 4): async+load_2_2_2_tiles"))
    bad = attrs.evolve(plan, s2r={**plan.s2r, "V": attrs.evolve(plan.s2r["V"], k_step_tiles=4)})
    res = fr.check_O(bad)
    assert not res.ok and "does not divide the reduction length 48" in res.detail
    try:
        parse_config("(FP16, 128, 128, 48, 4): async+load_4_4_4_tiles")
    except ConfigError:
        return  # the rules reject it
    pytest.fail("a V k step of 32 with B_c=48 passes the config rules")


def test_mma_batch_agrees_with_single_calls():
    rng = np.random.default_rng(2)
    a = hw.encode(rng.standard_normal((3, 32, 4, 2)), "fp16")
    b = hw.encode(rng.standard_normal((3, 32, 2, 2)), "fp16")
    c = rng.standard_normal((3, 32, 4)).astype(np.float32)
    batch = hw.mma_m16n8k16(a, b, c, "fp16")
    for i in range(3):
        assert np.array_equal(batch[i], hw.mma_m16n8k16(a[i], b[i], c[i], "fp16"))
