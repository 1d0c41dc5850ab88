"""The wgmma backward on the CPU (flashgen.sim.hopper_backward): dQ, dK, dV of odd shapes against the
float64 gradients within FlashAttention's rule, with no hazard; altered plans (a descriptor offset, the
accumulator-to-A table, the dS^T layout) give wrong gradients and fail their proofs; schedules with a
step missing, moved or a buffer short report the hazard; the CTAs run in the plan's grid order; coverage, proofs
and ``flashgen simulate``."""
from __future__ import annotations

import attrs
import numpy as np
import pytest

from flashgen import engines
from flashgen.attention.backward_grid import BackwardGrid
from flashgen.cli import main
from flashgen.dsl.atoms.hopper import GmmaSwizzle, kmajor_tile_layout
from flashgen.dsl.backward_config import BackwardConfig
from flashgen.dsl.hopper_backward_plan import _schedule as _hopper_schedule, make_hopper_backward_plan
from flashgen.dsl.hopper_backward_smem import DqStage, DsStore
from flashgen.dsl.layout import Layout
from flashgen.dsl.steps import Handoff, Release, WaitFull, WgmmaWait
from flashgen.sim import hardware as hw
from flashgen.sim.grad_reference import gradients
from flashgen.sim.hopper_backward import hopper_backward_coverage, simulate_hopper_backward
from flashgen.sim.verify import hopper_backward_checks


def _cfg(dtype="fp16", d_head=64, mask="none", stages=2, B_r=64):
    return BackwardConfig(dtype, d_head=d_head, B_r=B_r, B_c=128, n_warps=12, engine="wgmma", stages=stages, mask=mask)


#: (config, batch, seq_q, seq_k, heads, kv_heads, mask arguments)
CASES = [
    (_cfg(), 1, 101, 141, 2, 1, {}),
    (_cfg("bf16", mask="causal"), 1, 101, 141, 2, 1, {"causal": True}),
    (_cfg("fp16", mask="causal", stages=1), 1, 101, 141, 2, 1, {"causal": True, "align": "bottom_right"}),
    (_cfg("bf16", mask="window"), 1, 141, 101, 2, 1, {"window": (40, 7)}),
    (_cfg("bf16", stages=1), 2, 1, 1, 1, 1, {}),
    # key block 1 meets no query: its CTA walks no item and writes zero dK, dV
    (_cfg("fp16", mask="causal"), 1, 1, 141, 2, 1, {"causal": True}),
    (_cfg("fp16", mask="causal"), 1, 70, 141, 4, 2, {"causal": True, "align": "bottom_right"}),
    (_cfg("bf16", d_head=128, mask="causal"), 1, 101, 141, 2, 1, {"causal": True, "align": "bottom_right"}),
    # ordered dQ adds: the query blocks walked upwards, the turns around each add
    (_cfg("fp16", mask="causal").replace(deterministic=True), 1, 101, 141, 4, 2, {"causal": True}),
    # query blocks of 128 rows (d_head 64's shipped shape): dQ split by rows, dS^T made with P^T
    (_cfg(B_r=128), 1, 301, 141, 2, 1, {}),
    (_cfg("bf16", mask="causal", B_r=128), 1, 141, 269, 2, 1, {"causal": True}),
    (_cfg("fp16", mask="causal", stages=1, B_r=128), 1, 269, 141, 4, 2, {"causal": True, "align": "bottom_right"}),
    (_cfg("bf16", mask="window", B_r=128), 1, 301, 101, 2, 1, {"window": (40, 7)}),
    (_cfg("bf16", stages=1, B_r=128), 2, 1, 1, 1, 1, {}),
    (_cfg("fp16", mask="causal", B_r=128).replace(deterministic=True), 1, 269, 141, 4, 2, {"causal": True}),
    # query blocks of 80 rows at d_head 128: dQ^T = K^T dS^T, dS stored [query][key] by stmatrix .trans
    (_cfg("bf16", d_head=128, B_r=80), 1, 201, 141, 2, 1, {}),
    (_cfg("fp16", d_head=128, mask="causal", stages=1, B_r=80), 1, 101, 141, 4, 2, {"causal": True, "align": "bottom_right"}),
    (_cfg("bf16", d_head=128, mask="window", B_r=80), 1, 241, 101, 2, 1, {"window": (40, 7)}),
    (_cfg("fp16", d_head=128, mask="causal", B_r=80).replace(deterministic=True), 1, 171, 141, 4, 2, {"causal": True}),
]
#: every case past 64 rows again with exp_first (the exponentials under dP^T's GEMM)
CASES += [(cfg.replace(exp_first=True), *rest) for cfg, *rest in CASES if cfg.B_r > 64]


