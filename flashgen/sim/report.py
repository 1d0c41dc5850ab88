"""``flashgen simulate``: per-config report of copies, bank conflicts, coverage, fragments, schedule.

``simulate_mma_sync(plan)`` and ``simulate_wgmma(plan)`` -> dict (JSON-able), each engine's report
(:func:`flashgen.engines.simulate_config` picks one per config), and ``format_report(results) -> str``
(a table for a person).
"""
from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from flashgen.dsl.hopper_plan import HopperPlan
from flashgen.dsl.plan import KernelPlan
from flashgen.sim import cta as cta_sim
from flashgen.sim import hardware as hw
from flashgen.sim.copies import CopyTrace, coverage, trace_plan, wavefronts
from flashgen.sim.fragments import check_fragments

#: (j_begin, n_blocks) the schedule is walked with: one block (first == last), three (a
#: middle one); with a ScoreMask also a masked start and an empty key range.
SCHEDULE_WALKS = ((0, 1), (0, 3))
MASKED_WALKS = ((1, 3), (2, 2))
#: KV blocks of the functional CTA run in the report.
CTA_BLOCKS = 2


def _per(plan: KernelPlan, trace: CopyTrace) -> str:
    """How often the copy runs: ``"cta"`` (once per CTA) or ``"kv_block"`` (every KV block)."""
    if trace.name in ("g2s_Q", "r2s_O", "s2g_O"):
        return "cta"
    if trace.name == "s2r_Q" and plan.s2r["Q"].resident:
        return "cta"
    return "kv_block"


def copy_stats(plan: KernelPlan, trace: CopyTrace, per: str | None = None) -> dict[str, Any]:
    """Instructions, wavefronts and bytes of one execution of a copy (see :func:`simulate_mma_sync`;
    ``per``: how often it runs, where the plan is not a forward one)."""
    stats: dict[str, Any] = {
        "name": trace.name,
        "kind": trace.kind,
        "atom": trace.atom.name,
        "per": per or _per(plan, trace),
        "instructions_per_warp": int(trace.n_instr),
        "bytes_per_cta": int(trace.n_warps * trace.n_instr * 32 * trace.atom.bytes_per_thread),
    }
    try:
        w, ideal = wavefronts(trace)
        stats["wavefronts_per_warp"] = int(w.sum(axis=1).max())
        stats["ideal_wavefronts_per_warp"] = int(ideal.sum(axis=1).max())
        stats["conflict_ratio"] = round(float(w.sum() / ideal.sum()), 4)
        stats["max_conflict_ratio_per_instruction"] = round(float((w / ideal).max()), 4)
    except ValueError as exc:
        stats.update(wavefronts_per_warp=None, ideal_wavefronts_per_warp=None, conflict_ratio=None,
                     max_conflict_ratio_per_instruction=None, bank_error=str(exc))
    return stats


def schedule_walks(plan: KernelPlan) -> tuple[tuple[int, int], ...]:
    return SCHEDULE_WALKS + (MASKED_WALKS if getattr(plan, "score_mask", None) is not None else ())


def schedule_hazards(plan: KernelPlan, traces: dict[str, CopyTrace]) -> list[str]:
    """Hazards of every walk of :func:`schedule_walks`, each prefixed with its key-block range."""
    out = []
    for jb, n in schedule_walks(plan):
        out += [f"[blocks {jb}..{n - 1}] {h}" for h in cta_sim.check_schedule(plan, n, traces, j_begin=jb)]
    return out


def redundant_barriers(plan: KernelPlan, traces: dict[str, CopyTrace]) -> list[str]:
    """Body barriers whose removal leaves the schedule hazard-free (for every walk)."""
    out = []
    body = plan.schedule.body
    for i, step in enumerate(body):
        if step.op != "barrier":
            continue
        cut = attrs.evolve(plan, schedule=attrs.evolve(plan.schedule, body=body[:i] + body[i + 1 :]))
        if not schedule_hazards(cut, traces):
            out.append(f"body step {i} (barrier: {step.why})")
    return out


