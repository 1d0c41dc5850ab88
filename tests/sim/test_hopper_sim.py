"""One CTA of the Hopper (wgmma) plan on the CPU vs float64 attention, and its async-hazard checker.

Tolerance: ``cta.compare_with_reference`` (the mma.sync simulator's rule): max|O - O_f64| <=
2 * max|O_lowp - O_f64| + 1e-3 and lse within 1e-4 relative, -inf exactly where the reference
has no kept score. Hazard tests walk plans whose steps were removed or moved
(``attrs.evolve``'d copies) and expect the checker to report it.
"""
from __future__ import annotations

import attrs
import numpy as np
import pytest

from flashgen.dsl.config import KernelConfig, default_configs
from flashgen.dsl.hopper_plan import make_hopper_plan
from flashgen.dsl.steps import FIRST_BLOCK, Guard, Pass, Release
from flashgen.sim import cta
from flashgen.sim import hardware as hw
from flashgen.sim import hopper

W = KernelConfig.wgmma
PP_INTRA = W("fp16", d_head=64, B_c=64)  # 2 stages, pingpong + intra overlap
PLAIN = W("bf16", d_head=64, B_c=64, stages=1, pingpong=False, intra_overlap=False)


def _inputs(cfg, seq_q, seq_k, seed=0, spread=2.0):
    rng = np.random.default_rng(seed)
    q = hw.encode(spread * rng.standard_normal((seq_q, cfg.d_head)), cfg.dtype)
    k = hw.encode(spread * rng.standard_normal((seq_k, cfg.d_head)), cfg.dtype)
    v = hw.encode(rng.standard_normal((seq_k, cfg.d_head)), cfg.dtype)
    return q, k, v


def _check(cfg, seq_q, seq_k, q_block=0, seed=0, offset=0, left=-1, right=-1, plan=None):
    """Simulate one CTA and compare with float64 attention over the same mask; returns the report."""
    plan = plan or make_hopper_plan(cfg)
    q, k, v = _inputs(cfg, seq_q, seq_k, seed)
    o, lse, rep = hopper.simulate_cta(plan, q, k, v, q_block, mask_offset=offset, window_left=left, window_right=right)
    row0 = q_block * cfg.B_r
    rows = min(cfg.B_r, seq_q - row0)
    assert o.shape == (rows, cfg.d_head) and lse.shape == (rows,)
    keep = np.array([[plan.score_mask.keep(row0 + i, j, seq_k, offset, left, right) for j in range(seq_k)]
                     for i in range(rows)], dtype=bool).reshape(rows, seq_k)
    cmp = cta.compare_with_reference(cfg, q[row0: row0 + rows], k, v, o, keep=keep, lse=lse)
    assert cmp["ok"], cmp
    assert rep.ok, rep.hazards[:3]
    return rep


