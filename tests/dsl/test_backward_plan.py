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
           B.default("fp16", 160, "causal"), B("bf16", d_head=192, n_warps=8, d_split=2), B("fp16", d_head=24, n_warps=8, d_split=2),
           # split_scores: each warp its query columns of S^T and dP^T (B rows of sQ / sdO), of the P^T and dS^T stores
           B("fp16", n_warps=8, d_split=2, split_scores=True), B("bf16", d_head=256, n_warps=8, d_split=4, stages=2, split_scores=True),
           B("fp16", d_head=64, B_c=16, n_warps=4, d_split=4, swizzled=False, mask="window", split_scores=True)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_every_copy_covers_its_tile_once(cfg):
    bad = {name: c.detail for name, c in backward_coverage(make_backward_plan(cfg)).items() if not c.ok}
    assert not bad


@pytest.mark.parametrize("d_split, split_scores", [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("swizzled", [True, False])
def test_swizzled_tiles_are_conflict_free(swizzled, d_split, split_scores):
    cfg = B("fp16", swizzled=swizzled, n_warps=4 * d_split, d_split=d_split, split_scores=split_scores)
    traces = trace_backward(make_backward_plan(cfg))
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
    ({"split_scores": True}, ["split_scores", "d_split=1", "d_split > 1"]),
    ({"split_scores": True, "n_warps": 8, "d_split": 8, "d_head": 256, "B_c": 16}, ["B_r=64", "d_split=8", "multiple of 128"]),
    ({"split_scores": 1}, ["split_scores=1", "true or false"]),
    # without split_scores every warp of a group holds the group's whole S^T and dP^T: 256 accumulators
    ({"d_head": 256, "n_warps": 8, "d_split": 4}, ["d_split=4", "registers", "with split_scores"]),
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


def test_split_scores_names_sizes_and_rules():
    """The knob's flag and mangled word; left out of the dict (names and hashes of the configs before it) where
    off; its S^T and dP^T a d_split-th of the query block; P^T's tile in the shared memory; d_split 4 on 64
    key rows valid with it (the FlashAttention-2 shape of d_head 256), its dQ in two passes."""
    from flashgen.dsl.configs import parse_short_form

    cfg = B("bf16", d_head=256, n_warps=8, d_split=4, stages=2, split_scores=True)
    assert cfg.short_form() == "bwd(BF16, 256, 64, 64, 8): swizzled+d_split_4+split_scores+stages_2"
    assert cfg.mangle() == "flash_bwd_bf16_d256_br64_bc64_w8_swz_ds4_ss_s2"
    assert parse_short_form(cfg.short_form()) == cfg and B.from_dict(cfg.to_dict()) == cfg
    off = cfg.replace(split_scores=False, d_split=2)
    assert "split_scores" not in off.to_dict() and cfg.to_dict()["split_scores"] is True
    assert cfg.score_cols_per_warp == 16 and off.score_cols_per_warp == 64
    assert cfg.smem_bytes == cfg.replace(split_scores=False, d_split=2).smem_bytes + 64 * 64 * 2 == 214016
    assert cfg.dq_passes == 2 and cfg.acc_regs == 128 + 32 and off.dq_passes == 1
    assert B("bf16", n_warps=8, d_split=2, split_scores=True).dq_passes == 1


def test_longest_first_names_round_trip_and_plans(tmp_path):
    """The knob's flag, YAML key and mangled word (a kernel of its own); left out of the dict where off (the names and
    hashes of the configs before it unchanged); both engines' plans take their grid's order from it; out of the tuning
    space until it is timed."""
    from flashgen.dsl import configs
    from flashgen.dsl.backward_config import TUNING_KNOBS, tuning_space
    from flashgen.dsl.hopper_backward_plan import make_hopper_backward_plan

    text = "bwd(BF16, 128, 64, 128, 12): wgmma+swizzled+causal+stages_2+longest_first"
    cfg = configs.load(text)
    off = B.wgmma("bf16", 128, "causal")
    assert cfg == off.replace(longest_first=True) and cfg.short_form() == text
    assert cfg.mangle() == off.mangle() + "_lf" == "flash_bwd_bf16_d128_br64_bc128_w12_wgmma_swz_causal_s2_lf"
    assert cfg.to_dict()["longest_first"] is True and "longest_first" not in off.to_dict()
    assert cfg.content_hash() != off.content_hash() and configs.from_dict(configs.to_record(cfg)) == cfg
    (tmp_path / "lf.yaml").write_text("kind: backward\ndtype: fp16\nd_head: 64\nlongest_first: true\n")
    mma = configs.load(str(tmp_path / "lf.yaml"))
    assert mma == B("fp16", d_head=64, longest_first=True) and mma.mangle().endswith("_swz_lf")
    assert configs.load(mma.short_form()) == mma and "longest_first" in mma.short_form()
    assert [make_backward_plan(c).grid.longest_first for c in (mma.replace(longest_first=False), mma)] == [False, True]
    assert [make_hopper_backward_plan(c).grid.longest_first for c in (off, cfg)] == [False, True]
    with pytest.raises(ConfigError, match="longest_first=1: expected true or false"):
        B("fp16", longest_first=1)
    assert "longest_first" not in TUNING_KNOBS and not any(c.longest_first for c in tuning_space("fp16", 64, "causal"))


def test_split_scores_plan_reads_p_and_ds_from_shared_memory():
    """Warp h of a group: S^T and dP^T of its B_r / d_split query columns (rows of sQ / sdO from h * B_r / d_split),
    dV and dK's A operands from sP / sdS (the group's key rows, all B_r), every warp storing its dS^T; sP after sdS."""
    plan = make_backward_plan(B("fp16", n_warps=8, d_split=2, split_scores=True))
    s = plan.gemms["S"]
    assert s.n_tiles == 4 and s.b.copy.partition.warp_offset(3) == (32, 0) and s.b.copy.partition.warp_offset(2) == (0, 0)
    assert plan.gemms["dV"].a.copy.smem.name == "sP" and plan.gemms["dK"].a.copy.smem.name == "sdS"
    assert plan.gemms["dV"].a.copy.partition.warp_offset(3) == (16, 0) and plan.gemms["dV"].k == 64
    assert plan.ds_store_every == 1 and plan.r2s["P"].partition.warp_offset(3) == (16, 32)
    lay = plan.smem_layout
    assert lay["sP"] == lay["sdS"] + 64 * 64 * 2 and lay["end"] == plan.cfg.smem_bytes
    assert "sP" not in make_backward_plan(B("fp16", n_warps=8, d_split=2)).smem_layout


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


def test_the_default_splits_the_scores_and_falls_back_where_shared_memory_is_short():
    """The shipped shapes split the scores among a group's warps (but where the split pads d_head below 64
    columns); a GPU whose shared memory cannot hold them with two stages gets the shape without split scores
    that fits two, not split scores in one."""
    from flashgen.dsl.backward_config import tuning_space
    from flashgen.targets import TARGETS

    big, small = TARGETS["sm_90a"].smem_per_block, 99 * 1024
    for d in (48, 64, 96, 128, 192, 256):
        cfg = B.default("bf16", d, "causal", smem_limit=big)
        assert cfg.stages == 2 and cfg in tuning_space("bf16", d, "causal")
        # up to 64 columns the split only where halving d_head pads no column (d_head 48 would compute 64)
        assert cfg.split_scores == (d != 48) and (cfg.d_cols == cfg.d_mma or d > 64)
        assert cfg.dq_cols_per_warp * cfg.query_rows_per_warp == 32 * 32 if d == 128 else cfg.dq_split == 0
    for d, stages in ((64, 2), (128, 1)):  # d_head 128's 4-warp shape needs 105 KiB for two stages
        cfg = B.default("bf16", d, "causal", smem_limit=small)
        assert (cfg.stages, cfg.n_warps, cfg.split_scores) == (stages, 4, False) and cfg.smem_bytes <= small
        assert B.default("bf16", d, "causal", smem_limit=big).smem_bytes > small


# ---- dq_split: dQ's own warp grid ------------------------------------------------------------------------------------

# the shipped shapes with dQ on the dK/dV grid (d_head 128 ships dq_split 4)
D128, D64 = B.default("bf16", 128).replace(dq_split=0), B.default("bf16", 64)


@pytest.mark.parametrize("knobs, words", [
    ({"dq_split": 3}, ["dq_split=3", "power of two dividing n_warps"]),
    ({"dq_split": 16}, ["dq_split=16", "n_warps=8", "power of two dividing n_warps"]),
    ({"dq_split": -1}, ["dq_split=-1", "0 (as d_split)"]),
    ({"dq_split": True}, ["dq_split=True"]),
    # 8 warps in 8 columns: one row of warps owns all 64 query rows; in 1 column: 8 rows of 8 query rows each
    ({"dq_split": 1}, ["B_r=64", "dq_split=1", "B_r/8 query rows", "multiple of the MMA's 16 rows", "larger dq_split"]),
    # d_head 64 over 8 warps: shares of 8 columns round up to 16 (the x4.trans load's two n8 tiles), 128 columns in all
    ({"d_head": 64, "B_r": 128, "dq_split": 8}, ["dq_split=8", "d_head=64", "rounds up to 16", "128 columns", "the 64 of sK"]),
    # d_head 128 over 8 warps: 16-column shares fit; one row of warps owns all 64 query rows
    ({"dq_split": 8, "split_scores": True}, []),
])
def test_dq_split_refuses_grids_that_do_not_tile_and_names_the_rule(knobs, words):
    knobs = {"n_warps": 8, "d_split": 2, "B_c": 128, **knobs}
    if not words:  # the control: this one tiles
        assert B("bf16", **knobs).dq_cols_per_warp == 16
        return
    with pytest.raises(ConfigError) as e:
        B("bf16", **knobs)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_dq_split_refuses_the_wgmma_engine_and_shares_past_the_shared_tiles():
    with pytest.raises(ConfigError, match="dq_split=4 with engine=wgmma"):
        B.wgmma("bf16", 128).replace(dq_split=4)
    # d_head 24 over 8 warps: 16-column shares (at least the MMA's 16), 128 columns, past the 64 of sK
    with pytest.raises(ConfigError) as e:
        B("bf16", d_head=24, B_r=128, n_warps=8, dq_split=8)
    assert all(w in str(e.value) for w in ("dq_split=8", "d_head=24", "16", "128 columns", "the 64 of sK")), str(e.value)


def test_dq_split_names_round_trip_and_leave_the_other_configs_alone():
    from flashgen.dsl import configs

    on = D128.replace(dq_split=4)
    assert on.short_form() == "bwd(BF16, 128, 64, 128, 8): swizzled+d_split_2+dq_split_4+split_scores+stages_2"
    assert on.mangle() == "flash_bwd_bf16_d128_br64_bc128_w8_swz_ds2_dq4_ss_s2"
    assert configs.load(on.short_form()) == on and configs.from_dict(configs.to_record(on)) == on
    assert "dq_split" not in D128.to_dict() and on.to_dict()["dq_split"] == 4 and on.content_hash() != D128.content_hash()
    assert configs.load(D128.short_form()).dq_split == 0


@pytest.mark.parametrize("base", [D128, D64, B("fp16", d_head=96, n_warps=8, d_split=2)], ids=str)
def test_dq_split_gives_dq_its_own_grid_and_leaves_dk_and_dv_theirs(base):
    """Warp w of dQ's grid: query rows from (w // dq_split) * qr, columns from (w % dq_split) * qw, for the GEMM's A
    (dS) and B (K^T) loads and for the adds; dK's and dV's copies are the default's."""
    on = base.replace(dq_split=4)
    plan, off = make_backward_plan(on), make_backward_plan(base)
    qr, qw = on.query_rows_per_warp, on.dq_cols_per_warp
    assert qr == base.B_r * 4 // base.n_warps and qw == max(16, 1 << (-(-base.d_head // 4) - 1).bit_length())
    g = plan.gemms["dQ"]
    assert (g.m_tiles, g.n_tiles) == (qr // 16, qw // 8)
    for w in range(on.n_warps):
        assert g.a.copy.partition.warp_offset(w) == (w // 4 * qr, 0)
        assert g.b.copy.partition.warp_offset(w) == (0, w % 4 * qw)
        assert plan.red_dQ.partition.warp_offset(w) == (w // 4 * qr, w % 4 * qw)
    assert plan.gemms["dV"] == off.gemms["dV"] and plan.gemms["dK"] == off.gemms["dK"] and plan.r2s == off.r2s
    bad = {name: c.detail for name, c in backward_coverage(plan).items() if not c.ok}
    assert not bad


def _dq_ldmatrix_per_warp(cfg) -> int:
    """ldmatrix a warp issues for dQ per query block (dS and K^T), as `flashgen simulate` counts them."""
    traces = trace_backward(make_backward_plan(cfg))
    return traces["s2r_dS"].n_instr + traces["s2r_Kt"].n_instr


def test_dq_split_4_cuts_the_d128_dq_loads_from_40_to_32_a_warp():
    """d_head 128, 8 warps, 64 query rows: 16 x 64 warp tiles read 8 x4 of dS and 32 of K^T; 32 x 32 ones 16 and 16.
    (d_head 64's default, 128 rows, already has 32 x 32 tiles: dq_split 4 makes them 64 x 16, 32 + 8.)"""
    assert _dq_ldmatrix_per_warp(D128) == 40 and _dq_ldmatrix_per_warp(D128.replace(dq_split=4)) == 32
    assert _dq_ldmatrix_per_warp(D64) == 32 and _dq_ldmatrix_per_warp(D64.replace(dq_split=4)) == 40


@pytest.mark.parametrize("cfg", [D128.replace(dq_split=4, deterministic=True), D64.replace(dq_split=4, deterministic=True),
                                 B("fp16", d_head=96, n_warps=8, d_split=2, dq_split=8, B_r=128, deterministic=True)], ids=str)
def test_dq_split_adds_each_dq_element_once(cfg):
    plan = make_backward_plan(cfg)  # checks it (dq_adds_once)
    dq_adds_once(plan.red_dQ, cfg.n_warps, cfg.B_r, cfg.dq_cols)
    assert cfg.dq_cols >= cfg.d_head


def test_dq_split_conflict_free_and_address_splits_hold():
    from flashgen.dsl.addressing import split_offsets, split_problems

    for cfg in (D128.replace(dq_split=4), D64.replace(dq_split=4), B("fp16", n_warps=8, d_split=2, dq_split=4)):
        plan = make_backward_plan(cfg)
        traces = trace_backward(plan)
        assert all(wavefronts(traces[n])[0].sum() == wavefronts(traces[n])[1].sum() for n in ("s2r_dS", "s2r_Kt")), cfg
        assert not [p for _, copy in plan.copies() for p in split_problems(copy, split_offsets(copy), cfg.n_warps)]


def test_a_coverage_check_catches_dq_loads_on_the_dk_grid():
    """dQ's K^T load left on the dK/dV grid (2 columns of 64) while dS and the adds take dq_split 4: caught."""
    plan = make_backward_plan(D128.replace(dq_split=4))
    wrong = make_backward_plan(D128.replace(dq_split=4).replace(dq_split=0)).gemms["dQ"].b
    g = plan.gemms["dQ"]
    plan = attrs.evolve(plan, gemms={**plan.gemms, "dQ": attrs.evolve(g, b=wrong)})
    assert backward_coverage(plan)["s2r_Kt"].ok is False