def check_cta(plan: KernelPlan, traces: dict[str, CopyTrace], n_blocks: int = CTA_BLOCKS, seed: int = 0) -> dict[str, Any]:
    """Functional CTA run vs float64 attention (rule: :func:`cta.compare_with_reference`)."""
    cfg = plan.cfg
    rng = np.random.default_rng(seed)
    q = hw.encode(rng.standard_normal((cfg.B_r, cfg.d_head)), cfg.dtype)
    k = hw.encode(rng.standard_normal((n_blocks * cfg.B_c, cfg.d_head)), cfg.dtype)
    v = hw.encode(rng.standard_normal((n_blocks * cfg.B_c, cfg.d_head)), cfg.dtype)
    res = cta_sim.simulate_cta(plan, q, k, v, traces=traces)
    keep = None
    mask = getattr(plan, "score_mask", None)
    if mask is not None and getattr(cfg, "mask", "none") != "none":  # default arguments: offset 0, unbounded window
        keep = np.array([[mask.keep(i, c, k.shape[0]) for c in range(k.shape[0])] for i in range(cfg.B_r)])
    cmp = cta_sim.compare_with_reference(cfg, q, k, v, res.o, keep=keep, lse=res.lse)
    ok = cmp["ok"] and res.ok
    detail = (
        f"{n_blocks} KV blocks: max |O - O_f64| = {cmp['max_abs_err']:.3g} "
        f"(bound {cmp['bound']:.3g} = 2 x mixed-precision reference error {cmp['lowp_err']:.3g} + {cmp['abs_tol']:g})"
    )
    if res.hazards:
        detail += f"; {len(res.hazards)} hazard(s)"
    return {"ok": bool(ok), "detail": detail, **{k_: cmp[k_] for k_ in ("max_abs_err", "bound")}}


def simulate_mma_sync(plan: KernelPlan, verification: dict, cta: bool = True) -> dict[str, Any]:
    """Simulate one mma.sync plan; a JSON-able dict (``verification``: the proofs' ``to_dict``, which
    :func:`flashgen.engines.simulate_config` passes in).

    Keys: ``config`` (short form), ``name``; ``copies``: one dict per copy op with
    ``name``, ``kind`` (g2s/s2r/r2s/s2g), ``atom``, ``per`` (``"cta"``: runs once per CTA,
    ``"kv_block"``: every KV block), ``instructions_per_warp``, ``wavefronts_per_warp``,
    ``ideal_wavefronts_per_warp``, ``conflict_ratio`` (wavefronts / ideal over all
    warps), ``bytes_per_cta`` (per execution), ``coverage`` ``{ok, detail}``;
    ``coverage_ok``; ``fragments`` ``{ok, S: {ok, detail}, O: {ok, detail}}``;
    ``schedule`` ``{ok, walks, hazards, redundant_barriers}`` (``walks``: the key-block
    ranges ``[j_begin, n_blocks)`` walked); ``verification`` ``{ok, checks}`` (the proofs of
    :mod:`flashgen.sim.verify`, each check's problems); with ``cta``,
    ``cta`` ``{ok, detail, max_abs_err, bound}`` (a functional run vs float64);
    ``ok``: everything passed.
    """
    cfg = plan.cfg
    traces = trace_plan(plan)
    cov = coverage(plan, traces)
    copies = []
    for name, tr in traces.items():
        stats = copy_stats(plan, tr)
        stats["coverage"] = {"ok": cov[name].ok, "detail": cov[name].detail}
        copies.append(stats)
    frags = check_fragments(plan, traces)
    hazards = schedule_hazards(plan, traces)
    result: dict[str, Any] = {
        "config": cfg.short_form(),
        "name": cfg.mangle(),
        "copies": copies,
        "coverage_ok": all(c.ok for c in cov.values()),
        "fragments": {"ok": all(f.ok for f in frags.values()), **{k: {"ok": f.ok, "detail": f.detail} for k, f in frags.items()}},
        "schedule": {
            "ok": not hazards,
            "walks": [list(w) for w in schedule_walks(plan)],
            "hazards": hazards,
            "redundant_barriers": redundant_barriers(plan, traces) if not hazards else [],
        },
        "verification": verification,
    }
    checks = [result["coverage_ok"], result["fragments"]["ok"], result["schedule"]["ok"], result["verification"]["ok"]]
    if cta:
        result["cta"] = check_cta(plan, traces) if result["coverage_ok"] else {"ok": False, "detail": "skipped: coverage failed"}
        checks.append(result["cta"]["ok"])
    result["ok"] = all(checks)
    return result


