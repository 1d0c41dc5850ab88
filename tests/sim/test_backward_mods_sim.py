"""Both backward simulators run plans built with a score_mod / mask_mod (examples/mods.py, and a score_mod
whose derivative is a function of the indices) and give dQ, dK, dV within FlashAttention's rule of the
float64 gradients that torch's autograd takes through the user's functions themselves
(:func:`flashgen.reference.gradients`), on odd lengths, GQA groups and two batches, with no hazard.

The rule's 16-bit baseline is :func:`flashgen.sim.grad_reference.gradients` with the kernel's roundings
and the same functions (the score_mod and its derivative by torch on float64 scores). A schedule that has
not made dP^T when the recompute makes dS^T (a derivative that reads the score) gives wrong gradients
(mma.sync) or a register hazard (wgmma).
"""
from __future__ import annotations

import importlib.util
import pathlib

import attrs
import numpy as np
import pytest
import torch

from flashgen import reference
from flashgen.dsl.backward_config import BackwardConfig
from flashgen.dsl.steps import Gemm, GradScores, RecomputeP
from flashgen.engines import make_plan
from flashgen.mods.kernel_mods import prepare_mods
from flashgen.sim import hardware as hw
from flashgen.sim.backward_cta import simulate_backward
from flashgen.sim.grad_reference import gradients
from flashgen.sim.hopper_backward import simulate_hopper_backward

_spec = importlib.util.spec_from_file_location("flashgen_example_mods", pathlib.Path(__file__).resolve().parents[2] / "examples" / "mods.py")
EX = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(EX)

HEADS, KV_HEADS, BATCH = 4, 2, 2
_TABLE = torch.tensor([0.5, 1.5, -1.0, 2.0, 0.25, 1.0, -0.5])


def scaled_by_table(score, b, h, q_idx, kv_idx):
    """A score_mod whose derivative (a table entry) depends on the indices only."""
    return score * _TABLE[(q_idx + 2 * kv_idx + h) % 7]


#: (score_mod, mask_mod, mask arguments, seq_q, seq_k): each derivative kind, masks alone and combined
CASES = {
    "softcap": (EX.softcap(2.0), None, {}, 70, 45),
    "alibi+causal": (EX.alibi(HEADS), None, {"causal": True, "align": "bottom_right"}, 45, 70),
    "relative_bias+document": (EX.relative_bias(128, seed=3), EX.document_mask((20, 31, 19)), {}, 70, 70),
    "prefix_lm+window": (None, EX.prefix_lm(9), {"window": (12, 3)}, 70, 53),
    "softcap+document": (EX.softcap(1.5), EX.document_mask((33, 10, 27)), {}, 70, 70),
    "scaled_by_table+causal": (scaled_by_table, None, {"causal": True}, 53, 70),
}
MMA = BackwardConfig("bf16", d_head=64, B_c=32, n_warps=2)
#: split_scores: the mods see each warp's own query columns
MMA_SPLIT = BackwardConfig("bf16", d_head=64, B_c=32, n_warps=4, d_split=2, split_scores=True)
WGMMA = BackwardConfig("fp16", d_head=64, B_r=64, B_c=128, n_warps=12, engine="wgmma", stages=2)
#: 128-row query blocks with exp_first: the exponentials under dP^T's GEMM, but with a score_mod whose derivative reads the score
WGMMA_WIDE = WGMMA.replace(B_r=128, exp_first=True)


def _kind(mask: dict) -> str:
    return "causal" if mask.get("causal") else "window" if "window" in mask else "none"


def _setup(cfg, name):
    score_fn, mask_fn, mask, seq_q, seq_k = CASES[name]
    mods, (sa, ma) = prepare_mods(score_fn, mask_fn)
    plan = make_plan(cfg.replace(mask=_kind(mask)), mods)
    values = (sa.values() if sa is not None else None, ma.values() if ma is not None else None)
    rng = np.random.default_rng(len(name))
    d = cfg.d_head
    inputs = (rng.standard_normal((BATCH, seq_q, HEADS, d)), rng.standard_normal((BATCH, seq_k, KV_HEADS, d)),
              rng.standard_normal((BATCH, seq_k, KV_HEADS, d)), rng.standard_normal((BATCH, seq_q, HEADS, d)))
    return plan, values, inputs


def _head_mods(score_fn, mask_fn, seq_q: int, seq_k: int):
    """grad_reference's ``head_mods`` from the torch functions: the mask_mod's keep, the score_mod and its
    derivative by autograd on float64 scores."""
    i, j = torch.arange(seq_q)[:, None], torch.arange(seq_k)[None, :]

    def head(b, h):
        bt, ht = torch.tensor(b), torch.tensor(h)
        keep = None if mask_fn is None else np.broadcast_to(mask_fn(bt, ht, i, j).numpy(), (seq_q, seq_k))

        def score(s):
            x = torch.from_numpy(s).requires_grad_(True)
            y = score_fn(x, bt, ht, i, j).double().expand(x.shape)
            (dy,) = torch.autograd.grad(y.sum(), x)
            return y.detach().numpy(), dy.numpy()
        return keep, None if score_fn is None else score
    return head


