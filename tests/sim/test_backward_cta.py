"""The backward CTA simulation (flashgen.sim.backward_cta) of the mma.sync backward plan: dQ, dK, dV
of odd shapes (seq 1, 17, 113), causal, window and unmasked, GQA, head sizes up to 256 (the
split ones past 128 among them), against the float64 numpy
reference within FlashAttention's rule; with no hazard in the schedule; and broken plans caught."""
from __future__ import annotations

import attrs
import numpy as np
import pytest

from flashgen.attention.backward_grid import BackwardGrid
from flashgen.dsl.backward_config import BackwardConfig
from flashgen.dsl.backward_plan import make_backward_plan
from flashgen.dsl.steps import Barrier, Commit, Copy, Gemm, Wait
from flashgen.sim import hardware as hw
from flashgen.sim.backward_cta import simulate_backward
from flashgen.sim.grad_reference import gradients

B = BackwardConfig
#: (config, seq_q, seq_k, heads, kv_heads, mask arguments)
CASES = [
    (B("fp16", d_head=64), 1, 1, 1, 1, {}),
    (B("fp16", d_head=64), 17, 113, 2, 1, {}),
    (B("bf16", d_head=64, mask="causal"), 113, 113, 2, 2, {"causal": True}),
    (B("fp16", d_head=40, mask="causal"), 17, 113, 4, 2, {"causal": True, "align": "bottom_right"}),
    (B("fp16", d_head=64, B_c=32, n_warps=2, mask="window"), 113, 17, 2, 1, {"window": (9, 4)}),
    (B("bf16", d_head=32, B_r=128, B_c=128, n_warps=8, mask="causal"), 113, 1, 1, 1, {"causal": True, "align": "bottom_right"}),
    # the warps of a group split d: d_head 128 as the nvcc tests build it, and four warps on 16-column shares
    (B("fp16", n_warps=8, d_split=2), 17, 113, 2, 1, {}),
    (B("bf16", n_warps=8, d_split=2, mask="causal"), 113, 70, 4, 2, {"causal": True, "align": "bottom_right"}),
    (B("fp16", d_head=64, B_c=16, n_warps=4, d_split=4, mask="window"), 70, 33, 2, 1, {"window": (9, 4)}),
    # two stages: the next query block's copies in flight under this one's GEMMs
    (B("fp16", d_head=64, stages=2), 1, 1, 1, 1, {}),
    (B("bf16", n_warps=8, d_split=2, mask="causal", stages=2), 200, 130, 4, 2, {"causal": True, "align": "bottom_right"}),
    (B("fp16", d_head=64, B_c=32, n_warps=2, mask="window", stages=2), 150, 70, 2, 1, {"window": (20, 3)}),
    # head sizes whose split shares run past d_head: the shipped 160, 192 and 240 (fours of warps on
    # 64-column shares), 192 in pairs on 128-column shares, and d_head 24's shares of 16 columns,
    # narrower than half its 64-column tiles
    (B.default("bf16", 160, "causal"), 70, 65, 4, 2, {"causal": True, "align": "bottom_right"}),
    (B.default("fp16", 160), 17, 33, 2, 1, {}),
    (B.default("fp16", 192, "causal"), 33, 70, 2, 1, {"causal": True}),
    (B.default("bf16", 192), 65, 17, 4, 2, {}),
    (B.default("fp16", 240, "causal"), 20, 20, 1, 1, {"causal": True}),
    (B("bf16", d_head=192, n_warps=8, d_split=2, mask="causal", stages=2), 70, 33, 2, 1, {"causal": True, "align": "bottom_right"}),
    (B("fp16", d_head=24, n_warps=8, d_split=2), 17, 70, 2, 1, {}),
    # split_scores: each warp of a group its query columns of S^T and dP^T, P^T and dS^T through shared memory
    (B("fp16", d_head=64, n_warps=8, d_split=2, split_scores=True), 17, 113, 2, 1, {}),
    (B("bf16", d_head=64, B_c=32, n_warps=4, d_split=2, mask="causal", stages=2, split_scores=True), 113, 70, 4, 2,
     {"causal": True, "align": "bottom_right"}),
    (B("fp16", d_head=64, B_c=16, n_warps=4, d_split=4, mask="window", split_scores=True), 70, 33, 2, 1, {"window": (9, 4)}),
    (B("fp16", n_warps=8, d_split=2, mask="window", split_scores=True), 70, 33, 2, 1, {"window": (20, 3)}),
    (B("bf16", n_warps=8, d_split=4, stages=2, split_scores=True), 65, 130, 4, 2, {}),
    (B("bf16", d_head=256, n_warps=8, d_split=2, mask="causal", stages=2, split_scores=True), 130, 70, 2, 1, {"causal": True}),
    (B("bf16", d_head=256, n_warps=8, d_split=4, stages=2, split_scores=True), 33, 70, 4, 2, {}),
    (B("fp16", d_head=256, n_warps=8, d_split=4, mask="causal", split_scores=True), 70, 113, 2, 1, {"causal": True, "align": "bottom_right"}),
    (B("bf16", d_head=192, n_warps=8, d_split=4, mask="causal", stages=2, split_scores=True), 33, 70, 2, 2, {"causal": True}),
]


