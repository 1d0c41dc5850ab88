"""The verification step: every shipped config passes it, and each proof catches a plan it must reject."""
from __future__ import annotations

import attrs
import pytest

import flashgen
from flashgen.dsl.addressing import plan_splits, split_offsets, split_problems
from flashgen.dsl.atoms.copy import GM2SM
from flashgen.dsl.atoms.hopper import TmaStore
from flashgen.dsl.config import KernelConfig
from flashgen.dsl.backward_config import BackwardConfig
from flashgen.dsl.hopper_backward_plan import make_hopper_backward_plan
from flashgen.dsl.hopper_plan import make_hopper_plan
from flashgen.dsl.layout import Layout
from flashgen.dsl.notation import parse_config
from flashgen.dsl.plan import TiledCopy, make_plan, smem_tile_layout
from flashgen.dsl.sets import NAMED_SETS
from flashgen.dsl.swizzle import ComposedLayout, Swizzle
from flashgen.dsl.tensor import Tensor
from flashgen.dsl.tiling import Partition, TVMap
from flashgen.sim.verify import (
    Verification,
    VerificationError,
    c_chunk_problems,
    c_row_pair_problems,
    hopper_backward_checks,
    o_store_problems,
    p_from_s_problems,
    pair_load_problems,
)
from flashgen.engines import verify_config, verify_plan

UNSWIZZLED = parse_config("(FP16, 128, 64, 64, 4): async+load_0_0_0_tiles")
WGMMA = KernelConfig.wgmma("bf16", B_c=64)


@pytest.mark.parametrize("set_name", sorted(NAMED_SETS))
def test_every_shipped_config_verifies(set_name):
    failed = [verify_config(cfg) for cfg in NAMED_SETS[set_name]()]
    failed = [v for v in failed if not v.ok]
    assert not failed, "\n".join(f"{v.config}: {v.to_dict()['checks']}" for v in failed)


def test_verify_is_cached_and_raises_on_failure():
    cfg = WGMMA
    assert flashgen.verify(cfg) is verify_config(cfg) and flashgen.verify(cfg.to_dict()).ok
    plan = make_hopper_plan(cfg)
    bad = verify_plan(attrs.evolve(plan, p_from_s=plan.p_from_s[::-1]))
    assert isinstance(bad, Verification) and not bad.ok
    with pytest.raises(VerificationError, match=r"p_from_s: thread 0 step 0"):
        bad.raise_if_failed()


# ---- address splits ------------------------------------------------------------------------------


def _row_copy(swizzle: Swizzle) -> TiledCopy:
    """Two threads at rows 0 and 1 of an 8x64 tile, value v one row further down."""
    tile = Tensor("sX", "SM", flashgen.DType.FP16, ComposedLayout(swizzle, Layout((8, 64), (64, 1))))
    tv = TVMap("rows", 2, 2, row=Layout((2, 2), (1, 1)), col=Layout((2, 2), (0, 0)))
    gx = Tensor("gX", "GM", flashgen.DType.FP16, Layout((8, 64), (64, 1)))
    return TiledCopy("g2s_X", GM2SM(), gx, tile, Partition(tv), "cta")


def test_a_split_that_holds_only_at_thread_0_is_caught():
    """Under Sw<3,3,3> thread 0 steps from row 0 to 1 (chunk xor 1) but thread 1 from row 1 to 2
    (chunk xor 3): the xor table read off thread 0 is wrong for thread 1; without a swizzle it holds."""
    copy = _row_copy(Swizzle(3, 3, 3))
    problems = split_problems(copy, split_offsets(copy), n_warps=1)
    assert problems and all(p.startswith("g2s_X thread 1 warp 0 (v=1): offset") for p in problems)
    plain = _row_copy(Swizzle(0, 0, 0))
    assert split_problems(plain, split_offsets(plain), n_warps=1) == []


def test_an_altered_split_table_is_caught():
    plan = make_plan(UNSWIZZLED)
    split = plan_splits(plan)["s2r_K"]
    assert split_problems(plan.s2r["K"].copy, split, 4) == []
    wrong = attrs.evolve(split, add=(split.add[0] + 8,) + split.add[1:])
    assert split_problems(plan.s2r["K"].copy, wrong, 4)[0].startswith("s2r_K thread 0 warp 0 (v=0, nn=0, kk=0): offset")
    wrong = attrs.evolve(split, d_col=split.d_col[:-1] + (split.d_col[-1] + 1,))
    assert "col" in split_problems(plan.s2r["K"].copy, wrong, 4)[0]


