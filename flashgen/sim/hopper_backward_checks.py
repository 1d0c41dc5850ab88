"""Proofs about a wgmma backward plan's descriptors, dS^T handoff and barriers (used by
:func:`flashgen.sim.verify.hopper_backward_checks`).

The emitter renders each GEMM's descriptors from the plan's per-step offsets and the dS^T stores from
the accumulator map and the tile's layout; these functions read the addresses back through the ISA
address models and say, for every consumer, k16 step and element, where they differ from what the
GEMM needs:

==========  =============================================  ============================================
GEMM        A (m, kk) of k16 step s, consumer w            B (n, kk)
==========  =============================================  ============================================
``S``       sK[64 w + m, 16 s + kk] (K-major)              sQ[n, 16 s + kk] (K-major)
``dP``      sV[64 w + m, 16 s + kk]                        sdO[n, 16 s + kk]
``dV``      registers (``a_from_acc``)                     sdO[16 s + kk, n] (MN-major)
``dK``      registers                                      sQ[16 s + kk, n]
``dQ``      sdS[16 s + kk, row0(w) + m] (MN-major: dS =    sK[16 s + kk, col0(w) + n]
            dS^T's T)
==========  =============================================  ============================================

(``row0``, ``col0``: where consumer ``w``'s dQ lies in the query block, :class:`~flashgen.dsl.hopper_backward_smem.DqStage`.)
Where the DqStage is ``transposed`` (dQ^T = K^T dS^T), dQ's A (m, kk) is sK[16 s + kk, col0(w) + m] (MN-major) and its
B (n, kk) sdS[n, 16 s + kk] (K-major: the tile is dS, [query][key]).
"""
from __future__ import annotations

import numpy as np

from flashgen.dsl.atoms.hopper import descriptor_addresses, descriptor_addresses_mn
from flashgen.dsl.hopper_backward_plan import HopperBackwardPlan
from flashgen.sim.hopper import c_table
from flashgen.sim.hopper_backward_smem import ds_store_targets, tile_table

#: (GEMM, operand) -> (tile, K-major: rows and columns are (m or n, k), else (k, m or n), consumer column offset)
_NEEDS = {
    ("S", "a"): ("K", True), ("S", "b"): ("Q", True),
    ("dP", "a"): ("V", True), ("dP", "b"): ("dO", True),
    ("dV", "b"): ("dO", False), ("dK", "b"): ("Q", False),
    ("dQ", "a"): ("dS", False), ("dQ", "b"): ("K", False),
}
#: dQ^T = K^T dS^T (DqStage.transposed): A is K^T (sK MN-major, the consumer's columns), B the [query][key] dS tile
_NEEDS_DQ_T = {("dQ", "a"): ("K", False), ("dQ", "b"): ("dS", True)}
#: the reduction length of each GEMM, from the config
_K = {"S": "d_head", "dP": "d_head", "dV": "B_r", "dK": "B_r", "dQ": "B_c"}


def _needs(plan: HopperBackwardPlan, gemm: str, operand: str) -> tuple[str, bool]:
    return (_NEEDS_DQ_T if plan.dq_stage.transposed and gemm == "dQ" else _NEEDS)[(gemm, operand)]