def _inputs(seed, seq_q, seq_k, heads, kv_heads, d):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((1, seq_q, heads, d)), rng.standard_normal((1, seq_k, kv_heads, d)),
            rng.standard_normal((1, seq_k, kv_heads, d)), rng.standard_normal((1, seq_q, heads, d)))


def _check(cfg, res, inputs, mask):
    """FlashAttention's rule: each gradient within 2x the error of the same math at the kernel's
    16-bit roundings (P, dS and the outputs) of the float64 gradients, plus a small absolute slack."""
    vals = [hw.decode(hw.encode(x, cfg.dtype), cfg.dtype).astype(np.float64) for x in inputs]
    ref = gradients(*vals, **mask)
    lowp = gradients(*vals, **mask, round16=lambda x: hw.decode(hw.encode(x, cfg.dtype), cfg.dtype).astype(np.float64))
    for name, got, want, base in zip(("dq", "dk", "dv"), (res.dq, res.dk, res.dv), ref, lowp):
        err, err_lowp = np.abs(got - want).max(), np.abs(base - want).max()
        assert err <= 2 * err_lowp + 1e-3, f"{name}: max error {err:.3g} > 2 * {err_lowp:.3g} + 1e-3"


@pytest.mark.parametrize("case", range(len(CASES)))
def test_simulated_gradients_match_the_reference(case):
    cfg, seq_q, seq_k, heads, kv_heads, mask = CASES[case]
    inputs = _inputs(case, seq_q, seq_k, heads, kv_heads, cfg.d_head)
    res = simulate_backward(cfg, *inputs, **mask)
    assert res.ok, res.hazards[:3]
    _check(cfg, res, inputs, mask)


def _without(plan, index):
    body = plan.schedule.body[:index] + plan.schedule.body[index + 1:]
    return attrs.evolve(plan, schedule=attrs.evolve(plan.schedule, body=body))


@pytest.mark.parametrize("step, words", [
    (Barrier(why="dS^T visible to all warps"), "has completed but no barrier made it visible"),
    (Barrier(why="... and are visible to all warps"), "has completed but no barrier made it visible"),
    (Wait("0", why="Q_j, dO_j, lse_j, D_j (and K, V) have landed"), "in flight"),
])
def test_a_missing_step_is_a_hazard(step, words):
    plan = make_backward_plan(B("fp16", d_head=64))
    broken = _without(plan, plan.schedule.body.index(step))
    res = simulate_backward(broken, *_inputs(0, 130, 70, 1, 1, 64))
    assert any(words in h for h in res.hazards), res.hazards[:3]