def test_verify_plan_checks_the_splits_the_emitter_uses():
    """The emitter's splits come from the config; a plan whose K tile is swizzled where the
    config's is not fails exactly that copy's proof."""
    plan = make_plan(UNSWIZZLED)
    load = plan.s2r["K"]
    swizzled = attrs.evolve(load.copy.src, layout=smem_tile_layout(UNSWIZZLED.B_c, UNSWIZZLED.d_smem, swizzled=True))
    k = attrs.evolve(load, copy=attrs.evolve(load.copy, src=swizzled))
    bad = verify_plan(attrs.evolve(plan, s2r={**plan.s2r, "K": k}))
    assert [c.name for c in bad.checks if not c.ok] == ["address split s2r_K"]


# ---- fragment maps -------------------------------------------------------------------------------


def _with_col(tv: TVMap, stride) -> TVMap:
    return attrs.evolve(tv, col=Layout(tv.col.shape, stride))


def test_c_row_pairs():
    c = make_plan(UNSWIZZLED).mma.c_map
    assert c_row_pair_problems(c) == []
    same_col = _with_col(c, ((2, 0), (0, 0)))  # value 1 in value 0's column
    assert c_row_pair_problems(same_col)[0].endswith("value 1: column 0, expected 1")
    swapped = attrs.evolve(c, row=Layout(c.row.shape, ((0, 1), (8, 0))))  # value 1 eight rows down
    assert "value 1: row 8, expected 0" in c_row_pair_problems(swapped)[0]


def test_c_chunk_pattern():
    plan = make_hopper_plan(WGMMA)
    c = plan.gemm_S.atom.c_map
    assert c_chunk_problems(c) == [] and c_chunk_problems(plan.gemm_O.atom.c_map) == []
    chunks_4_apart = _with_col(c, ((2, 0, 0), (1, 0, 4)))
    assert c_chunk_problems(chunks_4_apart)[0].endswith("thread 0 value 4: column 4, expected 8")


def test_the_lse_and_d_pair_loads_need_chunks_that_start_at_even_columns():
    """The backward reads a chunk's two query columns' lse and D with one 8-byte load: a map whose chunks start at
    odd columns (thread t at column t % 4, still the chunk pattern) fails the check, and the shipped ones pass it."""
    plan = make_hopper_plan(WGMMA)
    c = plan.gemm_S.atom.c_map
    odd = _with_col(c, ((1, 0, 0), (1, 0, 8)))
    assert pair_load_problems(c) == [] and c_chunk_problems(odd) == []
    problems = pair_load_problems(odd)
    assert problems and "thread 1 chunk 0 starts at column 1" in problems[0]
    for d_head, mask in ((64, "none"), (128, "none"), (128, "causal")):
        checks = {ch.name: ch.ok for ch in hopper_backward_checks(make_hopper_backward_plan(BackwardConfig.wgmma("bf16", d_head, mask)))}
        assert checks["lse and D pair loads"]


def test_p_from_s_every_thread():
    plan = make_hopper_plan(WGMMA)
    assert p_from_s_problems(plan) == []
    steps = [list(regs) for regs in plan.p_from_s]
    steps[1][2] = steps[1][2][::-1]  # the two halves of one register swapped
    problems = p_from_s_problems(attrs.evolve(plan, p_from_s=tuple(tuple(r) for r in steps)))
    assert problems[0].startswith("thread 0 step 1 A register 2 half 0")


def test_o_store_boxes():
    plan = make_hopper_plan(WGMMA)
    assert o_store_problems(plan) == []
    o = plan.stores["O"]
    tall = attrs.evolve(o, tma=TmaStore(128, o.tma.box_cols, o.tma.dtype, o.tma.swizzle))
    assert o_store_problems(attrs.evolve(plan, stores={"O": tall})) == ["O store boxes of 128 rows: a consumer owns 64"]
