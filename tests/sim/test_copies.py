"""Copy traces: agreement with the plan objects, coverage for every seed config, bank conflicts."""
from __future__ import annotations

import attrs
import numpy as np
import pytest

from flashgen.dsl.atoms.copy import ldmatrix_x4_rows_then_cols
from flashgen.dsl.config import kernel_progression, tuning_space
from flashgen.dsl.layout import Layout
from flashgen.dsl.notation import parse_config
from flashgen.dsl.plan import make_plan
from flashgen.dsl.tiling import TVMap
from flashgen.sim.copies import check_copy, coverage, smem_bases, trace_copy, trace_plan, wavefronts

SEED_CONFIGS = list(dict.fromkeys(tuning_space() + kernel_progression(all_block_sizes=True)))
FIRST = kernel_progression()[0]  # (FP16, 128, 64, 64, 4): async+load_0_0_0_tiles (not swizzled)


@pytest.fixture(scope="module")
def plans():
    return {cfg: make_plan(cfg) for cfg in SEED_CONFIGS}


def test_seed_sets_are_nonempty():
    assert len(tuning_space()) >= 40 and len(kernel_progression(all_block_sizes=True)) >= 40
    assert any(not c.swizzled for c in SEED_CONFIGS) and any(c.swizzled for c in SEED_CONFIGS)


@pytest.mark.parametrize("cfg", [FIRST, parse_config("(BF16, 128, 128, 32, 8): async+eager+swizzled+load_2_2_2_tiles+buffer")], ids=str)
def test_trace_agrees_with_partition_and_layout_objects(cfg):
    """The vectorised evaluation equals Partition.coord and the smem Layout, point by point."""
    plan = make_plan(cfg)
    rng = np.random.default_rng(0)
    for name, tr in trace_plan(plan).items():
        part = tr.copy.partition
        for _ in range(40):
            w, i, lane = rng.integers(tr.n_warps), rng.integers(tr.n_instr), rng.integers(32)
            idx = dict(zip(tr.index_names, tr.index[i].tolist()))
            thread = int(tr.threads[w, lane])
            for e in range(tr.rows.shape[-1]):
                loops = {k: v for k, v in idx.items() if k != "v"}
                warp = int(w) if tr.copy.scope == "warp" else 0
                r, c = part.coord(thread, idx["v"] + e, warp, **loops)
                assert (tr.rows[w, i, lane, e], tr.cols[w, i, lane, e]) == (r, c), name
                assert tr.smem_elem[w, i, lane, e] == tr.copy.smem.layout((r, c)), name
            assert tr.byte_addr[w, i, lane] == smem_bases(plan)[tr.copy.smem.name] + 2 * tr.smem_elem[w, i, lane, 0]


def test_smem_bases_follow_tensor_sizes():
    plan = make_plan(FIRST)
    b = smem_bases(plan)
    assert b == {"sQ": 0, "sK": plan.tensors["sQ"].bytes, "sV": plan.tensors["sQ"].bytes + plan.tensors["sK"].bytes, "sO": 0}


def test_coverage_every_seed_config(plans):
    """Every copy of every config of the tuning space and the progression (all block sizes):
    g2s writes each 16-byte chunk of its tile once; ldmatrix delivers each element of the
    warp's operand tile once (plan lane addresses + PTX ldmatrix); r2s writes each
    element of the warp's O rows once, where the PTX C fragment says it belongs; s2g
    reads each chunk of the warp's own O rows once."""
    failures = []
    for cfg, plan in plans.items():
        for name, cov in coverage(plan).items():
            if not cov.ok:
                failures.append(f"{cfg} {name}: {cov.detail}")
    assert not failures, "\n".join(failures[:10])


#: Valid configs outside the seed sets: synchronous copies, other head sizes and warp counts.
EXTRA_CONFIGS = [
    FIRST.replace(async_copy=False),
    FIRST.replace(async_copy=False, swizzled=True, Q_mma_load_K_tiles=2, K_mma_load_K_tiles=2),
    FIRST.replace(d_head=64, B_c=32),
    FIRST.replace(d_head=256, B_r=128, B_c=32, n_warps=8, swizzled=True),
    FIRST.replace(B_r=32, B_c=16, n_warps=2, swizzled=True, V_mma_load_K_tiles=2),
    FIRST.replace(B_r=16, B_c=128, n_warps=1),
]


@pytest.mark.parametrize("cfg", EXTRA_CONFIGS, ids=str)
def test_coverage_beyond_the_seed(cfg):
    plan = make_plan(cfg)
    bad = [f"{n}: {c.detail}" for n, c in coverage(plan).items() if not c.ok]
    assert not bad, bad
    expect = 1.0 if cfg.swizzled else 8.0
    r = _ratios(plan)
    assert r["s2r_K"] == r["s2r_V"] == r["s2r_Q"] == r["r2s_O"] == expect
    assert r["g2s_Q"] == r["s2g_O"] == 1.0