def _inputs(seed, batch, seq_q, seq_k, heads, kv_heads, d):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((batch, seq_q, heads, d)), rng.standard_normal((batch, seq_k, kv_heads, d)),
            rng.standard_normal((batch, seq_k, kv_heads, d)), rng.standard_normal((batch, seq_q, heads, d)))


class _HighestFirst(BackwardGrid):
    """A grid that starts the key blocks highest first (the simulator's order comes from the plan's grid)."""

    def dispatch_order(self, key_blocks, kv_heads, batch):
        return sorted(super().dispatch_order(key_blocks, kv_heads, batch), key=lambda c: -c[0])


def test_the_ctas_run_in_the_order_of_the_plans_grid():
    """The CTAs run in the order the plan's BackwardGrid starts them: started highest key block first, the
    unordered dQ sums round differently, and dK, dV (each one CTA's own) stay the same."""
    cfg = _cfg()
    inputs = _inputs(0, 1, 101, 301, 2, 1, cfg.d_head)  # three key blocks (two add in either order alike)
    plan = make_hopper_backward_plan(cfg)
    ascending, highest = (simulate_hopper_backward(p, *inputs) for p in (plan, attrs.evolve(plan, grid=_HighestFirst())))
    assert ascending.ok and highest.ok
    assert not np.array_equal(ascending.dq, highest.dq)
    assert np.array_equal(ascending.dk, highest.dk) and np.array_equal(ascending.dv, highest.dv)


@pytest.mark.parametrize("deterministic", [False, True])
def test_longest_first_gives_the_default_orders_gradients(deterministic):
    """longest_first starts the pairs' CTAs interleaved, each pair's key blocks still ascending, and CTAs of
    different pairs share nothing: dQ, dK and dV are the default order's bit for bit, with no hazard."""
    cfg = _cfg(mask="causal").replace(deterministic=deterministic)
    inputs = _inputs(3, 2, 101, 301, 4, 2, cfg.d_head)  # 2 batch entries x 2 kv heads x 3 key blocks
    plans = [make_hopper_backward_plan(cfg.replace(longest_first=lf)) for lf in (False, True)]
    assert [p.grid.longest_first for p in plans] == [False, True]
    default, longest = (simulate_hopper_backward(p, *inputs, causal=True) for p in plans)
    assert default.ok and longest.ok, longest.hazards[:3]
    assert all(np.array_equal(getattr(default, n), getattr(longest, n)) for n in ("dq", "dk", "dv"))
    errors = _errors(cfg, longest, inputs, {"causal": True})
    assert all(err <= bound for err, bound in errors.values()), errors


def _errors(cfg, res, inputs, mask):
    """(error, bound) of dq, dk, dv: FlashAttention's rule, 2x the error of the same math at the kernel's
    16-bit roundings plus a small absolute slack."""
    r16 = lambda x: hw.decode(hw.encode(x, cfg.dtype), cfg.dtype).astype(np.float64)  # noqa: E731
    vals = [r16(x) for x in inputs]
    ref, lowp = gradients(*vals, **mask), gradients(*vals, **mask, round16=r16)
    return {n: (np.abs(got - want).max(), 2 * np.abs(base - want).max() + 1e-3)
            for n, got, want, base in zip(("dq", "dk", "dv"), (res.dq, res.dk, res.dv), ref, lowp)}


@pytest.mark.parametrize("case", range(len(CASES)))
def test_simulated_gradients_match_the_reference(case):
    cfg, *shape, mask = CASES[case]
    inputs = _inputs(case, *shape, cfg.d_head)
    res = simulate_hopper_backward(cfg, *inputs, **mask)
    assert res.ok, res.hazards[:3]
    for name, (err, bound) in _errors(cfg, res, inputs, mask).items():
        assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g}"