def simulate_wgmma(plan: "HopperPlan", verification: dict, cta: bool = True, seed: int = 0) -> dict[str, Any]:
    """The wgmma engine's checks (:mod:`flashgen.sim.hopper`): schedule hazards over 1, 2 and 5 key
    blocks (persistent plans: two tiles back to back), and (``cta``) a functional CTA with a query
    tail and a key tail vs float64 attention, and (``split``) one tile of 5 key blocks run as the
    wave-tail split's 2 parts and merged (masked plans: aligned bottom-right, so the tile has
    those blocks).

    Keys: ``config``, ``name``, ``engine`` ("wgmma"), ``schedule`` ``{ok, hazards}``, ``verification``
    ``{ok, checks}`` (:mod:`flashgen.sim.verify`), ``cta`` and ``split`` ``{ok, detail, max_abs_err,
    bound}``, ``ok``.
    """
    from . import hopper

    cfg = plan.cfg
    hazards = []
    tiles = 2 if cfg.persistent else 1
    for n in (1, 2, 5):
        hazards += [f"{n} block(s): {h}" for h in hopper.check_schedule(plan, n_blocks=n, seed=seed, tiles=tiles)]
    result: dict[str, Any] = {"config": cfg.short_form(), "name": cfg.mangle(), "engine": "wgmma",
                              "schedule": {"ok": not hazards, "hazards": hazards, "tiles": tiles},
                              "verification": verification}
    checks = [not hazards, result["verification"]["ok"]]
    if cta:
        rng = np.random.default_rng(seed)

        def forward(key: str, seq_k: int, offset: int, run) -> None:
            seq_q = cfg.B_r - 27  # tails on both sides
            q = hw.encode(rng.standard_normal((seq_q, cfg.d_head)), cfg.dtype)
            k = hw.encode(rng.standard_normal((seq_k, cfg.d_head)), cfg.dtype)
            v = hw.encode(rng.standard_normal((seq_k, cfg.d_head)), cfg.dtype)
            o, lse, rep = run(q, k, v)
            keep = None
            if cfg.mask != "none":  # unbounded window: the masks differ in the offset only
                keep = np.array([[plan.score_mask.keep(i, c, seq_k, offset) for c in range(seq_k)] for i in range(seq_q)])
            cmp = cta_sim.compare_with_reference(cfg, q, k, v, o[:seq_q], keep=keep, lse=lse[:seq_q])
            detail = (f"seq_q {seq_q}, seq_k {seq_k}: max |O - O_f64| = {cmp['max_abs_err']:.3g} "
                      f"(bound {cmp['bound']:.3g} = 2 x mixed-precision reference error {cmp['lowp_err']:.3g} + {cmp['abs_tol']:g})")
            if rep.hazards:
                detail += f"; {len(rep.hazards)} hazard(s)"
            result[key] = {"ok": bool(cmp["ok"] and rep.ok), "detail": detail, "max_abs_err": cmp["max_abs_err"], "bound": cmp["bound"]}
            checks.append(result[key]["ok"])

        forward("cta", 2 * cfg.B_c + 37, 0, lambda q, k, v: hopper.simulate_cta(plan, q, k, v))
        seq_k = 4 * cfg.B_c + 37  # 5 key blocks: 2 parts of at least tail_split.min_blocks
        offset = seq_k - (cfg.B_r - 27) if cfg.mask != "none" else 0
        forward("split", seq_k, offset,
                lambda q, k, v: hopper.simulate_split_tile(plan, q, k, v, 2, mask_offset=offset))
    result["ok"] = all(checks)
    return result


def _ok(flag: bool) -> str:
    return "ok" if flag else "FAILED"


def _verification_lines(res: dict[str, Any]) -> list[str]:
    """The proofs' verdict and every failing check's problems (reports of other tools may lack it)."""
    ver = res.get("verification")
    if ver is None:
        return []
    lines = [f"  verification ({len(ver['checks'])} proofs, flashgen.sim.verify): {_ok(ver['ok'])}"]
    return lines + [f"    {name}: {p}" for name, problems in ver["checks"].items() for p in problems]