def _ratios(plan):
    out = {}
    for name, tr in trace_plan(plan).items():
        w, ideal = wavefronts(tr)
        out[name] = w.sum() / ideal.sum()
    return out


def test_swizzled_configs_are_bank_conflict_free(plans):
    """Sw<3,3,3>: row r permutes its 16-byte chunks by c ^ (r % 8), so the 8 rows of an
    ldmatrix phase (same logical chunk) hit 8 different bank groups; g2s/s2g 16-byte
    accesses of 8 consecutive chunks of a row stay a permutation of one 128-byte line."""
    for cfg, plan in plans.items():
        if not cfg.swizzled:
            continue
        assert _ratios(plan) == {n: 1.0 for n in _ratios(plan)}, cfg


def test_unswizzled_conflict_degree_is_the_paper_value(plans):
    """Unswizzled tiles are 64-element (128-byte) rows stacked row-major within 64-column blocks.

    * ldmatrix (s2r_Q/K/V): a phase reads 8 rows at the same 16-byte column; rows are
      128 B apart, so all 8 rows map to the same 4 banks: 8 distinct words per bank ->
      8 wavefronts per phase instead of 1: ratio 8.
    * r2s (32-bit stores of the C fragment): lanes 4g..4g+3 write row g, 16 contiguous
      bytes at the same column for g = 0..7: again 8 rows x the same 4 banks: ratio 8.
    * g2s and s2g (16 B per thread): 8 consecutive threads move 8 consecutive chunks of
      one 128-byte row: all 32 banks once per phase: ratio 1 even unswizzled.
    """
    seen = 0
    for cfg, plan in plans.items():
        if cfg.swizzled:
            continue
        seen += 1
        r = _ratios(plan)
        assert r == {"g2s_Q": 1, "g2s_K": 1, "g2s_V": 1, "s2r_Q": 8, "s2r_K": 8, "s2r_V": 8, "r2s_O": 8, "s2g_O": 1}, cfg
    assert seen >= 4


# ---------------------------------------------------------------------- broken plans are caught


def _evolve_copy(copy, **changes):
    return attrs.evolve(copy, partition=attrs.evolve(copy.partition, **changes))


def test_coverage_catches_a_warp_reading_another_warps_q_rows():
    plan = make_plan(FIRST)
    bad = _evolve_copy(plan.s2r["Q"].copy, warp_row_step=0)
    cov = check_copy(plan, trace_copy(plan, "s2r", bad))
    assert not cov.ok and "outside its operand rows" in cov.detail


def test_coverage_catches_a_duplicated_ldmatrix_quarter():
    plan = make_plan(FIRST)
    tv = ldmatrix_x4_rows_then_cols("dup")
    dup = TVMap("dup", 32, 1, tv.row, Layout(((8, 2, 2), 1), ((0, 0, 0), 0)))  # every matrix at column 0
    cov = check_copy(plan, trace_copy(plan, "s2r", _evolve_copy(plan.s2r["K"].copy, tv=dup)))
    assert not cov.ok and "more than once" in cov.detail and "never moved" in cov.detail


def test_coverage_catches_missing_g2s_chunks():
    plan = make_plan(FIRST)
    copy = plan.g2s["K"]
    tv = copy.partition.tv
    assert tv.row.stride == ((0, 1), 8)  # 16 chunks per row: thread t -> row t / 16, value v -> +8 rows
    same_rows = TVMap(tv.name, tv.n_threads, tv.n_values, Layout(tv.row.shape, ((0, 1), 0)), tv.col)  # forgets v
    cov = check_copy(plan, trace_copy(plan, "g2s", _evolve_copy(copy, tv=same_rows)))
    assert not cov.ok and "never moved" in cov.detail and "more than once" in cov.detail


def test_coverage_catches_r2s_with_a_wrong_fragment_map():
    """A C map that forgets the ``+8 rows`` of registers 2, 3 stores row g+8's pair over row g's."""
    plan = make_plan(FIRST)
    c = plan.r2s_O.partition.tv
    assert c.row.stride == ((0, 1), (0, 8))
    wrong = TVMap("C?", 32, 4, Layout(c.row.shape, ((0, 1), (0, 0))), c.col)
    cov = check_copy(plan, trace_copy(plan, "r2s", _evolve_copy(plan.r2s_O, tv=wrong)))
    assert not cov.ok and "stored away from their element" in cov.detail


def test_coverage_catches_s2g_of_foreign_rows():
    plan = make_plan(FIRST)
    cov = check_copy(plan, trace_copy(plan, "s2g", _evolve_copy(plan.s2g_O, warp_row_step=0)))
    assert not cov.ok and "outside its own" in cov.detail
