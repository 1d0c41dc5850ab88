"""The verification step: proofs of what a plan derived, run once per config instead of on every emit.

The emitters render the plan's derived tables and rely on properties of its maps without
re-checking them (so that emitting stays fast); this module proves those properties for one
config, over every thread, warp and index, and caches the result per config:

* mma.sync: every shared-memory copy's address split (``base ^ xor[i] + add[i]``, derived from
  thread 0 by :mod:`flashgen.dsl.addressing`) is exact at every thread, warp and compile-time
  index; the MMA's C fragment map holds values ``(2h, 2h+1)`` of a lane in one row, neighbouring
  columns (the softmax masks and reduces them as a pair);
* mma.sync backward: every shared-memory copy's address split, as the forward's;
* wgmma backward: the accumulator-to-A table of dV and dK, each GEMM's descriptors (every address
  read is the tile element the GEMM needs), the dS^T stores against what dQ's A descriptors read,
  the barrier counts (:mod:`flashgen.sim.hopper_backward_checks`);
* wgmma: the P-from-S register table (derived from thread 0) names, in every thread, the S
  accumulator value holding the P element each A register needs; the accumulator maps of both
  GEMMs follow the ``(chunk, half, e)`` pattern the softmax, rescale and epilogue index by; the
  output's TMA store boxes are where each consumer staged its rows.

:func:`flashgen.engines.verify` (cached per config) is what tests and ``flashgen simulate`` call:
a :class:`Verification` of the engine's checks (:func:`mma_sync_checks`, :func:`wgmma_checks`),
raising :class:`VerificationError` when a proof fails.
"""
from __future__ import annotations

import attrs
import numpy as np

from flashgen.dsl.addressing import plan_splits, smem_copies, split_offsets, split_problems
from flashgen.dsl.backward_plan import BackwardPlan
from flashgen.dsl.config import WGMMA_M
from flashgen.dsl.hopper_plan import HopperPlan
from flashgen.dsl.hopper_backward_plan import HopperBackwardPlan
from flashgen.dsl.plan import KernelPlan
from flashgen.dsl.tiling import TVMap

#: problems reported per check (the first ones; one is enough to fail)
SHOWN = 3


class VerificationError(AssertionError):
    """A property the emitted kernel relies on does not hold for the config's plan."""


@attrs.frozen
class Check:
    """One proof: ``problems`` says where it fails (empty: it holds)."""

    name: str
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


@attrs.frozen
class Verification:
    """Every check of one config's plan."""

    config: str
    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def to_dict(self) -> dict:
        return {"ok": self.ok, "checks": {c.name: list(c.problems) for c in self.checks}}

    def raise_if_failed(self) -> "Verification":
        bad = [f"{c.name}: {p}" for c in self.checks for p in c.problems]
        if bad:
            raise VerificationError(f"{self.config}: the plan fails verification:\n  " + "\n  ".join(bad))
        return self


def wgmma_checks(plan: HopperPlan) -> tuple[Check, ...]:
    """The proofs of a wgmma plan: the P-from-S table, both accumulator patterns, the O store boxes."""
    return (
        Check("p_from_s", tuple(p_from_s_problems(plan))),
        Check("S accumulator pattern", tuple(c_chunk_problems(plan.gemm_S.atom.c_map))),
        Check("O accumulator pattern", tuple(c_chunk_problems(plan.gemm_O.atom.c_map))),
        Check("O store boxes", tuple(o_store_problems(plan))),
    )