PLAN = make_hopper_backward_plan(_cfg())
#: query blocks of 128 rows: each consumer's dQ reads its own query columns of dS^T
ROWS = make_hopper_backward_plan(_cfg(B_r=128))
INPUTS = _inputs(0, 1, 101, 141, 2, 1, 64)
#: query blocks of 80 rows at d_head 128: dQ^T's A is K^T (the consumer's columns), its B the [query][key] dS tile
T80 = make_hopper_backward_plan(_cfg("bf16", d_head=128, B_r=80))
INPUTS_128 = _inputs(0, 1, 201, 141, 2, 1, 128)


def _with_gemm(name, operand, plan=PLAN, **changes):
    g = plan.gemms[name]
    return attrs.evolve(plan, gemms={**plan.gemms, name: attrs.evolve(g, **{operand: attrs.evolve(getattr(g, operand), **changes)})})


def _swapped_steps(name, operand, plan=PLAN):
    steps = list(getattr(plan.gemms[name], operand).step_offsets)
    steps[0], steps[1] = steps[1], steps[0]
    return _with_gemm(name, operand, plan, step_offsets=tuple(steps))


def _dq_split(plan, **changes):
    return attrs.evolve(plan, dq_stage=attrs.evolve(plan.dq_stage, **changes))


def _swapped_a_from_acc():
    table = [list(step) for step in PLAN.a_from_acc]
    table[1][2] = table[1][2][::-1]
    return attrs.evolve(PLAN, a_from_acc=tuple(tuple(step) for step in table))


def _ds_layout(swizzle, plan=PLAN):
    tile = plan.tiles["dS"]
    layout = kmajor_tile_layout(tile.rows, tile.cols, plan.cfg.dtype, swizzle)
    return attrs.evolve(plan, tiles={**plan.tiles, "dS": attrs.evolve(tile, layout=layout)})


def _staged_layout(grad, swizzle, plan=PLAN):
    """dK's or dV's store staged in another swizzle than its TMA boxes read."""
    store = plan.stores[grad]
    tile = attrs.evolve(store.tile, layout=kmajor_tile_layout(store.tile.rows, store.tile.cols, plan.cfg.dtype, swizzle))
    return attrs.evolve(plan, stores={**plan.stores, grad: attrs.evolve(store, tile=tile)})


@attrs.frozen
class _SwappedKeyHalves(DsStore):
    """A transposed dS store whose lanes address the other 8 keys of their 8x8 block's 16-key slice."""

    def lane_row(self, t, lane, warp, consumer):
        query, key = super().lane_row(t, lane, warp, consumer)
        return query, key ^ 8


@pytest.mark.parametrize("broken, check, wrong", [
    (lambda: _swapped_steps("S", "b"), "descriptors S", ("dq", "dk", "dv")),
    (lambda: _swapped_steps("dV", "b"), "descriptors dV", ("dv",)),
    (lambda: _swapped_steps("dQ", "a"), "descriptors dQ", ("dq",)),
    (lambda: _with_gemm("dQ", "b", row_block_offset=0), "descriptors dQ", ("dq",)),
    (lambda: _with_gemm("S", "a", row_block_offset=0), "descriptors S", ("dq", "dk", "dv")),
    (_swapped_a_from_acc, "a_from_acc (P^T -> dV)", ("dk", "dv")),
    (lambda: _ds_layout(GmmaSwizzle.B64), "dS stores = dQ's dS operand reads", ("dq",)),
    (lambda: _with_gemm("dQ", "a", ROWS, row_block_offset=0), "descriptors dQ", ("dq",)),
    (lambda: _swapped_steps("dV", "b", ROWS), "descriptors dV", ("dv",)),
    (lambda: _swapped_steps("dQ", "a", ROWS), "dS stores = dQ's dS operand reads", ("dq",)),
    (lambda: _ds_layout(GmmaSwizzle.B64, T80), "dS stores = dQ's dS operand reads", ("dq",)),
    (lambda: attrs.evolve(T80, ds_store=_SwappedKeyHalves(True, 80)), "dS stores = dQ's dS operand reads", ("dq",)),
    (lambda: _with_gemm("dQ", "a", T80, row_block_offset=0), "descriptors dQ", ("dq",)),
    (lambda: _swapped_steps("dQ", "b", T80), "descriptors dQ", ("dq",)),
    (lambda: _swapped_steps("dK", "b", T80), "descriptors dK", ("dk",)),
    (lambda: _staged_layout("dK", GmmaSwizzle.B64), "dK store boxes", ("dk",)),
    (lambda: _staged_layout("dV", GmmaSwizzle.B64, T80), "dV store boxes", ("dv",)),
])
def test_an_altered_plan_gives_wrong_gradients_and_fails_its_proof(broken, check, wrong):
    plan = broken()
    failing = [c.name for c in hopper_backward_checks(plan) if not c.ok]
    assert check in failing
    inputs = INPUTS if plan.cfg.d_head == 64 else INPUTS_128
    errors = _errors(plan.cfg, simulate_hopper_backward(plan, *inputs), inputs, {})
    assert all(errors[n][0] > 10 * errors[n][1] for n in wrong), errors


