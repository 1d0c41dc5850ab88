"""The backward config's validity rules and the mma.sync backward plan's copies: every copy covers
its tile once, every warp's ldmatrix loads deliver exactly its operand, and the swizzled tiles make
every shared-memory access conflict-free (the unswizzled ones are not)."""
from __future__ import annotations

import attrs
import pytest

from flashgen.dsl.backward_config import BackwardConfig, acc_reg_limit
from flashgen.dsl.backward_plan import dq_adds_once, make_backward_plan, transposed
from flashgen.dsl.config import ConfigError
from flashgen.dsl.plan import smem_tile_layout
from flashgen.dsl.sets import backward_configs
from flashgen.sim.backward_cta import backward_coverage, trace_backward
from flashgen.sim.copies import wavefronts

B = BackwardConfig
CONFIGS = [B("fp16"), B("bf16", d_head=64, B_r=128, B_c=128, n_warps=8), B("fp16", d_head=40, swizzled=False, mask="causal"),
           B("bf16", d_head=96, B_r=64, B_c=32, n_warps=2, mask="window"), B("fp16", n_warps=8, d_split=2),
           B("bf16", d_head=64, B_r=128, B_c=32, n_warps=8, d_split=4, swizzled=False),
           B("bf16", n_warps=8, d_split=2, mask="causal", stages=2),
           # split shares past d_head: d_mma below d_smem, and d_head 24's 16-column shares (a quarter of its tiles)
           B.default("fp16", 160, "causal"), B("bf16", d_head=192, n_warps=8, d_split=2), B("fp16", d_head=24, n_warps=8, d_split=2)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_every_copy_covers_its_tile_once(cfg):
    bad = {name: c.detail for name, c in backward_coverage(make_backward_plan(cfg)).items() if not c.ok}
    assert not bad


@pytest.mark.parametrize("d_split", [1, 2])
@pytest.mark.parametrize("swizzled", [True, False])
def test_swizzled_tiles_are_conflict_free(swizzled, d_split):
    traces = trace_backward(make_backward_plan(B("fp16", swizzled=swizzled, n_warps=4 * d_split, d_split=d_split)))
    ratios = {name: wavefronts(t)[0].sum() / wavefronts(t)[1].sum() for name, t in traces.items()}
    ldsm = [r for name, r in ratios.items() if name.startswith(("s2r", "r2s"))]
    assert (max(ratios.values()) == 1.0) if swizzled else (min(ldsm) > 1.0)


def test_a_coverage_check_catches_a_wrong_operand_map():
    """The dQ GEMM's A operand (dS, read k-major with .trans) loaded with the row-major A map misses
    elements: the coverage check says so."""
    from flashgen.dsl.atoms.copy import ldmatrix_x4_rows_then_cols

    plan = make_backward_plan(B("fp16"))
    a = plan.gemms["dQ"].a
    wrong_part = attrs.evolve(a.copy.partition, tv=ldmatrix_x4_rows_then_cols("wrong"))
    wrong = attrs.evolve(plan.gemms["dQ"], a=attrs.evolve(a, copy=attrs.evolve(a.copy, partition=wrong_part)))
    plan = attrs.evolve(plan, gemms={**plan.gemms, "dQ": wrong})
    assert not backward_coverage(plan)["s2r_dS"].ok


@pytest.mark.parametrize("name", ["s2r_Kt", "r2s_dK", "s2g_dV"])
def test_a_coverage_check_catches_warps_of_a_group_on_the_same_columns(name):
    """With d_split, a copy whose partition forgets the column offset of a warp's place in its
    group gives two warps the same columns of dK, dV or K^T: the coverage check says so."""
    plan = make_backward_plan(B("fp16", n_warps=8, d_split=2))
    copies = {c.name: c for _, c in plan.copies()}
    wrong = attrs.evolve(copies[name], partition=attrs.evolve(copies[name].partition, warp_col_step=0))
    if name == "s2r_Kt":
        g = plan.gemms["dQ"]
        plan = attrs.evolve(plan, gemms={**plan.gemms, "dQ": attrs.evolve(g, b=attrs.evolve(g.b, copy=wrong))})
    else:
        field = "r2s" if name.startswith("r2s") else "s2g"
        table = getattr(plan, field)
        plan = attrs.evolve(plan, **{field: {**table, name[4:]: wrong}})
    assert backward_coverage(plan)[name].ok is False


def test_transposed_layout_reads_the_same_memory():
    lay = smem_tile_layout(64, 128, True)
    t = transposed(lay)
    assert all(t((c, r)) == lay((r, c)) for r in range(64) for c in range(128))


@pytest.mark.parametrize("knobs, words", [
    ({"B_c": 48}, ["B_c=48", "n_warps=4", "16 rows"]),
    ({"B_r": 96, "n_warps": 2}, ["B_r=96", "64"]),
    ({"d_head": 20}, ["d_head=20", "multiple of 8"]),
    ({"n_warps": 3}, ["n_warps=3"]),
    ({"d_head": 256}, ["d_head=256", "registers"]),
    ({"mask": "diagonal"}, ["mask='diagonal'"]),
    ({"engine": "wgmma"}, ["n_warps=4", "producer", "n_warps 8 or 12"]),
    ({"engine": "wgmma", "n_warps": 12, "B_c": 128, "d_head": 96}, ["d_head=96", "64 or 128", "mma_sync"]),
    ({"engine": "wgmma", "n_warps": 12, "B_c": 64}, ["B_c=64", "n_warps=12", "must be 128"]),
    ({"engine": "wgmma", "n_warps": 8, "B_c": 64, "B_r": 128}, ["B_r=128", "64 rows"]),
    ({"engine": "wgmma", "n_warps": 12, "B_c": 128, "d_split": 2}, ["d_split"]),
    ({"d_split": 3, "n_warps": 8, "B_c": 128, "B_r": 128}, ["d_split=3", "power of two"]),
    ({"d_split": 8, "n_warps": 4}, ["d_split=8", "n_warps=4"]),
    # shares rounded up to 16 columns: 8 of them are 128, past d_head 64's shared tiles
    ({"d_split": 8, "d_head": 64, "n_warps": 8, "B_c": 16}, ["d_split=8", "d_head=64", "16 columns", "128 columns", "the 64 of"]),
    ({"d_split": 16, "d_head": 128, "n_warps": 16, "B_c": 16}, ["d_split=16", "d_head=128", "256 columns", "the 128 of"]),
    ({"d_split": 2, "n_warps": 8, "B_c": 128, "B_r": 128}, ["d_split=2", "registers"]),
    ({"d_split": 2, "n_warps": 8, "B_c": 32}, ["B_c=32", "d_split=2", "16 rows"]),
    # 512 threads share the register file: 128 registers a thread (ptxas spilled this config)
    ({"d_head": 256, "n_warps": 16, "d_split": 4}, ["d_split=4", "> 97 for 512 threads"]),
    ({"deterministic": 1}, ["deterministic=1", "true or false"]),
])
def test_invalid_configs_name_the_rule_and_values(knobs, words):
    with pytest.raises(ConfigError) as e:
        B("fp16", **knobs)
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("knobs, share", [
    ({"d_head": 96, "n_warps": 8, "d_split": 2}, 64),  # d_mma 96 < d_smem 128
    ({"d_head": 160, "n_warps": 8, "d_split": 2}, 128),
    ({"d_head": 192, "B_c": 32, "n_warps": 8, "d_split": 4}, 64),
    ({"d_head": 240, "n_warps": 8, "d_split": 2}, 128),
    ({"d_head": 24, "n_warps": 8, "d_split": 2}, 16),
    ({"d_head": 136, "n_warps": 8, "d_split": 2, "B_c": 64}, 128),
])
def test_split_shares_cover_d_head_within_the_shared_tiles(knobs, share):
    """Each warp's share of a split is a power of two columns; the shares cover d_head and stay in the
    tiles of d_smem columns that dK and dV are staged in."""
    cfg = B("fp16", **knobs)
    assert cfg.d_cols_per_warp == share
    assert cfg.d_head <= cfg.d_cols <= cfg.d_smem


def test_the_default_backward_takes_every_forward_head_size():
    """Every multiple of 8 up to 256 has a default within the shared memory of sm_80 and sm_90, whose
    accumulators fit the register rule and whose split shares cover d_head."""
    from flashgen.targets import TARGETS

    for d in range(8, 257, 8):
        for limit in {TARGETS[a].smem_per_block for a in ("sm_80", "sm_90a")}:
            cfg = B.default("bf16", d, "causal", smem_limit=limit)
            assert cfg is not None and cfg.smem_bytes <= limit and cfg.d_cols >= d, (d, limit)
            assert cfg.acc_regs <= acc_reg_limit(cfg.threads)
    assert B.default("bf16", 264) is None


def test_names_and_round_trip():
    cfg = B("bf16", d_head=64, mask="causal")
    assert cfg.short_form() == "bwd(BF16, 64, 64, 64, 4): swizzled+causal"
    assert cfg.mangle() == "flash_bwd_bf16_d64_br64_bc64_w4_swz_causal"
    assert B.from_dict(cfg.to_dict()) == cfg
    split = B("fp16", n_warps=8, d_split=2)
    assert split.short_form() == "bwd(FP16, 128, 64, 64, 8): swizzled+d_split_2"
    assert split.mangle() == "flash_bwd_fp16_d128_br64_bc64_w8_swz_ds2"
    assert B.from_dict(split.to_dict()) == split
    det = split.replace(mask="causal", deterministic=True)
    assert det.short_form() == "bwd(FP16, 128, 64, 64, 8): swizzled+causal+d_split_2+deterministic"
    assert det.mangle() == "flash_bwd_fp16_d128_br64_bc64_w8_swz_causal_ds2_det"
    assert B.from_dict(det.to_dict()) == det and det.to_dict()["deterministic"] is True
    assert len({c.mangle() for c in (det, det.replace(deterministic=False))}) == 2
    assert len({c.content_hash() for c in (det, det.replace(deterministic=False))}) == 2
    with pytest.raises(ConfigError, match="unknown backward config key"):
        B.from_dict({"dtype": "fp16", "async_copy": True})


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_address_splits_hold_for_every_thread(cfg):
    """The emitter's base ^ xor + add addresses, read off thread 0, equal every thread's and warp's own."""
    from flashgen.dsl.addressing import split_offsets, split_problems

    plan = make_backward_plan(cfg)
    bad = [p for _, copy in plan.copies() for p in split_problems(copy, split_offsets(copy), cfg.n_warps)]
    assert not bad


def test_a_deterministic_schedule_orders_the_dq_adds_between_the_gemm_and_the_next_blocks_copies():
    """The turn is taken after the dQ GEMM (as late as possible) and passed on only after the barrier that
    follows every warp's adds; without the knob there are no turns."""
    from flashgen.dsl.steps import Barrier, Gemm, ReduceGM, SignalOrder, WaitOrder

    body = make_backward_plan(B("fp16", d_head=64, deterministic=True)).schedule.body
    kinds = [type(s) for s in body]
    at = kinds.index(ReduceGM)
    assert kinds[at - 2:at + 3] == [Gemm, WaitOrder, ReduceGM, Barrier, SignalOrder] and kinds[-1] is SignalOrder
    assert not {WaitOrder, SignalOrder} & {type(s) for s in make_backward_plan(B("fp16", d_head=64)).schedule.body}


@pytest.mark.parametrize("cfg", [c.replace(deterministic=True) for c in backward_configs() if c.engine == "mma_sync"], ids=str)
def test_each_dq_element_of_a_query_block_is_added_by_one_thread(cfg):
    plan = make_backward_plan(cfg)  # checks it (dq_adds_once)
    dq_adds_once(plan.red_dQ, cfg.n_warps, cfg.B_r, cfg.d_mma)


def test_a_reduction_that_adds_an_element_twice_is_refused():
    plan = make_backward_plan(B("fp16", n_warps=8, d_split=2))
    part = plan.red_dQ.partition
    same_cols = attrs.evolve(part, warp_col_step=0)  # both warps of a group on the same columns
    with pytest.raises(ValueError, match="not once each; an ordered reduction of dQ would have to order the threads"):
        dq_adds_once(attrs.evolve(plan.red_dQ, partition=same_cols), 8, 64, 128)