def hopper_backward_checks(plan: HopperBackwardPlan) -> tuple[Check, ...]:
    """The proofs of a wgmma backward plan: the accumulator-to-A table of dV and dK, the S^T accumulator
    pattern, every GEMM's descriptors, the dS tile's stores against dQ's reads of it (its A operand, or its B where
    dQ is made transposed), the barrier counts, the dK and dV store boxes."""
    from flashgen.sim.hopper_backward_checks import barrier_problems, descriptor_problems, ds_handoff_problems

    g = plan.gemms
    return (
        Check("a_from_acc (P^T -> dV)", tuple(acc_to_a_problems(plan.a_from_acc, g["S"].atom.c_map, g["dV"].atom.a_map, "P^T"))),
        Check("a_from_acc (dS^T -> dK)", tuple(acc_to_a_problems(plan.a_from_acc, g["dP"].atom.c_map, g["dK"].atom.a_map, "dS^T"))),
        Check("S^T accumulator pattern", tuple(c_chunk_problems(g["S"].atom.c_map))),
        *([Check("lse and D pair loads", tuple(pair_load_problems(g["S"].atom.c_map)[:SHOWN]))] if plan.stat_pairs else []),
    ) + tuple(Check(f"descriptors {name}", tuple(descriptor_problems(plan, name)[:SHOWN])) for name in g) + (
        Check("dS stores = dQ's dS operand reads", tuple(ds_handoff_problems(plan)[:SHOWN])),
        Check("barriers and ring", tuple(barrier_problems(plan))),
    ) + tuple(Check(f"{name} store boxes", tuple(store_box_problems(plan.stores[name], name))) for name in ("dK", "dV"))


def mma_sync_checks(plan: KernelPlan) -> tuple[Check, ...]:
    """The proofs of an mma.sync plan: every shared-memory copy's address split, the C map's row pairs."""
    splits = plan_splits(plan)
    return tuple(
        Check(f"address split {c.name}", tuple(split_problems(c, splits[c.name], plan.cfg.n_warps, SHOWN)))
        for c in smem_copies(plan)
    ) + (Check("C fragment row pairs", tuple(c_row_pair_problems(plan.mma.c_map))),)


def backward_checks(plan: BackwardPlan) -> tuple[Check, ...]:
    """The proofs of an mma.sync backward plan: every shared-memory copy's address split (the
    emitter renders each copy's addresses from its thread-0 split)."""
    return tuple(Check(f"address split {c.name}", tuple(split_problems(c, split_offsets(c), plan.cfg.n_warps, SHOWN)))
                 for _, c in plan.copies())


def _mismatches(what: str, got: np.ndarray, want: np.ndarray, where) -> list[str]:
    """One line per differing element (the first :data:`SHOWN`); ``where(index)`` names it."""
    return [f"{where(tuple(int(x) for x in i))}: {what} {got[tuple(i)]}, expected {want[tuple(i)]}"
            for i in np.argwhere(got != want)[:SHOWN]]


def c_row_pair_problems(c_map: TVMap) -> list[str]:
    """mma.sync C map: values ``2h`` and ``2h+1`` of a lane are ``(row, col)`` and ``(row, col + 1)``,
    and ``col`` is the lane's column of value 0 (one kept-column range per row covers both)."""
    rows, cols = c_map.tables()
    where = lambda i: f"C map {c_map}: lane {i[0]} value {2 * i[1] + 1}"  # noqa: E731
    even, odd = np.arange(0, c_map.n_values, 2), np.arange(1, c_map.n_values, 2)
    out = _mismatches("row", rows[:, odd], rows[:, even], where)
    out += _mismatches("column", cols[:, odd], cols[:, even] + 1, where)
    out += _mismatches("column of the pair", cols[:, even], np.repeat(cols[:, :1], len(even), axis=1),
                       lambda i: f"C map {c_map}: lane {i[0]} value {2 * i[1]}")
    return out


