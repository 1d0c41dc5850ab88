"""The wgmma backward's plan (flashgen.dsl.hopper_backward_plan) at both query block sizes: the GEMM shapes and
accumulator sizes follow B_r, the dQ split follows it (columns at 64 rows, rows at 128), dS^T is made with P^T
where the registers ask for it, and the config rules accept exactly the shapes the plan can build."""
from __future__ import annotations

import pytest

from flashgen.dsl.backward_config import WGMMA_B_R, WGMMA_B_RS, BackwardConfig
from flashgen.dsl.config import SMEM_LIMIT_BYTES, ConfigError
from flashgen.dsl.hopper_backward_plan import make_hopper_backward_plan
from flashgen.dsl.steps import GradScores, RecomputeP

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
    (W("bf16", 64).replace(B_r=64), {"S": (64, 4), "dP": (64, 4), "dV": (64, 4), "dK": (64, 4), "dQ": (32, 8)}),
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


def test_ds_is_made_with_p_at_128_rows_only():
    """At 128 rows the fp32 P^T, its fragments and dP^T would be live together (ptxas spilled): one pass makes both."""
    wide, narrow = make_hopper_backward_plan(W("bf16", 64)), make_hopper_backward_plan(W("bf16", 64).replace(B_r=64))
    assert wide.grad_with_p and not narrow.grad_with_p
    ops = [type(s) for s in wide.schedule]
    assert ops.index(GradScores) == ops.index(RecomputeP) + 1
    assert str(wide.schedule[ops.index(RecomputeP) - 1]) == "wgmma_wait 0"


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
