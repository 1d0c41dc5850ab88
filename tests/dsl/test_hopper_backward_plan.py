"""The wgmma backward's plan (flashgen.dsl.hopper_backward_plan) at both query block sizes: the GEMM shapes and
accumulator sizes follow B_r, the dQ split follows it (columns at 64 rows, rows at 128), the score steps run in the
order the registers and the ``exp_first`` knob ask for, and the config rules accept exactly the shapes the plan can
build."""
from __future__ import annotations

import attrs
import pytest

from flashgen.dsl.backward_config import WGMMA_B_R, WGMMA_B_RS, BackwardConfig
from flashgen.dsl.config import SMEM_LIMIT_BYTES, ConfigError
from flashgen.dsl.hopper_backward_plan import _schedule, make_hopper_backward_plan
from flashgen.dsl.steps import Gemm, WgmmaWait

W = BackwardConfig.wgmma


def _shapes(plan):
    """GEMM -> (N, k16 steps) and the A-fragment steps of dV / dK."""
    return {name: (g.atom.N, g.k_steps) for name, g in plan.gemms.items()}, len(plan.a_from_acc)


def test_the_shipped_query_blocks_follow_the_head_size_and_the_mask():
    """128 rows at d_head 64; at d_head 128, 80 unmasked and 64 where a causal or window diagonal cuts the blocks."""
    assert [W("bf16", 64, m).B_r for m in ("none", "causal", "window")] == [128, 128, 128]
    assert [W("fp16", 128, m).B_r for m in ("none", "causal", "window")] == [80, 64, 64]
    assert all(rows in WGMMA_B_RS[d] for d, pair in WGMMA_B_R.items() for rows in pair)