@pytest.mark.parametrize("changes", [{"by_rows": False}, {"by_rows": False, "cols": 32}, {"rows": 32}])
def test_a_dq_split_that_misses_rows_or_columns_fails_its_proof(changes):
    """The consumers' dQ tiles must cover the 128 x 64 query block once, each the dQ GEMM's 64 x 64."""
    assert [c.name for c in hopper_backward_checks(ROWS) if not c.ok] == []
    assert "barriers and ring" in [c.name for c in hopper_backward_checks(_dq_split(ROWS, **changes)) if not c.ok]


#: the plans whose consumers stage dQ in shared memory: ordered adds, and the producer's adds of dQ^T (80-row blocks)
STAGED_DQ = [BackwardConfig.wgmma("bf16", 64).replace(deterministic=True), BackwardConfig.wgmma("bf16", 128).replace(deterministic=True),
             BackwardConfig.wgmma("bf16", 128)]


@pytest.mark.parametrize("cfg", [BackwardConfig.wgmma("bf16", 128), BackwardConfig.wgmma("bf16", 128, "causal"), BackwardConfig.wgmma("fp16", 64),
                                 BackwardConfig.wgmma("bf16", 128).replace(deterministic=True)], ids=lambda c: c.short_form())
def test_the_producer_adds_dq_where_the_tile_is_transposed_and_unordered(cfg):
    """dQ^T (80-row query blocks) with unordered adds goes through the consumers' regions and the producer's bulk
    reductions, which free them through dq_empty; every other plan adds dQ from the consumers, with no such barrier."""
    plan = make_hopper_backward_plan(cfg)
    st = plan.dq_stage
    assert st.by_producer == (st.transposed and not cfg.deterministic)
    assert ("dq_empty" in plan.barriers) == st.by_producer
    assert [c.name for c in hopper_backward_checks(plan) if not c.ok] == []


def test_the_producer_adds_without_their_barrier_or_direct_adds_with_it_fail_the_barrier_check():
    plan = make_hopper_backward_plan(BackwardConfig.wgmma("bf16", 128))
    without = attrs.evolve(plan, barriers={k: v for k, v in plan.barriers.items() if k != "dq_empty"})
    for broken in (without, _dq_split(plan, by_producer=False)):
        assert "barriers and ring" in [c.name for c in hopper_backward_checks(broken) if not c.ok]
    with pytest.raises(ValueError, match="by_producer"):
        attrs.evolve(plan.dq_stage, staged=True)


@pytest.mark.parametrize("cfg", STAGED_DQ, ids=lambda c: c.short_form())
def test_dq_staged_over_another_tile_corrupts_it_and_fails_the_smem_check(cfg):
    """The deterministic backward stages dQ in shared memory before its bulk reduction, and so do the consumers of
    the producer's reductions: a region placed over sK overwrites K rows that the next items' GEMMs still read
    (wrong dQ), and the shared-memory check names the overlap."""
    plan = make_hopper_backward_plan(cfg)
    d_head = cfg.d_head
    assert plan.dq_stage.in_smem and plan.dq_stage.by_producer == (not cfg.deterministic)
    assert hopper_backward_coverage(plan)["smem"].ok
    broken = _dq_split(plan, offset=plan.tiles["K"].offset)
    cov = hopper_backward_coverage(broken)["smem"]
    assert not cov.ok and "sK" in cov.detail and "sdQ" in cov.detail, cov.detail
    inputs = INPUTS if d_head == 64 else INPUTS_128
    good = _errors(plan.cfg, simulate_hopper_backward(plan, *inputs), inputs, {})["dq"]
    assert good[0] <= good[1], good
    errors = _errors(broken.cfg, simulate_hopper_backward(broken, *inputs), inputs, {})
    assert not errors["dq"][0] <= 10 * errors["dq"][1], errors  # wrong or NaN (fp32 bits read as 16-bit K)