def format_report(results: list[dict[str, Any]]) -> str:
    """A readable table per config (the reports of :func:`simulate_mma_sync` / :func:`simulate_wgmma`):
    every section a report has, in one order."""
    blocks = []
    for res in results:
        lines = [f"{res['config']}  [{_ok(res['ok'])}]", f"  kernel {res['name']}"]
        if "copies" in res:
            lines += _copy_lines(res["copies"])
        if "coverage" in res:  # checks without a copies' table (the wgmma backward's TMA boxes, dS^T stores, regions)
            lines.append(f"  coverage ({', '.join(res['coverage'])}): {_ok(res['coverage_ok'])}")
            lines += [f"    {name}: {c['detail']}" for name, c in res["coverage"].items() if not c["ok"]]
        if "fragments" in res:
            fr = res["fragments"]
            lines.append(f"  fragments: {_ok(fr['ok'])}")
            lines += [f"    {key}: {_ok(fr[key]['ok'])} - {fr[key]['detail']}" for key in ("S", "O")]
        lines += _schedule_lines(res["schedule"])
        lines += _verification_lines(res)
        if "cta" in res:
            lines.append(f"  CTA forward pass: {_ok(res['cta']['ok'])} - {res['cta']['detail']}")
        if "grads" in res:
            lines.append(f"  backward pass (dQ, dK, dV vs float64): {_ok(res['grads']['ok'])} - {res['grads']['detail']}")
        if "split" in res:
            lines.append(f"  wave-tail split (2 parts merged): {_ok(res['split']['ok'])} - {res['split']['detail']}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


#: how often a copy runs, in the copies' table
_RUNS = {"cta": "per CTA", "kv_block": "per KV block", "query_block": "per query block"}


def _copy_lines(copies: list[dict[str, Any]]) -> list[str]:
    """The copies' table (instructions, wavefronts, conflicts, bytes, coverage) and coverage failures."""
    head = ("copy", "atom", "runs", "instr/warp", "wavefronts/warp", "ideal", "conflicts", "bytes/CTA", "coverage")
    rows = []
    for c in copies:
        ratio = c.get("conflict_ratio")
        rows.append((
            c["name"], c["atom"], _RUNS[c["per"]],
            str(c["instructions_per_warp"]),
            "-" if c.get("wavefronts_per_warp") is None else str(c["wavefronts_per_warp"]),
            "-" if c.get("ideal_wavefronts_per_warp") is None else str(c["ideal_wavefronts_per_warp"]),
            "-" if ratio is None else (f"{ratio:.2f}x" + ("" if ratio == 1 else " !")),
            str(c["bytes_per_cta"]),
            _ok(c["coverage"]["ok"]),
        ))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    right = {3, 4, 5, 6, 7}
    fmt = lambda cells: "  " + "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    lines = [fmt(head).rstrip(), "  " + "  ".join("-" * w for w in widths)]
    lines += [fmt(r).rstrip() for r in rows]
    return lines + [f"  coverage {c['name']}: {c['coverage']['detail']}" for c in copies if not c["coverage"]["ok"]]


def _schedule_lines(sc: dict[str, Any]) -> list[str]:
    """The schedule check: the key-block ranges walked (mma.sync), the walk described (backward) or
    the blocks and tiles run (wgmma)."""
    if "walks" in sc:
        walks = ", ".join(f"{jb}..{n - 1}" if n > jb else "none" for jb, n in sc["walks"])
        lines = [f"  schedule (key blocks walked: {walks}): {_ok(sc['ok'])}"]
    elif "walk" in sc:
        lines = [f"  schedule ({sc['walk']}): {_ok(sc['ok'])}"]
    else:
        walk = "1, 2 and 5 key blocks" + (f", {sc['tiles']} tiles" if sc.get("tiles", 1) > 1 else "")
        lines = [f"  schedule ({walk}; TMA ring, wgmma groups, pingpong turns): {_ok(sc['ok'])}"]
    lines += [f"    hazard: {h}" for h in sc["hazards"][:10]]
    if len(sc["hazards"]) > 10:
        lines.append(f"    ... {len(sc['hazards']) - 10} more")
    return lines + [f"    note: redundant {b}" for b in sc.get("redundant_barriers", ())]
