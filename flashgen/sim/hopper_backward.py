"""The wgmma backward on the CPU: a whole pass, the plan's coverage and ``flashgen simulate``'s report.

* :func:`simulate_hopper_backward` runs every CTA (batch, kv head, key block) of
  :class:`~flashgen.sim.hopper_backward_cta.HopperBwdCta` in the order the grid starts them, with the
  preprocess before (the forward's lse as ``lse * log2e`` and D, both padded to whole query blocks: +inf
  and 0) and dQ's conversion after; the result is the mma.sync simulator's :class:`~flashgen.sim.backward_cta.BackwardResult`.
* :func:`hopper_backward_coverage`: each TMA load's boxes cover its tile once, where the tile's layout
  puts each element; every consumer's dS^T stores write its buffer once, each element at its layout
  offset; the shared-memory regions (tiles x stages, statistics, barriers) are aligned, disjoint and
  inside the plan's bytes.
* :func:`hopper_backward_report`: those, the proofs and (``cta``) a whole pass vs float64 gradients.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from flashgen.dsl.hopper_backward_plan import HopperBackwardPlan, make_hopper_backward_plan
from flashgen.dsl.hopper_plan import SMEM_ALIGN
from flashgen.sim.backward_cta import BackwardResult, BwdPass
from flashgen.sim.copies import Coverage, coverage_of
from flashgen.sim.hopper import SWIZZLE_SPAN, c_table, tma_byte_addresses
from flashgen.sim.hopper_backward_cta import HopperBwdCta
from flashgen.sim.hopper_backward_smem import ds_store_targets, tile_table

_F32 = np.float32


def preprocess(plan: HopperBackwardPlan, lse: np.ndarray, delta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What the preprocess writes for one head: ``lse * log2e`` (the Recompute rule's, +inf for a row
    without keys) and D, fp32, padded to whole query blocks with +inf and 0."""
    B_r = plan.cfg.B_r
    rows = -(-lse.shape[0] // B_r) * B_r
    lse_log2 = np.full(rows, np.inf, _F32)
    d = np.zeros(rows, _F32)
    lse_log2[:lse.shape[0]] = plan.recompute.lse_log2(lse)
    d[:delta.shape[0]] = delta
    return lse_log2, d


def simulate_hopper_backward(cfg_or_plan: Any, q: np.ndarray, k: np.ndarray, v: np.ndarray, do: np.ndarray, *,
                             causal: bool = False, window: "tuple[int, int] | None" = None, align: str = "top_left",
                             softmax_scale: float | None = None, mod_values: tuple = (None, None)) -> BackwardResult:
    """The backward of ``(batch, seq, heads, d_head)`` float inputs (rounded to the config's dtype; k and v
    may have fewer heads) through every CTA of the wgmma plan; the config's mask must match
    ``causal`` / ``window``. dQ, dK, dV as float64 values of the 16-bit outputs, and every CTA's hazards.
    A plan built with a score_mod / mask_mod: ``mod_values`` as :func:`~flashgen.sim.backward_cta.simulate_backward`'s."""
    plan = cfg_or_plan if isinstance(cfg_or_plan, HopperBackwardPlan) else make_hopper_backward_plan(cfg_or_plan)
    cfg = plan.cfg
    run = BwdPass.of(plan, q, k, v, do, causal, window, align, softmax_scale, mod_values)
    group = run.group
    dq_acc, dk, dv = run.buffers()
    hazards: list[str] = []
    for (b, hk), arrived in run.arrivals().items():
        heads = run.heads(b, hk)
        stats = [preprocess(plan, x.lse, x.delta) for x in heads]
        for kb in arrived:
            cta = HopperBwdCta(plan, run.problem(kb, b, hk), run.bits["k"][b, :, hk], run.bits["v"][b, :, hk], heads, stats,
                               [dq_acc[b, h] for h in range(hk * group, (hk + 1) * group)], run.scale)
            dk_blk, dv_blk = cta.run()
            run.put_block(dk, b, hk, kb, dk_blk)
            run.put_block(dv, b, hk, kb, dv_blk)
            hazards += [f"CTA (batch {b}, kv head {hk}, key block {kb}): {x}" for x in cta.hazards]
    return run.result(dq_acc, dk, dv, hazards)


# ---- coverage -----------------------------------------------------------------------------------


def _tma_coverage(plan: HopperBackwardPlan, name: str) -> Coverage:
    """The boxes of load ``name`` cover its tile once; TMA's byte rule puts each element where the tile's
    layout does, in every stage; the transaction bytes are the tile's."""
    tt = plan.loads[name]
    tile, box = tt.tile, tt.tma
    problems = []
    if box.box_cols * box.dtype.size != SWIZZLE_SPAN:
        return coverage_of(f"tma_{name}", [f"{box.box_cols}-column boxes: the byte rule models {SWIZZLE_SPAN}-byte rows"], "")
    table = tile_table(tile)
    count = np.zeros((tile.rows, tile.cols), np.int64)
    for b in tt.boxes:
        if b.row0 + box.box_rows > tile.rows or b.col0 + box.box_cols > tile.cols:
            problems.append(f"box at ({b.row0}, {b.col0}) reaches past the {tile.rows}x{tile.cols} tile")
            continue
        count[b.row0:b.row0 + box.box_rows, b.col0:b.col0 + box.box_cols] += 1
        for s in range(tile.stages):
            got = tma_byte_addresses(box.box_rows, box.box_cols, tile.stage_offset(s) + b.smem_offset)
            want = tile.stage_offset(s) + 2 * table[b.row0:b.row0 + box.box_rows, b.col0:b.col0 + box.box_cols]
            if not np.array_equal(got, want):
                problems.append(f"stage {s}: the box at ({b.row0}, {b.col0}) puts {int((got != want).sum())} element(s) "
                                f"where the tile layout does not")
    if (count != 1).any():
        problems.append(f"{int((count != 1).sum())} element(s) not covered exactly once by the boxes")
    if tt.bytes != tile.rows * tile.cols * box.dtype.size:
        problems.append(f"expect_tx {tt.bytes} bytes, the boxes bring {tile.rows * tile.cols * box.dtype.size}")
    return coverage_of(f"tma_{name}", problems, f"{len(tt.boxes)} box(es) of {box.box_rows}x{box.box_cols} cover "
                                                f"{tile.name}[{tile.rows}x{tile.cols}] once, at its layout, in {tile.stages} stage(s)")


def _ds_store_coverage(plan: HopperBackwardPlan) -> Coverage:
    """The consumers' dS^T stores (:func:`~flashgen.sim.hopper_backward_smem.ds_store_targets`: 32-bit value pairs of
    the S^T accumulator at rows ``64 w + row``, or stmatrix .trans into a [query][key] tile) write each element of a
    buffer once; a 32-bit pair's second value lands where the layout puts its (row, column)."""
    tile, cs = plan.tiles["dS"], c_table(plan.gemms["S"].atom)
    table = tile_table(tile)
    count = np.zeros(tile.rows * tile.cols, np.int64)
    problems = []
    ev = np.arange(0, cs.rows.shape[1], 2)
    for w in range(plan.consumers):
        dst = ds_store_targets(plan, w)
        if dst.min() < 0 or dst.max() >= count.size:
            problems.append(f"consumer {w} stores past the {tile.rows}x{tile.cols} tile")
            continue
        np.add.at(count, dst.ravel(), 1)
        if not plan.ds_store.trans:
            r, c = 64 * w + cs.rows, cs.cols
            pair_ok = (r[:, ev + 1] == r[:, ev]) & (table[r[:, ev + 1], c[:, ev + 1]] == dst[:, ev + 1])
            if not pair_ok.all():
                problems.append(f"consumer {w}: {int((~pair_ok).sum())} 32-bit store(s) whose second value is not the next element")
    if (count != 1).any():
        problems.append(f"{int((count != 1).sum())} element(s) of the dS buffer not stored exactly once")
    how = "stmatrix .trans, [query][key]" if plan.ds_store.trans else "value pairs at adjacent elements"
    return coverage_of("store_dS", problems, f"{plan.consumers} consumer(s) store {tile.name}[{tile.rows}x{tile.cols}] once, {how}")


def _regions(plan: HopperBackwardPlan) -> list[tuple[int, int, str, int]]:
    """(start, end, name, alignment) of every shared-memory region of the plan."""
    out = [(t.offset, t.offset + t.stages * t.stage_bytes, t.name, SMEM_ALIGN) for t in plan.tiles.values()]
    out += [(off, off + stages * size, name, 16) for name, (off, stages, size) in plan.stats.items()]
    out += [(off, off + 8 * stages, name, 8) for name, (_, off, stages) in plan.barriers.items()]
    st = plan.dq_stage  # every consumer's staging region, 16-byte aligned for the bulk reductions; the producer's chunk slots
    if st.in_smem:
        out.append((st.offset, st.offset + st.consumers * st.region_bytes, "sdQ", 16))
    if st.by_producer:
        out.append((st.chunk_slots, st.chunk_slots + 4 * plan.ring.stages, "dQ chunk slots", 4))
    return sorted(out)


def _smem_coverage(plan: HopperBackwardPlan) -> Coverage:
    """Tiles on the swizzle pattern, statistics 16-byte aligned (bulk copies), barriers 8; no overlaps; all
    inside the plan's bytes less the base's alignment slack."""
    regions, problems = _regions(plan), []
    for (s0, e0, n0, _), (s1, _, n1, _) in zip(regions, regions[1:]):
        if s1 < e0:
            problems.append(f"{n0} [{s0}, {e0}) overlaps {n1} from {s1}")
    problems += [f"{n} at {s} is not {a}-byte aligned" for s, _, n, a in regions if s % a]
    end = max(e for _, e, _, _ in regions)
    if end + SMEM_ALIGN > plan.smem_bytes:
        problems.append(f"the regions end at {end}: more than the plan's {plan.smem_bytes} bytes less {SMEM_ALIGN} of alignment")
    return coverage_of("smem", problems, f"{len(regions)} regions, aligned and disjoint, {end} bytes")


def hopper_backward_coverage(plan: HopperBackwardPlan) -> dict[str, Coverage]:
    """The TMA loads' boxes, the dS^T stores and the shared-memory regions (see the module docstring)."""
    out = {f"tma_{name}": _tma_coverage(plan, name) for name in plan.loads}
    out["store_dS"] = _ds_store_coverage(plan)
    out["smem"] = _smem_coverage(plan)
    return out


# ---- the report ---------------------------------------------------------------------------------


def hopper_backward_report(plan: HopperBackwardPlan, verification: dict, cta: bool = True) -> dict[str, Any]:
    """``flashgen simulate``'s report of a wgmma backward plan (``verification``: the proofs' ``to_dict``):
    ``config``, ``name``, ``kind`` ("backward"), ``engine`` ("wgmma"), ``coverage`` (name -> ``{ok, detail}``),
    ``coverage_ok``, ``verification``, ``grads`` and ``schedule`` as :func:`~flashgen.sim.backward_report.simulate_backward_report`'s
    (without ``cta`` the pass is not run), ``ok``."""
    from flashgen.sim.backward_report import check_gradients

    cfg = plan.cfg
    cov = hopper_backward_coverage(plan)
    result: dict[str, Any] = {"config": cfg.short_form(), "name": cfg.mangle(), "kind": "backward", "engine": "wgmma",
                              "coverage": {n: {"ok": c.ok, "detail": c.detail} for n, c in cov.items()},
                              "coverage_ok": all(c.ok for c in cov.values()), "verification": verification}
    checks = [result["coverage_ok"], verification["ok"]]
    hazards: list[str] = []
    if cta and result["coverage_ok"]:
        result["grads"], hazards = check_gradients(plan, simulate=simulate_hopper_backward)
        checks += [result["grads"]["ok"], not hazards]
    else:
        result["grads"] = {"ok": not cta, "detail": "skipped: " + ("coverage failed" if cta else "not asked for")}
    walk = "every CTA of the backward pass below: TMA ring, wgmma groups, dS^T handoff"
    result["schedule"] = {"ok": not hazards, "hazards": hazards, "walk": walk}
    result["ok"] = all(checks)
    return result