def c_chunk_problems(c_map: TVMap) -> list[str]:
    """wgmma accumulator map: value ``i = 4 chunk + 2 h + e`` of a thread is in row half ``h`` (the
    row of value ``2h``) and column ``col(thread, 0) + 8 chunk + e``."""
    rows, cols = c_map.tables()
    i = np.arange(c_map.n_values)
    where = lambda k: f"accumulator map {c_map}: thread {k[0]} value {k[1]}"  # noqa: E731
    out = _mismatches("row", rows, rows[:, 2 * ((i // 2) % 2)], where)
    return out + _mismatches("column", cols, cols[:, :1] + 8 * (i // 4) + i % 2, where)


def pair_load_problems(c_map: TVMap) -> list[str]:
    """The wgmma backward reads the lse and D of a chunk's two columns (values ``4 chunk + e`` in column
    ``col(thread, 4 chunk) + e``, :func:`c_chunk_problems`) with one 8-byte load: the chunk's first column must be
    even (the statistics' rows start 16-byte aligned)."""
    cols = c_map.tables()[1][:, ::4]
    return [f"accumulator map {c_map}: thread {t} chunk {k} starts at column {cols[t, k]}, odd: its 8-byte load of the lse "
            "and D pair is misaligned" for t, k in zip(*np.nonzero(cols % 2))]


def acc_to_a_problems(table, c_map: TVMap, a_map: TVMap, what: str = "P") -> list[str]:
    """In every thread, accumulator value ``table[t][r][half]`` (of ``c_map``) holds the element of ``what``
    that A value ``2r + half`` of k16 step ``t`` needs (``a_map``): row ``a_row``, column ``16 t + a_col``
    (the same register in all threads, as the table was derived from thread 0)."""
    table = np.array(table, dtype=np.int64).reshape(len(table), 8)  # [step, A value]
    s_rows, s_cols = c_map.tables()
    a_rows, a_cols = a_map.tables()
    steps = np.arange(table.shape[0])[None, :, None]
    where = lambda k: f"thread {k[0]} step {k[1]} A register {k[2] // 2} half {k[2] % 2} <- accumulator value {table[k[1], k[2]]}"  # noqa: E731
    out = _mismatches(f"{what} row", s_rows[:, table], np.broadcast_to(a_rows[:, None, :], (len(a_rows),) + table.shape), where)
    return out + _mismatches(f"{what} column", s_cols[:, table], 16 * steps + a_cols[:, None, :], where)


def p_from_s_problems(plan: HopperPlan) -> list[str]:
    """The forward's P-from-S table (:func:`acc_to_a_problems` of S's accumulator and O's A map)."""
    return acc_to_a_problems(plan.p_from_s, plan.gemm_S.atom.c_map, plan.gemm_O.atom.a_map)


def store_box_problems(store, what: str) -> list[str]:
    """The TMA store boxes of ``store`` (a TmaTile) are ``WGMMA_M`` rows (one consumer's), row block ``i`` of a
    column block sits ``i`` boxes after row block 0 (consumer ``cw`` stores from ``base + cw * box bytes``), and
    each box reads (the 128B-swizzle byte rule) the elements the tile's layout stages there."""
    from flashgen.sim.hopper import tma_byte_addresses
    from flashgen.sim.layout_eval import tile_table

    rows, cols = store.tma.box_rows, store.tma.box_cols
    if rows != WGMMA_M:
        return [f"{what} store boxes of {rows} rows: a consumer owns {WGMMA_M}"]
    first = {b.col0: b.smem_offset for b in store.boxes if b.row0 == 0}
    out = [f"{what} store box at row {b.row0}, column {b.col0} is not where consumer {b.row0 // rows} staged it"
           for b in store.boxes if b.smem_offset != first[b.col0] + (b.row0 // rows) * store.tma.bytes]
    tile = store.tile
    staged = store.tma.dtype.size * tile_table(tile)  # [row, col] -> byte in the tile
    for b in store.boxes:
        got = staged[b.row0:b.row0 + rows, b.col0:b.col0 + cols]
        bad = np.argwhere(got != tma_byte_addresses(rows, cols, b.smem_offset, store.tma.dtype.size)[:got.shape[0], :got.shape[1]])
        out += [f"{what} store box at row {b.row0}, column {b.col0} reads element ({b.row0 + r}, {b.col0 + c}) elsewhere "
                f"than {tile.name}'s layout stages it" for r, c in bad[:1]]
    return out[:SHOWN]


def o_store_problems(plan: HopperPlan) -> list[str]:
    """The forward's O store boxes (:func:`store_box_problems`)."""
    return store_box_problems(plan.stores["O"], "O")