@attrs.frozen
class _SharedSlots(DqStage):
    """A staging order in which values 0 and 1 of every thread share a slot (the second overwrites the first)."""

    def slot(self, thread, value):
        return super().slot(thread, value - (value == 1))


@pytest.mark.parametrize("cfg", STAGED_DQ[1:], ids=lambda c: c.short_form())
def test_a_staging_order_that_reuses_a_slot_loses_dq_values(cfg):
    """Each accumulator value of a staged dQ needs its own slot: where two share one, the bulk reduction adds the
    second twice and the first never, and the simulated dQ is wrong (dK is not)."""
    plan = make_hopper_backward_plan(cfg)
    broken = attrs.evolve(plan, dq_stage=_SharedSlots(**attrs.asdict(plan.dq_stage, recurse=False)))
    errors = _errors(broken.cfg, simulate_hopper_backward(broken, *INPUTS_128), INPUTS_128, {})
    assert errors["dq"][0] > 10 * errors["dq"][1] and errors["dk"][0] <= errors["dk"][1], errors


def test_a_staging_layout_that_splits_a_value_pair_is_flagged():
    """dK staged in a column-major tile (columns c and c + 1 a tile height apart): a 32-bit store of the pair cannot
    write both, so the simulator names the hazard (and the dK store boxes' proof fails)."""
    store = PLAN.stores["dK"]
    tile = attrs.evolve(store.tile, layout=Layout((store.tile.rows, store.tile.cols), (1, store.tile.rows)))
    plan = attrs.evolve(PLAN, stores={**PLAN.stores, "dK": attrs.evolve(store, tile=tile)})
    assert "dK store boxes" in [c.name for c in hopper_backward_checks(plan) if not c.ok]
    res = simulate_hopper_backward(plan, *INPUTS)
    assert any("a 32-bit store of columns (c, c + 1)" in h for h in res.hazards), res.hazards[:3]


def _schedule(plan, schedule):
    return attrs.evolve(plan, schedule=tuple(schedule))


def _without(step, plan=PLAN):
    i = plan.schedule.index(step)
    return _schedule(plan, plan.schedule[:i] + plan.schedule[i + 1:])


def _moved(step, before, plan=PLAN):
    rest = [s for s in plan.schedule if s != step]
    i = rest.index(before)
    return _schedule(plan, rest[:i] + [step] + rest[i:])


def _one_ds_buffer(stages):
    plan = make_hopper_backward_plan(_cfg(stages=stages))
    return attrs.evolve(plan, tiles={**plan.tiles, "dS": attrs.evolve(plan.tiles["dS"], stages=1)})


def _empty_count(count):
    bar, off, stages = PLAN.barriers["q_empty"]
    return attrs.evolve(PLAN, barriers={**PLAN.barriers, "q_empty": (attrs.evolve(bar, arrive_count=count), off, stages)})


S_READY = WgmmaWait("1", why="S^T ready (dP^T may still run)")
DQ_READY = WgmmaWait("1", why="dV and dQ done (dK may still run)")
DK_DONE = WgmmaWait("0", why="dK done: Q and dO read for the last time")
REDUCE_DQ = next(s for s in PLAN.schedule if s.op == "reduce_gm")


@pytest.mark.parametrize("broken, words", [
    (lambda: _without(S_READY), "touches S while wgmma group S[item 0] writing it is in flight"),
    (lambda: _without(DK_DONE), "still reads it"),
    (lambda: _without(Handoff("dS", why="every consumer's dS^T rows stored (and visible to wgmma)")), "dS^T rows"),
    (lambda: _without(WaitFull("dO", why="dO and its D landed")), "without its wait_full"),
    (lambda: _moved(Release("Q"), S_READY), "releases Q of item 0 while wgmma group"),
    (lambda: _moved(Release("Q"), DK_DONE), "releases Q of item 0 while wgmma group"),  # dK still reads Q
    (lambda: _moved(REDUCE_DQ, DQ_READY), "touches dQ while wgmma group dQ[item 0] writing it is in flight"),
    (lambda: _one_ds_buffer(2), "overwrites its dS^T rows"),
    (lambda: _empty_count(4), "holds item"),
    (lambda: _empty_count(PLAN.release_arrivals * PLAN.consumers + 1), "deadlock"),
])
def test_a_broken_schedule_is_a_hazard(broken, words):
    res = simulate_hopper_backward(broken(), *INPUTS)
    assert any(words in h for h in res.hazards), res.hazards[:3]