def _wanted(plan: HopperBackwardPlan, gemm: str, operand: str, w: int, s: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Tile (row, col) ``[n, 16]`` that element (m or n, kk) of k16 step ``s`` of consumer ``w`` must read."""
    _, kmajor = _needs(plan, gemm, operand)
    mn = np.arange(n)[:, None]
    kk = np.arange(16)[None, :] + 16 * s
    if kmajor:  # A rows are the consumer's 64 key rows; B rows every query row
        return np.broadcast_to(mn + (64 * w if operand == "a" else 0), (n, 16)), np.broadcast_to(kk, (n, 16))
    st = plan.dq_stage
    col0 = ({("dQ", "a"): st.col0(w)} if st.transposed else {("dQ", "a"): st.row0(w), ("dQ", "b"): st.col0(w)}).get((gemm, operand), 0)
    return np.broadcast_to(kk, (n, 16)), np.broadcast_to(mn + col0, (n, 16))


def descriptor_problems(plan: HopperBackwardPlan, gemm: str) -> list[str]:
    """Every address GEMM ``gemm``'s shared-memory descriptors read (every consumer, k16 step and element)
    is the tile element it needs, at the tile's layout offset; its k16 steps span the reduction."""
    g, cfg = plan.gemms[gemm], plan.cfg
    out = []
    if 16 * g.k_steps != getattr(cfg, _K[gemm]):
        out.append(f"{g.k_steps} k16 steps for a reduction of {getattr(cfg, _K[gemm])}")
    for operand, desc, mn in (("a", g.a, g.trans_a), ("b", g.b, g.trans_b)):
        if desc is None:
            continue
        tile = plan.tiles[_needs(plan, gemm, operand)[0]]
        table = tile_table(tile)
        n = 64 if operand == "a" else g.atom.N
        read = descriptor_addresses_mn if mn else descriptor_addresses
        for w in range(plan.consumers):
            for s in range(len(desc.step_offsets)):
                rows, cols = _wanted(plan, gemm, operand, w, s, n)
                if rows.max() >= tile.rows or cols.max() >= tile.cols:
                    out.append(f"{operand.upper()} of consumer {w}, step {s}: needs rows/columns past the {tile.rows}x{tile.cols} tile")
                    continue
                got = read(desc.descriptor(tile.offset, s, w), n, 16, cfg.dtype)
                bad = np.argwhere(got != tile.offset + 2 * table[rows, cols])
                out += [f"{operand.upper()} of consumer {w}, step {s}, element ({i}, {k}): reads byte {got[i, k]}, "
                        f"{tile.name}[{rows[i, k]}, {cols[i, k]}] is at {tile.offset + 2 * table[rows[i, k], cols[i, k]]}"
                        for i, k in bad[:1]]
    return out


def ds_handoff_problems(plan: HopperBackwardPlan) -> list[str]:
    """What the consumers' dS^T stores (:func:`~flashgen.sim.hopper_backward_smem.ds_store_targets`: 32-bit pairs, or
    stmatrix .trans into a [query][key] tile) put at each address is what every consumer's dQ descriptors read
    there: dS^T[16 s + kk, row0(w) + m] as dQ's A, or (dQ^T) dS^T[16 s + kk, n] as its B."""
    tile, cs = plan.tiles["dS"], c_table(plan.gemms["S"].atom)
    size = tile.stage_bytes // 2
    held = {}  # element offset -> (key row, query column) of dS^T stored there
    for w in range(plan.consumers):
        dst = ds_store_targets(plan, w)
        if dst.min() < 0 or dst.max() >= size:
            return [f"consumer {w}'s dS^T stores reach past the {tile.rows}x{tile.cols} tile"]
        for e, rr, cc in zip(dst.ravel(), (64 * w + cs.rows).ravel(), cs.cols.ravel()):
            if held.setdefault(int(e), (int(rr), int(cc))) != (int(rr), int(cc)):
                return [f"element {e} of the dS tile is stored twice (dS^T{held[int(e)]} and dS^T{(int(rr), int(cc))})"]
    g, st, out = plan.gemms["dQ"], plan.dq_stage, []
    desc, n, read = (g.b, g.atom.N, descriptor_addresses) if st.transposed else (g.a, 64, descriptor_addresses_mn)
    for w in range(plan.consumers):
        for s in range(g.k_steps):
            got = (read(desc.descriptor(tile.offset, s, w), n, 16, plan.cfg.dtype) - tile.offset) // 2
            for m, kk in np.ndindex(got.shape):
                want = (16 * s + kk, m if st.transposed else st.row0(w) + m)
                if held.get(int(got[m, kk])) != want:
                    out.append(f"consumer {w}'s dQ {'B' if st.transposed else 'A'}, step {s}, element ({m}, {kk}): reads element "
                               f"{got[m, kk]}, which holds dS^T{held.get(int(got[m, kk]))}, not dS^T{want}")
                    if len(out) >= 3:
                        return out
    return out


def barrier_problems(plan: HopperBackwardPlan) -> list[str]:
    """The empty barriers count one arrival per consumer warp, the full ones the producer's one; the ring,
    the streamed tiles and the statistics have the same stages; the consumers' dQ tiles cover the query
    block's B_r x d_head once, each its region of the chunk."""
    cfg, out = plan.cfg, []
    released = plan.release_arrivals * plan.consumers
    #: (arrivals, stages): the resident K and V, and the producer's dQ reductions, one stage of one arrival
    expected = {"kv_full": (1, 1), "dq_empty": (1, 1), "q_empty": (released, plan.ring.stages), "do_empty": (released, plan.ring.stages)}
    for name, (bar, _, stages) in plan.barriers.items():
        want, want_stages = expected.get(name, (1, plan.ring.stages))
        if bar.arrive_count != want:
            out.append(f"{name}: arrive count {bar.arrive_count}, expected {want}")
        if stages != want_stages:
            out.append(f"{name}: {stages} stage(s), expected {want_stages}")
    if ("dq_empty" in plan.barriers) != plan.dq_stage.by_producer:
        out.append("a dq_empty barrier where the producer adds dQ (DqStage.by_producer), and only there")
    for name in ("Q", "dO"):
        if plan.tiles[name].stages != plan.ring.stages:
            out.append(f"s{name}: {plan.tiles[name].stages} stage(s), the ring has {plan.ring.stages}")
    for name, (_, stages, size) in plan.stats.items():
        if stages != plan.ring.stages or size != 4 * cfg.B_r:
            out.append(f"{name}: {stages} stage(s) of {size} bytes, expected {plan.ring.stages} of {4 * cfg.B_r}")
    return out + dq_split_problems(plan)


def dq_split_problems(plan: HopperBackwardPlan) -> list[str]:
    """The consumers' dQ tiles (each the dQ GEMM's 64 x N at ``row0``, ``col0``: 64 query rows x N columns of
    d_head, or, ``transposed`` at 80 rows, N = 80 query rows x 64 columns) cover the query block's ``B_r x
    d_head`` exactly once; the chunk holds every consumer's region."""
    cfg, st, out = plan.cfg, plan.dq_stage, []
    count = np.zeros((cfg.B_r + 64, cfg.d_head + max(st.cols, 64)), np.int64)
    n = plan.gemms["dQ"].atom.N
    if (st.rows, st.cols) != (64, n):
        out.append(f"DqStage regions of {st.rows}x{st.cols}, the dQ GEMM makes 64x{n}")
    q, d = (n, 64) if st.transposed else (64, n)  # query rows, columns of d_head of a consumer's tile
    for w in range(plan.consumers):
        count[st.row0(w):st.row0(w) + q, st.col0(w):st.col0(w) + d] += 1
    if (count[:cfg.B_r, :cfg.d_head] != 1).any() or count[cfg.B_r:].any() or count[:, cfg.d_head:].any():
        out.append(f"the consumers' dQ tiles do not cover the {cfg.B_r}x{cfg.d_head} query block exactly once")
    if plan.consumers * st.rows * st.cols != cfg.B_r * cfg.d_head:
        out.append(f"{plan.consumers} regions of {st.rows}x{st.cols} for a chunk of {cfg.B_r}x{cfg.d_head}")
    return out