@pytest.mark.parametrize("step, words", [
    (Barrier(why="dS^T visible to all warps"), "has completed but no barrier made it visible"),
    (Wait("1", why="all but block j+1's group: Q_j, dO_j, lse_j, D_j (and K, V)"), "in flight"),
])
def test_a_missing_step_of_the_two_stage_schedule_is_a_hazard(step, words):
    """Without the dS^T barrier the dQ GEMM reads dS^T other warps stored unpublished; without the wait
    the GEMMs read a block still in flight."""
    plan = make_backward_plan(B("fp16", d_head=64, stages=2))
    broken = _without(plan, plan.schedule.body.index(step))
    res = simulate_backward(broken, *_inputs(0, 200, 70, 1, 1, 64))
    assert any(words in h for h in res.hazards), res.hazards[:3]


@pytest.mark.parametrize("stages", [1, 2])
def test_the_loop_needs_no_closing_barrier_but_the_epilogue_needs_one(stages):
    """The dS^T barrier follows every read of a block's streamed tiles, so the next copies may go out
    behind it; the epilogue's barrier keeps dK's staging off the sK the last dQ GEMM reads."""
    from unittest import mock

    from flashgen.dsl.backward_plan import BackwardPlan

    for cfg in (B("fp16", d_head=64, stages=stages), B("bf16", d_head=256, n_warps=8, d_split=2, stages=stages)):
        plan = make_backward_plan(cfg)
        assert not plan.closing_barrier and sum(isinstance(s, Barrier) for s in plan.schedule.body) == 2
        inputs = _inputs(0, 200, 70, 1, 1, cfg.d_head)
        res = simulate_backward(plan, *inputs)
        assert res.ok, res.hazards[:3]
        with mock.patch.object(BackwardPlan, "closing_barrier", property(lambda self: True)):
            res = simulate_backward(plan, *inputs)
        assert any("epilogue" in h and "write-after-read" in h and "sK" in h for h in res.hazards), res.hazards[:3]


@pytest.mark.parametrize("stages", [1, 2])
def test_a_streamed_tile_read_after_the_ds_barrier_is_a_hazard(stages):
    """dK's GEMM (a reader of Q_j) moved behind the dS^T barrier: a warp past that barrier overwrites
    Q_j's stage with the next block's copies while slower warps still read it."""
    plan = make_backward_plan(B("fp16", d_head=64, stages=stages))
    body = list(plan.schedule.body)
    dk = next(s for s in body if isinstance(s, Gemm) and s.arg == "dK")
    body.remove(dk)
    body.insert(body.index(Barrier(why="dS^T visible to all warps")) + 1, dk)
    broken = attrs.evolve(plan, schedule=attrs.evolve(plan.schedule, body=tuple(body)))
    res = simulate_backward(broken, *_inputs(0, 200, 70, 1, 1, 64))
    assert any("write-after-read" in h and "sQ" in h for h in res.hazards), res.hazards[:3]


def test_waiting_for_the_newest_group_only_is_a_hazard():
    """``wait_group 2`` leaves block j's own group in flight when its GEMMs read it."""
    plan = make_backward_plan(B("fp16", d_head=64, stages=2))
    at = next(i for i, s in enumerate(plan.schedule.body) if isinstance(s, Wait))
    body = plan.schedule.body[:at] + (Wait("2"),) + plan.schedule.body[at + 1:]
    broken = attrs.evolve(plan, schedule=attrs.evolve(plan.schedule, body=body))
    res = simulate_backward(broken, *_inputs(0, 200, 70, 1, 1, 64))
    assert any("in flight" in h for h in res.hazards), res.hazards[:3]


def test_a_missing_ds_store_is_a_hazard():
    """With d_split 2, dS^T stored by every fourth warp instead of every second leaves half the key
    rows unwritten: the dQ GEMM reads rows never written."""
    plan = attrs.evolve(make_backward_plan(B("fp16", n_warps=8, d_split=2)), ds_store_every=4)
    res = simulate_backward(plan, *_inputs(0, 64, 64, 1, 1, 128))
    assert any("never written" in h for h in res.hazards), res.hazards[:3]