def _released_before_the_dq_store(plan):
    """Q and dO released before dQ's store (moved to the item's end): the producer may reduce the regions first."""
    reduce = _first("reduce_gm", plan)
    return _schedule(plan, [s for s in plan.schedule if s != reduce] + [reduce])


def test_the_producer_reducing_dq_before_the_consumers_stored_it_is_flagged():
    """Where the producer adds dQ (T80) it reduces an item's regions once the item's stages come back: released
    before the consumers store dQ, it reads the last item's regions (the hazard names it; dQ is wrong)."""
    assert T80.dq_stage.by_producer
    broken = _released_before_the_dq_store(T80)
    assert [s.op for s in broken.schedule][-3:] == ["release", "release", "reduce_gm"]
    res = simulate_hopper_backward(broken, *INPUTS_128)
    assert any("region holds item" in h for h in res.hazards), res.hazards[:3]
    errors = _errors(broken.cfg, res, INPUTS_128, {})
    assert errors["dq"][0] > 10 * errors["dq"][1] and errors["dk"][0] <= errors["dk"][1], errors
    clean = simulate_hopper_backward(T80, *INPUTS_128)
    assert clean.hazards == [] and all(e <= b for e, b in _errors(T80.cfg, clean, INPUTS_128, {}).values())


DP_READY = WgmmaWait("0", why="dP^T ready")


def _first(op, plan, arg=None):
    return next(s for s in plan.schedule if s.op == op and (arg is None or s.arg == arg))


@pytest.mark.parametrize("plan, inputs", [(make_hopper_backward_plan(_cfg(B_r=128).replace(exp_first=True)), INPUTS),
                                          (make_hopper_backward_plan(_cfg("bf16", d_head=128, B_r=80).replace(exp_first=True)),
                                           INPUTS_128)], ids=["d64_br128", "d128_br80"])
@pytest.mark.parametrize("broken, words", [
    # dS^T made from dP^T's accumulators while its GEMM still writes them
    (lambda p: _moved(_first("grad_scores", p), DP_READY, p), "touches dP while wgmma group dP[item 0] writing it is in flight"),
    (lambda p: _without(DP_READY, p), "touches dP while wgmma group dP[item 0] writing it is in flight"),
    # the exponentials before S^T retired
    (lambda p: _moved(_first("recompute_P", p), S_READY, p), "touches S while wgmma group S[item 0] writing it is in flight"),
    # dV issued before its A fragments are made (they are overwritten under it), or with none made
    (lambda p: _moved(_first("gemm", p, "dV"), _first("convert_P", p, "P"), p), "overwrites P while wgmma group dV[item 0] reading it"),
    (lambda p: _without(_first("convert_P", p, "P"), p), "P holds None, expected P of item 0"),
    # dK's fragments made after the dS^T store but from dP^T's accumulators before dS^T (moved ahead of GradScores)
    (lambda p: _moved(_first("convert_P", p, "dS"), _first("grad_scores", p), p), "dP holds ('dP', 0), expected dS of item 0"),
])
def test_a_broken_exp_first_schedule_is_a_hazard(plan, inputs, broken, words):
    """The wide query blocks' order (exponentials under dP^T, dS^T after its wait, dV after its fragments): each
    step moved ahead of what it needs is reported."""
    assert plan.score_order == "exp_first"
    res = simulate_hopper_backward(broken(plan), *inputs)
    assert any(words in h for h in res.hazards), res.hazards[:3]


@pytest.mark.parametrize("order", ["split", "fused", "exp_first"])
def test_every_score_order_gives_the_gradients(order):
    """The orders differ in registers only: each, in a causal plan of 128-row query blocks, is hazard-free and right."""
    cfg, mask = _cfg("bf16", mask="causal", B_r=128), {"causal": True}
    plan = make_hopper_backward_plan(cfg)
    plan = attrs.evolve(plan, score_order=order, schedule=_hopper_schedule(cfg.deterministic, order))
    inputs = _inputs(3, 1, 141, 269, 2, 1, cfg.d_head)
    res = simulate_hopper_backward(plan, *inputs, **mask)
    assert res.ok, res.hazards[:3]
    for name, (err, bound) in _errors(cfg, res, inputs, mask).items():
        assert err <= bound, f"{order} {name}: max error {err:.3g} > {bound:.3g}"


