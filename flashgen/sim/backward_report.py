"""``flashgen simulate`` of a backward plan: its copies (bank conflicts, coverage), the proofs, and a
whole backward pass (every CTA, with query and key tails and two query heads per kv head) whose
hazards are the schedule's and whose dQ, dK, dV are compared with float64 gradients.

:func:`simulate_backward_report` returns a JSON-able dict that :func:`flashgen.sim.report.format_report`
prints: ``config``, ``name``, ``kind`` ("backward"), ``copies`` (as the forward's, ``per`` "cta" or
"query_block"), ``coverage_ok``, ``schedule`` ``{ok, hazards, walk}``, ``verification`` ``{ok,
checks}``, with ``cta`` ``grads`` ``{ok, detail, max_abs_err, bound}``, and ``ok``.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from flashgen.dsl.backward_plan import RESIDENT, BackwardPlan
from flashgen.sim import hardware as hw
from flashgen.sim.backward_cta import backward_coverage, simulate_backward, trace_backward
from flashgen.sim.grad_reference import gradients
from flashgen.sim.report import copy_stats

#: slack added to the error bound (absolute)
ABS_TOL = 1e-3
#: query and kv heads of the simulated problem (two query heads share one kv head: dK, dV sum them)
HEADS, KV_HEADS = 2, 1


def _per(kind: str, name: str) -> str:
    """How often a copy runs: once per CTA (the resident K and V's loads, the dK and dV epilogue) or
    per query block (the streamed tiles, every ldmatrix, the dS^T and P^T stores)."""
    operand = name.split("_", 1)[1]
    once = (kind == "g2s" and operand in RESIDENT) or kind == "s2g" or (kind == "r2s" and operand not in ("dS", "P"))
    return "cta" if once else "query_block"


def problem(plan: Any) -> tuple[dict[str, int], dict[str, Any]]:
    """The simulated sizes (a query tail, a key tail) and the mask arguments of the config's mask."""
    cfg = plan.cfg
    sizes = {"seq_q": cfg.B_r + 37, "seq_k": 2 * cfg.B_c + 13, "heads": HEADS, "kv_heads": KV_HEADS}
    mask = {"none": {}, "causal": {"causal": True, "align": "bottom_right"},
            "window": {"window": (cfg.B_c // 2 + 3, 5)}}[cfg.mask]
    return sizes, mask


def check_gradients(plan: Any, seed: int = 0, simulate: Callable[..., Any] = simulate_backward) -> tuple[dict[str, Any], list[str]]:
    """The simulated backward (``simulate``: the plan's engine's whole pass) vs float64 gradients: each of
    dQ, dK, dV within twice the error of the same math at the kernel's 16-bit roundings (P, dS, the
    outputs) plus :data:`ABS_TOL`; and the hazards every CTA met."""
    cfg = plan.cfg
    sizes, mask = problem(plan)
    rng = np.random.default_rng(seed)
    shapes = [(1, sizes["seq_q"], HEADS), (1, sizes["seq_k"], KV_HEADS), (1, sizes["seq_k"], KV_HEADS), (1, sizes["seq_q"], HEADS)]
    inputs = [rng.standard_normal((*s, cfg.d_head)) for s in shapes]
    res = simulate(plan, *inputs, **mask)
    round16 = lambda x: hw.decode(hw.encode(x, cfg.dtype), cfg.dtype).astype(np.float64)  # noqa: E731
    vals = [round16(x) for x in inputs]
    ref = gradients(*vals, **mask)
    lowp = gradients(*vals, **mask, round16=round16)
    errs, bounds = {}, {}
    for name, got, want, base in zip(("dq", "dk", "dv"), (res.dq, res.dk, res.dv), ref, lowp):
        errs[name] = float(np.abs(got - want).max())
        bounds[name] = 2 * float(np.abs(base - want).max()) + ABS_TOL
    ok = all(errs[n] <= bounds[n] for n in errs) and res.ok
    where = f"seq_q {sizes['seq_q']}, seq_k {sizes['seq_k']}, {HEADS} heads on {KV_HEADS} kv head"
    detail = where + ": " + ", ".join(f"max |{n} - f64| = {errs[n]:.3g} (bound {bounds[n]:.3g})" for n in errs)
    if res.hazards:
        detail += f"; {len(res.hazards)} hazard(s)"
    return {"ok": bool(ok), "detail": detail, "max_abs_err": errs, "bound": bounds}, res.hazards


def simulate_backward_report(plan: BackwardPlan, verification: dict, cta: bool = True) -> dict[str, Any]:
    """The report of one backward plan (``verification``: the proofs' ``to_dict``); without ``cta``
    the schedule is not run (its hazards come from the whole pass)."""
    cfg = plan.cfg
    traces = trace_backward(plan)
    cov = backward_coverage(plan, traces)
    copies = []
    for name, tr in traces.items():
        stats = copy_stats(plan, tr, per=_per(tr.kind, name))
        stats["coverage"] = {"ok": cov[name].ok, "detail": cov[name].detail}
        copies.append(stats)
    result: dict[str, Any] = {"config": cfg.short_form(), "name": cfg.mangle(), "kind": "backward", "copies": copies,
                              "coverage_ok": all(c.ok for c in cov.values()), "verification": verification}
    checks = [result["coverage_ok"], verification["ok"]]
    if cta and result["coverage_ok"]:
        grads, hazards = check_gradients(plan)
        result["grads"] = grads
        checks += [grads["ok"], not hazards]
    else:
        hazards = []
        result["grads"] = {"ok": not cta, "detail": "skipped: " + ("coverage failed" if cta else "not asked for")}
    result["schedule"] = {"ok": not hazards, "hazards": hazards, "walk": "every CTA of the backward pass below"}
    result["ok"] = all(checks)
    return result