def test_a_wrong_fragment_pairing_gives_wrong_gradients():
    """dK's B operand (Q, k-major) loaded without .trans: the simulation's dK no longer matches."""
    from flashgen.dsl.atoms.copy import SM2RF

    plan = make_backward_plan(B("fp16", d_head=64))
    b = plan.gemms["dK"].b
    wrong = attrs.evolve(plan.gemms["dK"], b=attrs.evolve(b, copy=attrs.evolve(b.copy, atom=SM2RF(4))))
    plan = attrs.evolve(plan, gemms={**plan.gemms, "dK": wrong})
    inputs = _inputs(1, 64, 64, 1, 1, 64)
    res = simulate_backward(plan, *inputs)
    vals = [hw.decode(hw.encode(x, "fp16"), "fp16").astype(np.float64) for x in inputs]
    _, dk, dv = gradients(*vals)
    assert np.abs(res.dk - dk).max() > 0.1 and np.abs(res.dv - dv).max() < 0.01


#: (config, seq_q, seq_k, heads, kv_heads, mask arguments) with several key blocks per query block
ORDERED = [
    (B("fp16", d_head=64, B_c=32, n_warps=2, deterministic=True), 70, 113, 2, 1, {}),
    (B("bf16", d_head=64, B_c=32, n_warps=2, mask="causal", deterministic=True), 113, 90, 2, 2, {"causal": True, "align": "bottom_right"}),
    (B("fp16", d_head=64, B_c=16, n_warps=4, d_split=4, mask="window", deterministic=True), 70, 100, 2, 1, {"window": (40, 9)}),
    (B("bf16", d_head=64, B_c=32, n_warps=4, d_split=2, mask="causal", deterministic=True, split_scores=True), 113, 90, 2, 1,
     {"causal": True}),
    (B("fp16", d_head=256, n_warps=8, d_split=4, stages=2, deterministic=True, split_scores=True), 70, 150, 2, 1, {}),
]