def _errors(cfg, name, res, inputs):
    """(error, bound) of dq, dk, dv: FlashAttention's rule against autograd through the functions."""
    score_fn, mask_fn, mask, seq_q, seq_k = CASES[name]
    r16 = lambda x: hw.decode(hw.encode(x, cfg.dtype), cfg.dtype).astype(np.float64)  # noqa: E731
    vals = [r16(x) for x in inputs]
    ref = reference.gradients(*(torch.from_numpy(x) for x in vals), score_mod=score_fn, mask_mod=mask_fn, **mask)
    lowp = gradients(*vals, **mask, round16=r16, head_mods=_head_mods(score_fn, mask_fn, seq_q, seq_k))
    return {n: (np.abs(got - want.numpy()).max(), 2 * np.abs(base - want.numpy()).max() + 1e-3)
            for n, got, want, base in zip(("dq", "dk", "dv"), (res.dq, res.dk, res.dv), ref, lowp)}


def _assert_close(cfg, name, res, inputs):
    assert res.ok, res.hazards[:3]
    for n, (err, bound) in _errors(cfg, name, res, inputs).items():
        assert err <= bound, f"{name} {n}: max error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("cfg", [MMA, MMA_SPLIT], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_mma_sync_backward_with_mods_matches_autograd(name, cfg):
    plan, values, inputs = _setup(cfg, name)
    _assert_close(cfg, name, simulate_backward(plan, *inputs, **CASES[name][2], mod_values=values), inputs)


@pytest.mark.parametrize("name", ["softcap", "alibi+causal", "relative_bias+document", "prefix_lm+window", "softcap+document"])
def test_wgmma_backward_with_mods_matches_autograd(name):
    plan, values, inputs = _setup(WGMMA, name)
    _assert_close(WGMMA, name, simulate_hopper_backward(plan, *inputs, **CASES[name][2], mod_values=values), inputs)


@pytest.mark.parametrize("name", ["softcap", "alibi+causal", "prefix_lm+window"])
def test_wgmma_backward_with_mods_at_128_rows_matches_autograd(name):
    plan, values, inputs = _setup(WGMMA_WIDE, name)
    assert plan.score_order == ("fused" if name == "softcap" else "exp_first")
    _assert_close(WGMMA_WIDE, name, simulate_hopper_backward(plan, *inputs, **CASES[name][2], mod_values=values), inputs)


def test_the_score_reading_derivative_fuses_ds_into_the_recompute():
    """softcap's derivative reads the score: every plan puts GradScores right after RecomputeP (the wgmma
    plan's ``fused`` order, at any query block, with exp_first too); a bias (ALiBi) keeps the plain order, which at
    128 rows is fused without exp_first."""
    for cfg in (MMA, WGMMA, WGMMA_WIDE):
        for name, fused in (("softcap", True), ("alibi+causal", False)):
            plan = _setup(cfg, name)[0]
            body = plan.schedule.body if cfg is MMA else plan.schedule
            after = body[next(i for i, s in enumerate(body) if isinstance(s, RecomputeP)) + 1]
            assert isinstance(after, GradScores) == fused, (cfg.engine, name, after)
            assert cfg is MMA or plan.grad_with_p == fused
    assert {_setup(WGMMA_WIDE.replace(exp_first=False), n)[0].score_order for n in ("softcap", "alibi+causal")} == {"fused"}


def _dp_after_recompute(steps):
    """``steps`` with the dP^T GEMM moved right after RecomputeP."""
    steps = list(steps)
    dp = next(s for s in steps if isinstance(s, Gemm) and s.arg == "dP")
    steps.remove(dp)
    steps.insert(next(i for i, s in enumerate(steps) if isinstance(s, RecomputeP)) + 1, dp)
    return tuple(steps)


def test_a_fused_schedule_without_dp_ready_is_caught():
    """With dP^T made after the recompute that makes dS^T from it, the mma.sync pass gives wrong gradients
    (dS^T from the previous item's dP^T, or zeros), the wgmma pass a register hazard."""
    plan, values, inputs = _setup(MMA, "softcap")
    broken = attrs.evolve(plan, schedule=attrs.evolve(plan.schedule, body=_dp_after_recompute(plan.schedule.body)))
    res = simulate_backward(broken, *inputs, mod_values=values)
    errors = _errors(MMA, "softcap", res, inputs)
    assert errors["dq"][0] > errors["dq"][1] and errors["dk"][0] > errors["dk"][1]
    assert errors["dv"][0] <= errors["dv"][1]  # P^T is right: only dS^T is
    wplan, wvalues, winputs = _setup(WGMMA, "softcap")
    res = simulate_hopper_backward(attrs.evolve(wplan, schedule=_dp_after_recompute(wplan.schedule)), *winputs, mod_values=wvalues)
    assert any("dP" in h for h in res.hazards), res.hazards[:3]


def test_backward_simulators_refuse_values_that_do_not_fit_the_plan():
    plan, values, inputs = _setup(MMA, "relative_bias+document")
    with pytest.raises(ValueError, match="needs its values"):
        simulate_backward(plan, *inputs)
    wplan, wvalues, winputs = _setup(WGMMA, "softcap")
    with pytest.raises(ValueError, match="without a mask_mod"):
        simulate_hopper_backward(wplan, *winputs, mod_values=(wvalues[0], {}))