@pytest.mark.parametrize("cfg, seq_q, seq_k, q_block", [
    (PP_INTRA, 128, 256, 0),  # 4 blocks: two ring cycles
    (PP_INTRA, 100, 77, 0),  # tails: 28 zero-filled query rows, 51 masked keys
    (PLAIN, 100, 77, 0),
    (PLAIN, 256, 200, 1),
    (W("fp16", d_head=64, B_r=64, B_c=64, stages=3, pingpong=False), 100, 77, 1),  # second CTA, 36 rows
    (W("bf16", d_head=64, B_c=176, stages=2, intra_overlap=False), 128, 300, 0),  # N = 176 wgmma, 2 blocks
    (W("fp16", d_head=128, B_c=128, stages=2), 100, 300, 0),  # the d128 case
    (W("fp16", d_head=128, B_c=160, persistent=True), 100, 300, 0),  # N = 160: 10 k16 steps of P V, a 140-key tail
], ids=lambda x: str(x) if isinstance(x, KernelConfig) else None)
def test_cta_matches_float64_attention(cfg, seq_q, seq_k, q_block):
    rep = _check(cfg, seq_q, seq_k, q_block)
    assert (rep.j_begin, rep.j_end) == (0, -(-seq_k // cfg.B_c))


@pytest.mark.parametrize("cfg", [W("fp16", d_head=64, B_c=64, mask="causal"),
                                 W("bf16", d_head=64, B_c=64, stages=1, pingpong=False, mask="causal")], ids=str)
@pytest.mark.parametrize("seq_q, seq_k, q_block, offset", [
    (128, 300, 0, 0),  # top-left diagonal: blocks past the rows are skipped
    (100, 77, 0, 77 - 100),  # bottom-right aligned, tails; the first 23 rows see no key
    (256, 256, 1, 0),
    (128, 128, 0, -200),  # every row fully masked: no block visited, O = 0, lse = -inf
])
def test_causal(cfg, seq_q, seq_k, q_block, offset):
    rep = _check(cfg, seq_q, seq_k, q_block, offset=offset)
    if offset == -200:
        assert rep.j_begin == rep.j_end


@pytest.mark.parametrize("left, right", [(40, 0), (20, 30), (-1, 10), (70, -1)])
def test_window(left, right):
    cfg = W("fp16", d_head=64, B_c=64, stages=2, intra_overlap=False, mask="window")
    rep = _check(cfg, 200, 330, 1, left=left, right=right)
    if 0 <= left < 64:
        assert rep.j_begin > 0  # rows 128.. reach back less than 64 keys: key block 0 is skipped


def test_fully_masked_rows_give_zero_and_minus_inf():
    cfg = W("fp16", d_head=64, B_c=64, mask="causal")
    q, k, v = _inputs(cfg, 128, 64)
    o, lse, rep = hopper.simulate_cta(make_hopper_plan(cfg), q, k, v, mask_offset=-20)
    assert rep.ok
    assert (o[:20] == 0).all() and np.isneginf(lse[:20]).all()
    assert np.isfinite(lse[20:]).all() and (o[20:] != 0).any()


def test_online_softmax_rescales_when_the_max_moves_late():
    """Larger scores in the last block: only right if O and l are rescaled by exp2(old - new max)."""
    cfg = PP_INTRA
    q, k, v = _inputs(cfg, 128, 256, spread=1.0)
    kf = hw.decode(k, cfg.dtype)
    kf[192:] *= 4
    k = hw.encode(kf, cfg.dtype)
    o, lse, rep = hopper.simulate_cta(make_hopper_plan(cfg), q, k, v)
    assert rep.ok and cta.compare_with_reference(cfg, q, k, v, o, lse=lse)["ok"]


@pytest.mark.parametrize("cfg, mask, offset", [
    (PP_INTRA.replace(persistent=True), "none", 0),  # pingpong + intra overlap across tiles
    (PP_INTRA.replace(persistent=True, mask="causal"), "causal", -200),  # tile 0 has no key block: zeros, no Q
    (PLAIN.replace(persistent=True), "none", 0),  # no overlap
    (W("fp16", d_head=128, persistent=True, mask="causal"), "causal", 56),  # the d128 default, unequal tiles
], ids=str)
def test_persistent_cta_walks_several_tiles(cfg, mask, offset):
    """A persistent CTA on one SM walks every tile in the scheduler's order (the last query block first;
    with a causal offset the first block has no key block): every tile's rows match float64
    attention, the ring and Q run on across tiles, no hazard."""
    plan = make_hopper_plan(cfg)
    seq_q, seq_k = 3 * cfg.B_r - 20, 3 * cfg.B_c + 30
    q, k, v = _inputs(cfg, seq_q, seq_k, seed=7)
    o, lse, rep = hopper.simulate_tiles(plan, q, k, v, sms=1, mask_offset=offset)
    assert rep.hazards == [] and rep.tiles == [(2, -1), (1, -1), (0, -1)]
    order = [qb for qb, _ in rep.tiles]
    for qb, ot, lt in zip(order, o, lse):
        row0 = qb * cfg.B_r
        rows = min(cfg.B_r, seq_q - row0)
        keep = np.array([[plan.score_mask.keep(row0 + i, j, seq_k, offset, -1, -1) for j in range(seq_k)]
                         for i in range(rows)], dtype=bool).reshape(rows, seq_k)
        cmp = cta.compare_with_reference(cfg, q[row0: row0 + rows], k, v, ot, keep=keep, lse=lt)
        assert cmp["ok"], (qb, cmp)
    if mask == "causal" and offset < 0:
        assert (o[2] == 0).all() and np.isneginf(lse[2]).all()


def test_a_cta_of_a_grid_walks_its_one_tile():
    """A one-CTA-per-tile plan launches a CTA per tile; CTA c takes tile c (query blocks last first)."""
    q, k, v = _inputs(PP_INTRA, 2 * PP_INTRA.B_r, 128)
    plan = make_hopper_plan(PP_INTRA)
    assert [hopper.simulate_tiles(plan, q, k, v, sms=8, cta=c)[2].tiles for c in (0, 1)] == [[(1, -1)], [(0, -1)]]
    with pytest.raises(ValueError, match="outside the launch's 2 CTA"):
        hopper.simulate_tiles(plan, q, k, v, sms=8, cta=2)


# ---------------------------------------------------------------------- schedules are clean


SCHEDULES = [W(dt, d_head=64, B_r=br, B_c=64, stages=st, pingpong=pp, intra_overlap=intra)
             for dt, br, st, pp, intra in [
                 ("fp16", 128, 1, True, True), ("fp16", 128, 2, True, False), ("bf16", 128, 3, False, True),
                 ("fp16", 128, 1, False, False), ("bf16", 64, 2, False, True), ("fp16", 64, 1, False, False),
                 ("bf16", 192, 2, False, False), ("fp16", 128, 4, True, True), ("fp16", 192, 2, True, True),
             ]] + [W("bf16", d_head=64, B_r=192, B_c=64, stages=2, pingpong=True, intra_overlap=True, persistent=True),
                   W("fp16", d_head=64, B_c=64, stages=2, pingpong=True, intra_overlap=True, persistent=True),
                   W("bf16", d_head=64, B_c=64, stages=1, pingpong=False, intra_overlap=False, persistent=True)]


@pytest.mark.parametrize("cfg", SCHEDULES, ids=str)
@pytest.mark.parametrize("n_blocks", [1, 2, 5])
def test_every_schedule_is_hazard_free(cfg, n_blocks):
    plan = make_hopper_plan(cfg)
    n_tiles = 3 if cfg.persistent else 1  # a persistent CTA: three tiles back to back
    q, k, v = _inputs(cfg, n_tiles * cfg.B_r, n_blocks * cfg.B_c)
    o, lse, rep = hopper.simulate_tiles(plan, q, k, v, sms=1)
    assert rep.hazards == [] and len(rep.tiles) == n_tiles
    assert rep.groups == 2 * n_blocks * cfg.consumers * n_tiles
    if cfg.pingpong:  # the last consumer hands over the first turn; consumer 0 takes the pass left over at exit
        n_issue = n_tiles * (sum(s.op == "turn" for s in plan.prologue + plan.epilogue) + n_blocks * sum(s.op == "turn" for s in plan.body)
                             - (sum(s.op == "turn" for s in plan.body) if plan.prologue else 0))
        assert rep.pingpong[0] == {"turn": n_issue, "pass": n_issue, "absorbed": 1}
        for w in range(1, cfg.consumers):
            assert rep.pingpong[w] == {"turn": n_issue, "pass": n_issue, "absorbed": 0}


# ---------------------------------------------------------------------- mutations are caught


def _index(steps, op, arg=None):
    return next(i for i, s in enumerate(steps) if s.op == op and (arg is None or s.arg == arg))


def _without(plan, part, i):
    steps = getattr(plan, part)
    return attrs.evolve(plan, **{part: steps[:i] + steps[i + 1:]})


def _move(plan, part, i, to):
    steps = list(getattr(plan, part))
    steps.insert(to, steps.pop(i))
    return attrs.evolve(plan, **{part: tuple(steps)})


def _hazards(plan, n_blocks=3, tiles=None):
    tiles = tiles or (2 if "q_empty" in plan.barriers else 1)  # persistent plans: across a tile boundary
    return hopper.check_schedule(plan, n_blocks, tiles=tiles)


@pytest.mark.parametrize("cfg", [PP_INTRA, PLAIN, W("fp16", d_head=64, B_c=64, stages=2, pingpong=True, intra_overlap=False),
                                 W("bf16", d_head=64, B_c=64, stages=2, pingpong=False, intra_overlap=True),
                                 PP_INTRA.replace(persistent=True), PLAIN.replace(persistent=True)], ids=str)
def test_removing_any_step_is_caught(cfg):
    """Every step of prologue, body and epilogue is needed: without it the walk reports a hazard."""
    plan = make_hopper_plan(cfg)
    assert _hazards(plan) == []
    for part in ("prologue", "body", "epilogue"):
        for i, step in enumerate(getattr(plan, part)):
            cut = _without(plan, part, i)
            # a guarded step may run in one block only (release Q: the last), so also walk a single block
            assert _hazards(cut) or _hazards(cut, n_blocks=1), f"removing {part} step {i} ({step}) went unnoticed"


@pytest.mark.parametrize("cfg", [PP_INTRA, PLAIN], ids=str)
def test_missing_wgmma_wait_is_reported(cfg):
    plan = make_hopper_plan(cfg)
    h = _hazards(_without(plan, "body", _index(plan.body, "wgmma_wait")))
    assert any("in flight" in x and "S registers" in x for x in h), h[:3]


def test_missing_pv_wait_lets_rescale_touch_O_in_flight():
    plan = make_hopper_plan(PP_INTRA)
    h = _hazards(_without(plan, "body", _index(plan.body, "wgmma_wait", "0")))
    assert any("touches O registers while wgmma group O[" in x for x in h), h[:3]


@pytest.mark.parametrize("cfg", [PP_INTRA, PLAIN], ids=str)
@pytest.mark.parametrize("tensor", ["K", "V"])
def test_release_before_the_wait_is_reported(cfg, tensor):
    plan = make_hopper_plan(cfg)
    i = next(i for i, s in enumerate(plan.body) if s.op == "release" and s.arg == tensor)
    wait = max(k for k in range(i) if plan.body[k].op == "wgmma_wait")
    h = _hazards(_move(plan, "body", i, wait))
    assert any(f"releases {tensor}_" in x and "still reads it" in x for x in h), h[:3]


@pytest.mark.parametrize("cfg", [PP_INTRA, PLAIN], ids=str)
@pytest.mark.parametrize("tensor", ["K", "V"])
def test_dropped_wait_full_is_reported(cfg, tensor):
    plan = make_hopper_plan(cfg)
    h = _hazards(_without(plan, "body", _index(plan.body, "wait_full", tensor)))
    assert any(f"reads {tensor}_" in x and "without its wait_full" in x for x in h), h[:3]


def test_pingpong_imbalance_is_reported():
    plan = make_hopper_plan(PP_INTRA)
    h = _hazards(_without(plan, "epilogue", _index(plan.epilogue, "turn")))
    assert any("do not balance" in x for x in h), h[:3]
    h = _hazards(_without(plan, "body", _index(plan.body, "pass")))
    assert any("deadlock" in x for x in h), h[:3]
    # one pass too many: an arrival is left on a turn barrier at exit
    extra = attrs.evolve(plan, epilogue=plan.epilogue + (Pass(),))
    h = _hazards(extra)
    assert any("do not balance" in x for x in h), h[:3]


def test_too_small_empty_barrier_count_lets_the_producer_overwrite_a_stage():
    """k_empty expecting one consumer's 4 arrivals: the producer refills K while the other consumer reads it."""
    plan = make_hopper_plan(PP_INTRA)
    bars = dict(plan.barriers)
    bar, off, stages = bars["k_empty"]
    bars["k_empty"] = (attrs.evolve(bar, arrive_count=4), off, stages)
    h = _hazards(attrs.evolve(plan, barriers=bars))
    assert any("but it holds K_" in x for x in h), h[:3]


def test_o_staging_over_the_other_consumers_rows_is_reported():
    """A staging layout of 64-row blocks of d contiguous elements per consumer (an earlier
    version) overlaps the other consumer's Q rows when sO aliases sQ and d > 64, and the K/V
    ring when placed elsewhere; the checker reports either."""
    from flashgen.dsl.layout import Layout
    from flashgen.dsl.swizzle import ComposedLayout, Swizzle

    cfg = W("fp16", d_head=128, B_c=64, stages=1, pingpong=False, intra_overlap=False)
    plan = make_hopper_plan(cfg)
    bad = ComposedLayout(Swizzle(3, 3, 4), Layout((cfg.B_r, cfg.d_head), (cfg.d_head, 1)))
    q, k, v = _inputs(cfg, 128, 64)
    assert hopper.simulate_cta(plan, q, k, v)[2].ok
    o_tile = attrs.evolve(plan.tiles["O"], offset=plan.tiles["Q"].offset)
    for tiles in ({**plan.tiles, "O": o_tile}, {**plan.tiles, "O": attrs.evolve(o_tile, offset=plan.tiles["K"].offset)}):
        _, _, rep = hopper.simulate_cta(attrs.evolve(plan, o_stage=bad, tiles=tiles), q, k, v)
        assert any("another warpgroup or the producer may still use" in x for x in rep.hazards), rep.hazards[:3]


def test_wrong_descriptor_field_gives_wrong_numbers():
    """The simulator reads V through the ISA MN-major model: swapped LBO/SBO read the wrong elements."""
    cfg = PP_INTRA.replace(d_head=128)
    plan = make_hopper_plan(cfg)
    b = plan.gemm_O.b
    bad = attrs.evolve(plan, gemm_O=attrs.evolve(plan.gemm_O, b=attrs.evolve(b, lbo=b.sbo, sbo=b.lbo)))
    q, k, v = _inputs(cfg, 128, 128)
    o, lse, _ = hopper.simulate_cta(bad, q, k, v)
    assert not cta.compare_with_reference(cfg, q, k, v, o, lse=lse)["ok"]


def test_tma_fill_refuses_misaligned_base():
    plan = make_hopper_plan(PLAIN)
    with pytest.raises(ValueError, match="1024"):
        hopper.tma_fill(np.zeros(plan.smem_bytes, np.uint8), plan.loads["K"], 512, np.zeros((64, 64), np.uint16))


# Q's A fragments do not fit beside S at B_c 224 (d_head 64): S reads Q's tile in shared memory
Q_IN_SMEM = [PP_INTRA.replace(B_c=224, persistent=True), PLAIN.replace(B_c=224, persistent=True)]


@pytest.mark.parametrize("cfg", Q_IN_SMEM, ids=str)
def test_persistent_q_release_before_the_last_S_retires_is_reported(cfg):
    """Releasing Q lets the producer load the next tile's Q over it: only after the wait that retires the last S."""
    plan = make_hopper_plan(cfg)
    assert plan.gemm_S.a_from == "smem"
    i = next(i for i, s in enumerate(plan.body) if s.op == "release" and s.arg == "Q")
    wait = max(k for k in range(i) if plan.body[k].op == "wgmma_wait")
    h = _hazards(_move(plan, "body", i, wait))
    assert any("releases Q while wgmma group S[" in x for x in h), h[:3]
    # unguarded: Q released in every block, the next block's S reads a Q the producer may overwrite
    loose = attrs.evolve(plan, body=tuple(attrs.evolve(s, guard=None) if s.arg == "Q" else s for s in plan.body))
    h = _hazards(loose)
    assert any("gemm S reads Q after releasing it" in x for x in h), h[:3]


def test_q_release_needs_a_q_empty_barrier():
    plan = make_hopper_plan(PP_INTRA)
    assert "q_empty" not in plan.barriers
    h = _hazards(attrs.evolve(plan, body=plan.body + (Release("Q", guard=Guard(1, "==", "end")),)))
    assert any("has no q_empty barrier" in x for x in h), h[:3]


def _release_q_early(plan):
    return attrs.evolve(plan, **{part: tuple(attrs.evolve(s, guard=FIRST_BLOCK) if s.arg == "Q" and s.op == "release" else s
                                             for s in getattr(plan, part)) for part in ("prologue", "body")})


def test_next_tiles_q_over_a_running_S_gives_the_wrong_tile():
    """Q (read from shared memory by every S GEMM) released after the first S GEMM instead of the
    last: the producer loads the next tile's Q while the later S GEMMs still have to execute on the old one."""
    plan = make_hopper_plan(Q_IN_SMEM[0])
    assert plan.gemm_S.a_from == "smem"
    h = _hazards(_release_q_early(plan), n_blocks=3, tiles=3)
    assert any("executes on the Q of tile" in x for x in h), h[:3]


def test_q_fragments_outlive_their_shared_memory_tile():
    """With Q's A fragments loaded at the tile's Q wait, S no longer reads Q's tile: the same early
    release is harmless, and every S GEMM still computes on its own tile's Q."""
    plan = make_hopper_plan(PP_INTRA.replace(persistent=True))
    assert plan.gemm_S.a_from == "regs"
    assert _hazards(_release_q_early(plan), n_blocks=3, tiles=3) == []


def test_tile_output_steps_out_of_place_are_reported():
    """The output of a tile needs its last PV retired and the statistics of its last block."""
    plan = make_hopper_plan(PP_INTRA.replace(persistent=True))
    no_wait = _without(plan, "epilogue", _index(plan.epilogue, "wgmma_wait"))
    h = _hazards(no_wait)
    assert any("touches O registers while wgmma group O[" in x for x in h), h[:3]
    h = _hazards(_without(plan, "epilogue", _index(plan.epilogue, "gemm")))
    assert any("store_O of tile 0 before gemm O of block" in x for x in h), h[:3]


@pytest.mark.parametrize("cfg, seq_q, seq_k, q_block, parts, mask_args", [
    (W("fp16", d_head=128, B_c=160, persistent=True), 100, 1000, 0, 3, (0, -1, -1)),  # the long-sequence default, a 40-key tail
    (W("bf16", d_head=128, persistent=True), 256, 520, 1, 4, (0, -1, -1)),  # 5 blocks in 4 parts (1-2 blocks each)
    (PP_INTRA.replace(persistent=True), 200, 300, 1, 2, (0, -1, -1)),  # d64: 72 query rows
    # masked: causal aligned bottom-right (rows see all but the last keys: the diagonal in the last part)
    (W("fp16", d_head=128, persistent=True, mask="causal"), 100, 700, 0, 3, (600, -1, -1)),
    # a window wider than a part: some rows keep no key of the first part (its max is -inf there)
    (W("bf16", d_head=64, B_c=64, persistent=True, mask="window"), 64, 400, 0, 3, (300, 150, 0)),
], ids=str)
def test_split_tile_matches_float64_attention(cfg, seq_q, seq_k, q_block, parts, mask_args):
    """A wave-tail tile walked as ``parts`` CTAs over its key ranges and merged by each consumer
    (plan.tail_split): float64 attention's rows, no hazard in any part. The last keys are made
    larger, so the part holding them has the largest max and the others must be rescaled to it."""
    q, k, v = _inputs(cfg, seq_q, seq_k, seed=3, spread=1.0)
    kf = hw.decode(k, cfg.dtype)
    kf[-cfg.B_c:] *= 4
    k = hw.encode(kf, cfg.dtype)
    offset, left, right = mask_args
    kw = dict(mask_offset=offset, window_left=left, window_right=right)
    o, lse, rep = hopper.simulate_split_tile(cfg, q, k, v, parts, q_block, **kw)
    assert rep.hazards == []
    row0 = q_block * cfg.B_r
    rows = min(cfg.B_r, seq_q - row0)
    sm = make_hopper_plan(cfg).score_mask
    keep = np.array([[sm.keep(row0 + i, j, seq_k, offset, left, right) for j in range(seq_k)] for i in range(rows)], dtype=bool)
    cmp = cta.compare_with_reference(cfg, q[row0: row0 + rows], k, v, o, keep=keep, lse=lse)
    assert cmp["ok"], cmp
    whole, whole_lse, _ = hopper.simulate_cta(cfg, q, k, v, q_block, **kw)  # same rows unsplit: only rounding differs
    diff = np.abs(hw.decode(o, cfg.dtype) - hw.decode(whole, cfg.dtype)).max()
    assert diff <= 4 * np.abs(hw.decode(whole, cfg.dtype)).max() * 2.0 ** -8
    np.testing.assert_allclose(lse, whole_lse, rtol=1e-5)


def test_split_needs_a_wgmma_plan_and_nonempty_parts():
    q, k, v = _inputs(PP_INTRA, 64, 128)
    with pytest.raises(ValueError, match="mma.sync config"):
        hopper.simulate_split_tile(default_configs()[0], q, k, v, 2)
    with pytest.raises(ValueError, match="leave a part empty"):
        hopper.simulate_split_tile(PP_INTRA.replace(persistent=True), q, k, v, 3)
    with pytest.raises(ValueError, match="parts must be at least 1, got 0"):
        hopper.simulate_split_tile(PP_INTRA.replace(persistent=True), q, k, v, 0)
    # a tile outside the query rows is refused, as simulate_cta / simulate_tiles refuse it
    with pytest.raises(ValueError, match="q_block 5 starts at row 640, outside seq_q=64"):
        hopper.simulate_split_tile(PP_INTRA.replace(persistent=True), q, k, v, 2, q_block=5)


# ---------------------------------------------------------------------- Q's A fragments in registers


def test_q_fragment_load_matches_the_wgmma_a_map():
    """Every A value of every k16 step comes from the Q element the A map asks for, exactly once:
    ldmatrix's delivery (lanes 8m.. address matrix m) composed with the plan's lane addresses."""
    plan = make_hopper_plan(W("fp16"))
    assert plan.gemm_S.a_from == "regs" and plan.q_load is not None
    src_r, src_c, a_rows, a_cols = hopper._register_load_map(plan.q_load, plan.gemm_S.atom)
    for kk in range(src_r.shape[0]):
        assert np.array_equal(src_r[kk], a_rows) and np.array_equal(src_c[kk], a_cols + 16 * kk)
    hit = np.zeros((64, 16), int)
    np.add.at(hit, (a_rows, a_cols), 1)
    assert np.all(hit == 1)


def test_a_wrong_q_fragment_map_fails_the_float64_check():
    """The B-operand ldmatrix order (matrices (r0,c0) (r0,c8) (r8,c0) ..) for Q swaps A's quarters:
    the simulated S is wrong and the CTA's output misses float64 attention."""
    from flashgen.dsl.atoms.copy import ldmatrix_x4_cols_then_rows

    cfg = W("fp16", d_head=64, B_c=64)
    plan = make_hopper_plan(cfg)
    bad = attrs.evolve(plan, q_load=attrs.evolve(plan.q_load, partition=attrs.evolve(plan.q_load.partition,
                                                                                 tv=ldmatrix_x4_cols_then_rows("ldsm_Q"))))
    q, k, v = _inputs(cfg, 128, 128)
    o, lse, rep = hopper.simulate_cta(bad, q, k, v, 0)
    assert not cta.compare_with_reference(cfg, q, k, v, o, lse=lse)["ok"]
    _check(cfg, 128, 128, plan=plan)  # the plan's own map passes


def test_a_persistent_cta_walks_its_rounds_and_a_part_of_a_split_tail_tile():
    """3 tiles on 2 SMs: CTA 0 takes tile 0 whole, then (mirrored round) part 1 of the last tile (its
    share of the key blocks); no hazard across the two."""
    cfg = PP_INTRA.replace(persistent=True)
    plan = make_hopper_plan(cfg)
    q, k, v = _inputs(cfg, 3 * cfg.B_r, 6 * cfg.B_c, seed=3)
    o, lse, rep = hopper.simulate_tiles(plan, q, k, v, sms=2, cta=0)
    assert rep.hazards == [] and rep.tiles == [(2, -1), (0, 1)]