def _orders(seq_k, B_c):
    n = -(-seq_k // B_c)
    shuffled = list(np.random.default_rng(n).permutation(n))
    return [list(range(n)), list(range(n))[::-1], [int(x) for x in shuffled]]


@pytest.mark.parametrize("case", range(len(ORDERED)))
def test_deterministic_dq_is_the_same_whatever_order_the_ctas_arrive_in(case):
    """With the turn counters every arrival order of the key blocks' CTAs gives dQ bit for bit, the sums of
    ascending key blocks (what the unordered kernel gives when the CTAs happen to come in that order)."""
    cfg, seq_q, seq_k, heads, kv_heads, mask = ORDERED[case]
    inputs = _inputs(case, seq_q, seq_k, heads, kv_heads, cfg.d_head)
    results = [simulate_backward(cfg, *inputs, **mask, key_block_order=o) for o in _orders(seq_k, cfg.B_c)]
    for res in results:
        assert res.ok, res.hazards[:3]
        for name in ("dq", "dk", "dv"):
            assert np.array_equal(getattr(res, name), getattr(results[0], name)), name
    _check(cfg, results[0], inputs, mask)
    ascending = simulate_backward(cfg.replace(deterministic=False), *inputs, **mask)
    assert np.array_equal(ascending.dq, results[0].dq)


def test_without_the_order_dq_depends_on_the_order_the_ctas_arrive_in():
    """The unordered model is what makes the test above able to fail: reversed arrivals round dQ differently."""
    cfg, seq_q, seq_k, heads, kv_heads, mask = ORDERED[0]
    cfg = cfg.replace(deterministic=False)
    inputs = _inputs(0, seq_q, seq_k, heads, kv_heads, cfg.d_head)
    first, last = (simulate_backward(cfg, *inputs, **mask, key_block_order=o) for o in _orders(seq_k, cfg.B_c)[:2])
    assert not np.array_equal(first.dq, last.dq)
    assert np.array_equal(first.dk, last.dk) and np.array_equal(first.dv, last.dv)


class _HighestFirst(BackwardGrid):
    """A grid that starts the key blocks highest first (the simulators' order comes from the plan's grid)."""

    def dispatch_order(self, key_blocks, kv_heads, batch):
        return sorted(super().dispatch_order(key_blocks, kv_heads, batch), key=lambda c: -c[0])


def test_the_ctas_arrive_in_the_order_of_the_plans_grid():
    """Unordered dQ adds come in the order the plan's BackwardGrid starts the CTAs: a grid starting the highest
    key block first gives the sums of reversed arrivals."""
    cfg, seq_q, seq_k, heads, kv_heads, mask = ORDERED[0]
    cfg = cfg.replace(deterministic=False)
    inputs = _inputs(0, seq_q, seq_k, heads, kv_heads, cfg.d_head)
    plan = attrs.evolve(make_backward_plan(cfg), grid=_HighestFirst())
    reversed_ = simulate_backward(cfg, *inputs, **mask, key_block_order=_orders(seq_k, cfg.B_c)[1])
    assert np.array_equal(simulate_backward(plan, *inputs, **mask).dq, reversed_.dq)
    assert not np.array_equal(simulate_backward(cfg, *inputs, **mask).dq, reversed_.dq)


@pytest.mark.parametrize("deterministic", [False, True])
def test_longest_first_gives_the_default_orders_gradients(deterministic):
    """longest_first starts the pairs' CTAs interleaved, but each pair's key blocks still ascending
    (BwdPass.arrivals alike) and CTAs of different pairs share nothing: dQ, dK and dV are the default order's
    bit for bit, ordered adds or not, with no hazard."""
    cfg = B("bf16", d_head=64, B_c=32, n_warps=2, mask="causal", deterministic=deterministic)
    rng = np.random.default_rng(7)
    inputs = tuple(rng.standard_normal((2, s, h, 64)) for s, h in ((70, 4), (113, 2), (113, 2), (70, 4)))
    plans = [make_backward_plan(cfg.replace(longest_first=lf)) for lf in (False, True)]
    assert [p.grid.longest_first for p in plans] == [False, True]
    assert plans[0].grid.dispatch_order(4, 2, 2) != plans[1].grid.dispatch_order(4, 2, 2)
    default, longest = (simulate_backward(p, *inputs, causal=True) for p in plans)
    assert default.ok and longest.ok, longest.hazards[:3]
    assert all(np.array_equal(getattr(default, n), getattr(longest, n)) for n in ("dq", "dk", "dv"))
    _check(cfg, longest, inputs, {"causal": True})


def test_a_wrong_rank_rule_hangs_the_ctas(monkeypatch):
    """Ranks counted over every key block (not only those that visit the query block): a window's later key
    blocks wait for counts that the blocks it skips never add."""
    from flashgen.attention.query_blocks import QueryBlocks

    monkeypatch.setattr(QueryBlocks, "key_rank", lambda self, qb, kb, *args: kb)
    cfg, seq_q, seq_k, heads, kv_heads, mask = ORDERED[2]
    res = simulate_backward(cfg, *_inputs(2, seq_q, seq_k, heads, kv_heads, cfg.d_head), **mask)
    assert any("waits forever for turn" in h for h in res.hazards), res.hazards[:3]


SPLIT = B("fp16", d_head=64, n_warps=8, d_split=2, split_scores=True)


def _moved(plan, step, before):
    """``plan`` with ``step`` of its body moved in front of ``before``."""
    body = [s for s in plan.schedule.body if s != step]
    body.insert(body.index(before), step)
    return attrs.evolve(plan, schedule=attrs.evolve(plan.schedule, body=tuple(body)))


def _gemm_step(plan, name):
    return next(s for s in plan.schedule.body if isinstance(s, Gemm) and s.arg == name)


@pytest.mark.parametrize("stages", [1, 2])
def test_split_scores_schedules_are_clean_with_two_or_three_barriers(stages):
    """Two stages: two barriers per block, the next copies behind the opening one; one stage closes each block."""
    plan = make_backward_plan(SPLIT.replace(stages=stages))
    assert sum(isinstance(s, Barrier) for s in plan.schedule.body) == 4 - stages
    assert plan.closing_barrier == (stages == 1)
    res = simulate_backward(plan, *_inputs(0, 200, 70, 1, 1, 64))
    assert res.ok, res.hazards[:3]


@pytest.mark.parametrize("gemm, tile", [("dV", "sP"), ("dK", "sdS")])
def test_split_scores_dv_or_dk_before_the_score_barrier_is_a_hazard(gemm, tile):
    """dV (dK) moved in front of the barrier after the P^T and dS^T stores reads the other warps' columns unpublished."""
    plan = make_backward_plan(SPLIT)
    broken = _moved(plan, _gemm_step(plan, gemm), Barrier(why="P^T and dS^T visible to all warps"))
    res = simulate_backward(broken, *_inputs(0, 130, 70, 1, 1, 64))
    assert any(tile in h and "no barrier made it visible" in h for h in res.hazards), res.hazards[:3]


def test_split_scores_next_copies_before_the_opening_barrier_are_a_hazard():
    """Block j+1's copies issued before the opening barrier (the order without split_scores) overwrite the stage
    that slower warps' dV and dK of block j-1 still read."""
    plan = make_backward_plan(SPLIT.replace(stages=2))
    body = list(plan.schedule.body)
    opening = next(s for s in body if isinstance(s, Barrier))
    copies = [s for s in body[body.index(opening) + 1:] if isinstance(s, (Copy, Commit))][:5]
    for c in copies:
        body.remove(c)
    body[body.index(opening):body.index(opening)] = copies
    broken = attrs.evolve(plan, schedule=attrs.evolve(plan.schedule, body=tuple(body)))
    res = simulate_backward(broken, *_inputs(0, 200, 70, 1, 1, 64))
    assert any("write-after-read" in h and ("sQ" in h or "sdO" in h) for h in res.hazards), res.hazards[:3]


def test_split_scores_one_stage_without_its_closing_barrier_is_a_hazard():
    plan = make_backward_plan(SPLIT)
    broken = _without(plan, len(plan.schedule.body) - 1)
    res = simulate_backward(broken, *_inputs(0, 200, 70, 1, 1, 64))
    assert any("write-after-read" in h and "sQ" in h for h in res.hazards), res.hazards[:3]


def test_split_scores_without_the_p_store_is_a_hazard():
    plan = make_backward_plan(SPLIT)
    broken = _without(plan, plan.schedule.body.index(next(s for s in plan.schedule.body if s.arg == "P")))
    res = simulate_backward(broken, *_inputs(0, 130, 70, 1, 1, 64))
    assert any("sP rows never written" in h for h in res.hazards), res.hazards[:3]


def test_split_scores_query_columns_of_the_wrong_warp_give_wrong_gradients():
    """Every warp of a group reading the first warp's rows of Q and dO: P^T and dS^T hold the wrong columns."""
    plan = make_backward_plan(SPLIT)
    gemms = dict(plan.gemms)
    for name in ("S", "dP"):
        b = gemms[name].b
        part = attrs.evolve(b.copy.partition, place_row_step=0)
        gemms[name] = attrs.evolve(gemms[name], b=attrs.evolve(b, copy=attrs.evolve(b.copy, partition=part)))
    inputs = _inputs(3, 64, 64, 1, 1, 64)
    res = simulate_backward(attrs.evolve(plan, gemms=gemms), *inputs)
    with pytest.raises(AssertionError):
        _check(SPLIT, res, inputs, {})


# ---- dq_split: dQ's own warp grid ------------------------------------------------------------------------------------

D128, D64 = B.default("bf16", 128), B.default("bf16", 64)
#: (config, seq_q, seq_k, heads, kv_heads, mask arguments): the shipped d_head 128 and 64 shapes with dQ on 4 warps'
#: columns (d_head 128: 32 x 32 warp tiles; 64: 64 x 16), odd lengths, causal, GQA, and dQ's ordered adds
DQ_SPLIT = [
    (D128.replace(dq_split=4), 101, 269, 2, 1, {}),
    (B.default("bf16", 128, "causal").replace(dq_split=4), 113, 70, 4, 2, {"causal": True, "align": "bottom_right"}),
    (D64.replace(dq_split=4), 165, 33, 2, 1, {}),
    (B.default("fp16", 64, "causal").replace(dq_split=4, deterministic=True), 200, 130, 2, 2, {"causal": True}),
    (B("fp16", d_head=96, n_warps=8, d_split=2, dq_split=8, B_r=128, mask="window"), 70, 113, 2, 1, {"window": (20, 3)}),
    # d_head 256 in fours, dQ over all 8 warps' columns (64 x 32 tiles) in two passes of 16 columns
    (B.default("bf16", 256).replace(dq_split=8, deterministic=True), 70, 100, 2, 1, {}),
]


@pytest.mark.parametrize("case", range(len(DQ_SPLIT)))
def test_dq_split_gradients_match_the_reference_and_the_default_grids_dq(case):
    """dQ on its own warp grid: the reference's gradients, and the default grid's dQ bit for bit (each element's sum
    runs over the same k steps in the same order, only another warp makes it)."""
    cfg, seq_q, seq_k, heads, kv_heads, mask = DQ_SPLIT[case]
    inputs = _inputs(case, seq_q, seq_k, heads, kv_heads, cfg.d_head)
    res = simulate_backward(cfg, *inputs, **mask)
    assert res.ok, res.hazards[:3]
    _check(cfg, res, inputs, mask)
    default = simulate_backward(cfg.replace(dq_split=0), *inputs, **mask)
    for name in ("dq", "dk", "dv"):
        assert np.array_equal(getattr(res, name), getattr(default, name)), name


def test_dq_split_ordered_adds_are_the_same_whatever_order_the_ctas_arrive_in():
    cfg, mask = D128.replace(dq_split=4, deterministic=True, mask="causal"), {"causal": True, "align": "bottom_right"}
    inputs = _inputs(7, 70, 300, 2, 1, cfg.d_head)
    results = [simulate_backward(cfg, *inputs, **mask, key_block_order=o) for o in _orders(300, cfg.B_c)]
    for res in results:
        assert res.ok, res.hazards[:3]
        assert np.array_equal(res.dq, results[0].dq)
    _check(cfg, results[0], inputs, mask)


def test_dq_split_loads_on_the_dk_grid_give_wrong_gradients():
    """The K^T load placed on a grid 2 warps wide (dK and dV's) under dq_split 4's adds (4 warps of 32 columns): warps
    2 and 3 of each row multiply the columns of warps 0 and 1, and dQ is wrong."""
    plan = make_backward_plan(D128.replace(dq_split=4))
    g = plan.gemms["dQ"]
    wrong = attrs.evolve(g.b.copy, partition=attrs.evolve(g.b.copy.partition, warp_cols=2))
    broken = attrs.evolve(plan, gemms={**plan.gemms, "dQ": attrs.evolve(g, b=attrs.evolve(g.b, copy=wrong))})
    inputs = _inputs(0, 64, 128, 1, 1, 128)
    res, want = simulate_backward(broken, *inputs), simulate_backward(plan, *inputs)
    assert np.array_equal(res.dk, want.dk) and not np.array_equal(res.dq, want.dq)