def test_the_wide_cases_run_both_orders_of_their_size():
    """The gradient cases of 80- and 128-row query blocks (odd lengths, causal, window, GQA, ordered adds) check the
    shipped fused order and, each again, exp_first."""
    wide = [make_hopper_backward_plan(cfg).score_order for cfg, *_ in CASES if cfg.B_r > 64]
    assert sorted(wide) == ["exp_first"] * 10 + ["fused"] * 10


def test_one_ds_buffer_is_safe_with_one_ring_stage():
    """With one stage, a consumer's next dS^T store comes after its wait for the next Q, which the producer
    fills only once every consumer released this block's Q, after its dQ GEMM retired: no hazard."""
    res = simulate_hopper_backward(_one_ds_buffer(1), *INPUTS)
    assert res.ok, res.hazards[:3]


@pytest.mark.parametrize("d_head, stages, B_r", [(64, 1, 64), (64, 2, 64), (128, 2, 64), (128, 2, 80), (128, 1, 80)])
def test_the_shipped_plans_are_covered_and_proven(d_head, stages, B_r):
    plan = make_hopper_backward_plan(_cfg("bf16", d_head=d_head, stages=stages, B_r=B_r))
    cov = hopper_backward_coverage(plan)
    assert all(c.ok for c in cov.values()), {n: c.detail for n, c in cov.items() if not c.ok}
    assert engines.verify_plan(plan).ok


@attrs.frozen
class _FirstKeyHalf(DsStore):
    """A transposed dS store whose lanes all address the first 8 keys of their 16-key slice."""

    def lane_row(self, t, lane, warp, consumer):
        query, key = super().lane_row(t, lane, warp, consumer)
        return query, key & ~8


def test_a_transposed_ds_store_that_misses_keys_fails_coverage():
    """stmatrix .trans lanes addressing the first 8 keys for both 8x8 blocks of a 16-key slice store them twice."""
    assert hopper_backward_coverage(T80)["store_dS"].ok
    cov = hopper_backward_coverage(attrs.evolve(T80, ds_store=_FirstKeyHalf(True, 80)))["store_dS"]
    assert not cov.ok


def test_a_tile_layout_other_than_tma_s_fails_coverage():
    tile = PLAN.tiles["Q"]
    layout = kmajor_tile_layout(tile.rows, tile.cols, PLAN.cfg.dtype, GmmaSwizzle.B64)
    plan = attrs.evolve(PLAN, tiles={**PLAN.tiles, "Q": attrs.evolve(tile, layout=layout)},
                        loads={**PLAN.loads, "Q": attrs.evolve(PLAN.loads["Q"], tile=attrs.evolve(tile, layout=layout))})
    cov = hopper_backward_coverage(plan)
    assert not cov["tma_Q"].ok and "where the tile layout does not" in cov["tma_Q"].detail
    assert cov["tma_K"].ok


def test_flashgen_simulate_reports_the_wgmma_backward(capsys):
    name = "bwd(BF16, 128, 64, 128, 12): wgmma+swizzled+stages_2"
    rep = engines.simulate_config(name)
    assert rep["ok"] and rep["engine"] == "wgmma" and rep["kind"] == "backward" and rep["grads"]["ok"]
    assert set(rep["coverage"]) == {"tma_K", "tma_V", "tma_Q", "tma_dO", "store_dS", "smem"}
    assert main(["simulate", name, "-q"]) == 0
    out = capsys.readouterr().out
    assert "backward pass (dQ, dK, dV vs float64): ok" in out and "coverage (tma_K" in out


def test_ordered_adds_walk_the_query_blocks_upwards_and_take_turns():
    """With ordered dQ adds a CTA must not start at item kb (it would wait for the lower key blocks' adds
    of that query block, which they make last), and every add sits between its turn and its pass."""
    plain, ordered = make_hopper_backward_plan(_cfg()), make_hopper_backward_plan(_cfg().replace(deterministic=True))
    assert plain.items.order(5, 1, 2) == [(0, q) for q in (2, 3, 4, 0, 1)] and ordered.items.order(5, 1, 2) == [(0, q) for q in range(5)]
    ops = [s.op for s in ordered.schedule]
    at = ops.index("reduce_gm")
    assert ops[at - 1:at + 2] == ["wait_order", "reduce_gm", "signal_order"]
    assert "wait_order" not in [s.op for s in plain.schedule]