@pytest.mark.parametrize("cfg, gemms", [
    # d_head 64, 128-row query blocks: S^T, dP^T 64 x 128 over d; dV, dK 64 x 64 over 128 query rows; dQ 64 x 64 over B_c
    (W("bf16", 64), {"S": (128, 4), "dP": (128, 4), "dV": (64, 8), "dK": (64, 8), "dQ": (64, 8)}),
    # d_head 64, 64-row query blocks: dQ's columns halved between the consumers
    (W("bf16", 64).replace(B_r=64, exp_first=False), {"S": (64, 4), "dP": (64, 4), "dV": (64, 4), "dK": (64, 4), "dQ": (32, 8)}),
    (W("fp16", 128, "causal"), {"S": (64, 8), "dP": (64, 8), "dV": (128, 4), "dK": (128, 4), "dQ": (64, 8)}),
    # d_head 128, 80-row query blocks: dQ^T = K^T dS^T, 64 columns of d_head x 80 query rows per consumer
    (W("bf16", 128).replace(B_r=80), {"S": (80, 8), "dP": (80, 8), "dV": (128, 5), "dK": (128, 5), "dQ": (80, 8)}),
], ids=str)
def test_gemm_shapes_follow_the_query_block(cfg, gemms):
    plan = make_hopper_backward_plan(cfg)
    assert _shapes(plan) == (gemms, cfg.B_r // 16)
    assert plan.dq_cols * 64 * cfg.consumers == cfg.B_r * cfg.d_head
    assert plan.dq_stage.by_rows == (cfg.B_r == 128)
    assert plan.dq_stage.transposed == plan.ds_store.trans == (cfg.B_r == 80)
    assert (plan.tiles["dS"].rows, plan.tiles["dS"].cols) == ((80, 128) if cfg.B_r == 80 else (128, cfg.B_r))


def _in_flight(schedule, op):
    """The GEMMs in flight when one item's ``op`` step runs (from an idle start: the previous item ends with
    wgmma_wait 0), and the GEMMs issued before it."""
    flight, issued = [], []
    for s in schedule:
        if s.op == op:
            return tuple(flight), tuple(issued)
        if isinstance(s, Gemm):
            flight.append(s.arg)
            issued.append(s.arg)
        elif isinstance(s, WgmmaWait):
            flight = flight[len(flight) - int(s.arg):]
    raise AssertionError(f"no {op} step")


#: where the exponentials, dS^T and its store run against the GEMMs, per score order: (in flight, issued) at
#: RecomputeP, GradScores and the dS^T store
STEPS = ("recompute_P", "grad_scores", "store_rf")
ORDERS = {
    # exponentials under dP^T, dS^T once it retired, dV after dS^T's store
    "exp_first": ((("dP",), ("S", "dP")), ((), ("S", "dP")), ((), ("S", "dP"))),
    # dV issued before dP^T's wait, dS^T under dV
    "split": ((("dP",), ("S", "dP")), (("dV",), ("S", "dP", "dV")), (("dV",), ("S", "dP", "dV"))),
    # one pass after both
    "fused": (((), ("S", "dP")), ((), ("S", "dP")), (("dV",), ("S", "dP", "dV"))),
}


@pytest.mark.parametrize("cfg, order", [
    (W("bf16", 64).replace(exp_first=False), "fused"), (W("fp16", 64, "causal", stages=1).replace(deterministic=True), "fused"),
    (W("bf16", 128).replace(B_r=80), "fused"), (W("fp16", 128, "window").replace(B_r=80, deterministic=True), "fused"),
    (W("bf16", 64).replace(B_r=64, exp_first=False), "split"), (W("bf16", 128, "causal"), "split"),
    (W("fp16", 128, stages=1).replace(B_r=64, deterministic=True), "split"),
], ids=str)
def test_the_shipped_orders_wait_for_both_gemms_past_64_rows(cfg, order):
    """Without ``exp_first``: wider than one wgmma M, the fp32 P^T, its fragments and dP^T would not fit beside dK and
    dV with dV issued before dP^T's wait, so both GEMMs are waited for and one pass makes P^T and dS^T; 64-row query
    blocks issue dV before dP^T's wait. With it: the exponentials run while dP^T's GEMM does, dS^T once it retired,
    dV after dS^T's store."""
    plan = make_hopper_backward_plan(cfg)
    assert plan.score_order == order and plan.grad_with_p == (order == "fused")
    assert tuple(_in_flight(plan.schedule, op) for op in STEPS) == ORDERS[order]
    if cfg.B_r > 64:
        plan = make_hopper_backward_plan(cfg.replace(exp_first=True))
        assert plan.score_order == "exp_first" and not plan.grad_with_p
        assert tuple(_in_flight(plan.schedule, op) for op in STEPS) == ORDERS["exp_first"]


def test_every_order_schedules_each_step_once():
    """Each order is the same steps but its waits in another sequence (the tail from the dS handoff on unchanged)."""
    plan = make_hopper_backward_plan(W("bf16", 64).replace(exp_first=True))
    schedules = {o: _schedule(plan.cfg.deterministic, o) for o in ORDERS}
    assert schedules["exp_first"] == plan.schedule
    assert len({tuple(sorted(str(s) for s in sched if not isinstance(s, WgmmaWait))) for sched in schedules.values()}) == 1
    tails = {sched[[s.op for s in sched].index("handoff"):] for sched in schedules.values()}
    assert len(tails) == 1
    for o, sched in schedules.items():
        assert tuple(_in_flight(sched, op) for op in STEPS) == ORDERS[o]
    with pytest.raises(ValueError, match="score_order"):
        attrs.evolve(plan, score_order="p_first")


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("d_head, B_r", [(64, 128), (128, 64), (128, 80)])
def test_every_shipped_variant_fits_shared_memory(d_head, B_r, stages, deterministic):
    cfg = W("bf16", d_head, "causal", stages=stages).replace(deterministic=deterministic, B_r=B_r)
    assert cfg.smem_bytes == make_hopper_backward_plan(cfg).smem_bytes <= SMEM_LIMIT_BYTES


@pytest.mark.parametrize("changes, words", [
    ({"d_head": 128, "B_r": 128}, "B_r=128 at d_head=128"),
    ({"B_r": 192}, "B_r=192 at d_head=64"),
    ({"n_warps": 8, "B_c": 64}, "1 consumer(s) take B_r up to 64"),
    ({"B_r": 80}, "B_r=80 at d_head=64"),
    ({"d_head": 128, "B_r": 80, "n_warps": 8, "B_c": 64}, "d_head=128 needs 2 consumer(s)"),
])
def test_query_blocks_the_plan_cannot_build_are_refused(changes, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        W("bf16", 64).replace(**changes)


def test_exp_first_names_and_round_trips(tmp_path):
    """The knob's flag and mangled word (after the others); left out of the dict, so of the names and hashes, where
    off; read back from its short form (its flag anywhere), its dict, a YAML file and a sweep over it."""
    import yaml

    from flashgen.dsl.configs import load, parse_short_form, to_record
    from flashgen.emit.sweep import parse_sweep

    cfg = W("bf16", 128).replace(exp_first=True)
    assert cfg.short_form() == "bwd(BF16, 128, 80, 128, 12): wgmma+swizzled+stages_2+exp_first"
    assert cfg.mangle() == "flash_bwd_bf16_d128_br80_bc128_w12_wgmma_swz_s2_ef"
    det = W("fp16", 64, "causal", stages=1).replace(deterministic=True, exp_first=True)
    assert det.short_form() == "bwd(FP16, 64, 128, 128, 12): wgmma+swizzled+causal+deterministic+exp_first"
    assert det.mangle() == "flash_bwd_fp16_d64_br128_bc128_w12_wgmma_swz_causal_det_ef"
    off = cfg.replace(exp_first=False)
    assert "exp_first" not in off.to_dict() and cfg.to_dict()["exp_first"] is True
    assert off.short_form() == "bwd(BF16, 128, 80, 128, 12): wgmma+swizzled+stages_2" and not off.mangle().endswith("_ef")
    assert len({c.content_hash() for c in (cfg, off)}) == 2
    for c in (cfg, det, off):
        assert parse_short_form(c.short_form()) == c and BackwardConfig.from_dict(c.to_dict()) == c
    assert parse_short_form("bwd(BF16, 128, 80, 128, 12): exp_first+wgmma+stages_2+swizzled") == cfg
    path = tmp_path / "bwd.yaml"
    path.write_text("kind: backward\ndtype: bf16\nd_head: 128\nB_r: 80\nB_c: 128\nn_warps: 12\nengine: wgmma\nstages: 2\n"
                    "exp_first: true\n")
    assert load(str(path)) == cfg
    path.write_text(yaml.safe_dump(to_record(det)))
    assert load(str(path)) == det
    swept = parse_sweep("kind: backward\ndtype: bf16\nd_head: 128\nB_r: [64, 80]\nB_c: 128\nn_warps: 12\nengine: wgmma\n"
                        "stages: 2\nexp_first: [false, true]\n", "s.yaml")
    assert swept.configs == (off.replace(B_r=64), off, cfg)
    assert [s.reason.split(":")[0] for s in swept.invalid] == ["exp_first with B_r=64"]


@pytest.mark.parametrize("cfg, words", [
    (BackwardConfig("bf16", d_head=64, B_r=128, B_c=128, n_warps=8), ["exp_first with engine=mma_sync", "engine=wgmma"]),
    (W("bf16", 64).replace(B_r=64, exp_first=False), ["exp_first with B_r=64", "already waits for S^T alone", "B_r > 64"]),
    (W("fp16", 128, "causal"), ["exp_first with B_r=64", "80 at d_head 128"]),
])
def test_exp_first_is_refused_where_it_cannot_apply(cfg, words):
    """The mma_sync engine has no such order; a 64-row query block's split order already waits for S^T alone."""
    with pytest.raises(ConfigError) as err:
        cfg.replace(exp_first=True)
    assert all(w in str(err.value) for w in words), str(err.value)
    with pytest.raises(ConfigError, match="exp_first=1: expected true or false"):
        W("bf16", 64).replace(exp_first=1)
