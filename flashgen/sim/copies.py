"""Evaluate a plan's copies over every thread, warp, value and loop index.

A :class:`CopyTrace` is one :class:`~flashgen.dsl.plan.TiledCopy` evaluated over its
whole domain: for each warp, each instruction the warp issues and each lane, the
tile coordinate(s), the shared-memory element offset and the byte address. The
coordinates come from the plan's ``Partition`` / ``TVMap`` Layouts (evaluated in bulk
through :mod:`flashgen.sim.layout_eval`), the offsets from the smem tensor's
(swizzled) Layout; what an instruction does with an address comes from
:mod:`flashgen.sim.hardware`.

Instruction domain of a copy (the emitter's use of the same objects):

* ``vec16`` / ``cp_async`` (g2s, s2g): a TV value is one 16-byte chunk, 8 elements
  starting at ``(row, col)``; one instruction per value; CTA scope means thread =
  ``32 * warp + lane``;
* ``ldmatrix`` (s2r): a TV value is the row address a lane supplies; one instruction
  per loop index (``mi``/``nn``/``kk``), a warp-scope copy (thread = lane);
* ``st_shared_b32`` (r2s): TV values are single elements; one 32-bit store moves the
  ``atom.elems`` = 2 consecutive values ``(v, v+1)``, ``v`` even, so one instruction
  per ``(v/2, loops)``.

Coverage checks (``check_*``) return a :class:`Coverage` with a readable detail.
"""
from __future__ import annotations

import functools
import itertools
from typing import Callable, Sequence

import attrs
import numpy as np

from flashgen.dsl.plan import KernelPlan, TiledCopy
from flashgen.dsl.swizzle import ComposedLayout
from flashgen.sim import hardware as hw
from flashgen.sim.layout_eval import offsets

VEC_ELEMS = 8  # 16 bytes of 16-bit elements

KINDS = {"g2s", "s2r", "r2s", "s2g"}


# ---- the plan's shared memory -------------------------------------------------------------


def tile_shape(layout) -> tuple[int, int]:
    """(rows, cols) of a rank-2 tile layout (Layout or ComposedLayout)."""
    inner = layout.layout if isinstance(layout, ComposedLayout) else layout
    if inner.rank != 2:
        raise ValueError(f"expected a rank-2 tile layout, got {layout}")
    return inner[0].size, inner[1].size


@functools.lru_cache(maxsize=256)
def smem_offset_table(layout) -> np.ndarray:
    """``table[row + rows * col] == layout((row, col))`` for the whole tile (read-only)."""
    t = offsets(layout)
    t.setflags(write=False)
    return t


@functools.lru_cache(maxsize=256)
def smem_inverse_table(layout) -> np.ndarray:
    """``inv[offset] = row + rows * col`` (-1 where no coordinate maps), size ``cosize``."""
    t = smem_offset_table(layout)
    inv = np.full(int(t.max()) + 1, -1, dtype=np.int64)
    inv[t] = np.arange(t.size)
    inv.setflags(write=False)
    return inv


def tensor_elems(layout) -> int:
    """Elements of shared memory a tensor spans (its cosize), computed from the offset table."""
    return int(smem_offset_table(layout).max()) + 1


def smem_bases(plan: KernelPlan) -> dict[str, int]:
    """Byte offset of each shared tensor in the CTA's dynamic shared memory.

    As the emitted kernel lays it out: sQ at 0, sK after sQ, sV after sK, sO = sQ; a plan with
    tiles of its own (the backward's) gives their places as ``plan.smem_layout``.
    """
    own = getattr(plan, "smem_layout", None)
    if own is not None:
        return own
    q = 2 * tensor_elems(plan.tensors["sQ"].layout)
    k = 2 * tensor_elems(plan.tensors["sK"].layout)
    return {"sQ": 0, "sK": q, "sV": q + k, "sO": 0}


def smem_total_bytes(plan: KernelPlan) -> int:
    b = smem_bases(plan)
    return b["sV"] + 2 * tensor_elems(plan.tensors["sV"].layout)


def plan_copies(plan: KernelPlan) -> list[tuple[str, TiledCopy]]:
    """(kind, copy) of every copy of the plan, in execution order of a block."""
    out: list[tuple[str, TiledCopy]] = [("g2s", plan.g2s[o]) for o in "QKV"]
    out += [("s2r", plan.s2r[o].copy) for o in "QKV"]
    out += [("r2s", plan.r2s_O), ("s2g", plan.s2g_O)]
    return out


# ---- traces ---------------------------------------------------------------------------------


@attrs.define(eq=False)
class CopyTrace:
    """One copy evaluated everywhere. Arrays are indexed ``[warp, instruction, lane, ...]``.

    ``index`` ``[n_instr, 1 + n_loops]``: the compile-time index of each instruction,
    columns ``index_names`` (the first value index ``v``, then the partition's loops).
    ``rows``/``cols`` ``[W, I, 32, vpi]``: tile coordinate of each TV value the lane's
    instruction uses (``vpi`` values per instruction). ``smem_elem``: element offset in
    the smem tensor of each such coordinate (-1 where outside the tile).
    ``byte_addr`` ``[W, I, 32]``: byte address in the CTA's shared memory of the
    lane's access (tensor base + 2 * offset of the first value).
    """

    kind: str
    copy: TiledCopy
    n_warps: int
    index_names: tuple[str, ...]
    index: np.ndarray
    threads: np.ndarray  # [W, 32] the partition's thread index (tid or lane)
    rows: np.ndarray
    cols: np.ndarray
    in_tile: np.ndarray
    smem_elem: np.ndarray
    base_bytes: int
    byte_addr: np.ndarray
    tile: tuple[int, int]

    @property
    def name(self) -> str:
        return self.copy.name

    @property
    def atom(self):
        return self.copy.atom

    @property
    def n_instr(self) -> int:
        return self.index.shape[0]

    def index_of(self, name: str) -> np.ndarray:
        """Values of one compile-time index over the instructions."""
        return self.index[:, self.index_names.index(name)]

    @property
    def bytes_per_instr_thread(self) -> int:
        return self.copy.atom.bytes_per_thread


def values_per_instruction(copy: TiledCopy) -> int:
    """TV values one instruction of ``copy`` uses per thread."""
    return copy.atom.elems if copy.atom.family == "st_shared_b32" else 1


def trace_copy(plan: KernelPlan, kind: str, copy: TiledCopy) -> CopyTrace:
    """Evaluate ``copy`` for every warp, instruction and lane of one CTA."""
    if kind not in KINDS:
        raise ValueError(f"unknown copy kind {kind!r}")
    cfg = plan.cfg
    part = copy.partition
    tv = part.tv
    W = cfg.n_warps
    lane = np.arange(32)
    warp = np.arange(W)
    if copy.scope == "cta":
        threads = 32 * warp[:, None] + lane[None, :]
        warp_coord = np.zeros(W, dtype=np.int64)
    elif copy.scope == "warp":
        threads = np.broadcast_to(lane[None, :], (W, 32)).copy()
        warp_coord = warp.astype(np.int64)
    else:
        raise ValueError(f"{copy.name}: unknown scope {copy.scope!r}")
    if threads.max() >= tv.n_threads:
        raise ValueError(f"{copy.name}: thread map {tv.name} has {tv.n_threads} threads; the copy runs {threads.max() + 1}")
    vpi = values_per_instruction(copy)
    if tv.n_values % vpi:
        raise ValueError(f"{copy.name}: {tv.n_values} values do not split into {vpi}-value instructions")
    names = ("v",) + tuple(l.name for l in part.loops)
    ranges = [range(0, tv.n_values, vpi)] + [range(l.extent) for l in part.loops]
    index = np.array(list(itertools.product(*ranges)), dtype=np.int64).reshape(-1, len(names))

    row_tab, col_tab = tv.tables()
    v = index[:, 0][:, None] + np.arange(vpi)[None, :]  # [I, vpi]
    row_step = np.array([l.row_step for l in part.loops], dtype=np.int64)
    col_step = np.array([l.col_step for l in part.loops], dtype=np.int64)
    d_row = index[:, 1:] @ row_step if part.loops else np.zeros(len(index), np.int64)
    d_col = index[:, 1:] @ col_step if part.loops else np.zeros(len(index), np.int64)
    t = threads[:, None, :, None]  # [W, 1, 32, 1]
    vv = v[None, :, None, :]  # [1, I, 1, vpi]
    warp_row, warp_col = part.warp_offset(warp_coord)
    rows = row_tab[t, vv] + warp_row[:, None, None, None] + d_row[None, :, None, None]
    cols = col_tab[t, vv] + warp_col[:, None, None, None] + d_col[None, :, None, None]

    layout = copy.smem.layout
    R, C = tile_shape(layout)
    in_tile = (rows >= 0) & (rows < R) & (cols >= 0) & (cols < C)
    table = smem_offset_table(layout)
    smem_elem = np.where(in_tile, table[np.where(in_tile, rows + R * cols, 0)], -1)
    base = smem_bases(plan)[copy.smem.name]
    byte_addr = base + 2 * smem_elem[..., 0]
    return CopyTrace(kind, copy, W, names, index, threads, rows, cols, in_tile, smem_elem, base, byte_addr, (R, C))


def trace_plan(plan: KernelPlan) -> dict[str, CopyTrace]:
    """Traces of every copy of the plan, keyed by copy name (g2s_Q ... s2g_O)."""
    return {copy.name: trace_copy(plan, kind, copy) for kind, copy in plan_copies(plan)}


# ---- bank conflicts ---------------------------------------------------------------------------


def access_kind(copy: TiledCopy) -> str:
    fam = copy.atom.family
    if fam in ("vec16", "cp_async"):
        return "vec16"
    if fam == "ldmatrix":
        return "ldmatrix"
    if fam == "st_shared_b32":
        return "b32"
    raise ValueError(f"{copy.name}: no bank model for atom family {fam!r}")


def wavefronts(trace: CopyTrace) -> tuple[np.ndarray, np.ndarray]:
    """(wavefronts, ideal wavefronts) of every instruction, both ``[W, I]``.

    Uses the shared-memory side of the copy; lanes outside the tile are an error.
    """
    if not trace.in_tile[..., 0].all():
        raise ValueError(f"{trace.name}: addresses outside the tile; see the coverage check")
    kind = access_kind(trace.copy)
    if kind == "vec16":
        w = hw.wavefronts_vec16_many(trace.byte_addr)
    elif kind == "ldmatrix":
        w = hw.wavefronts_ldmatrix_many(trace.byte_addr, trace.atom.num)
    else:
        w = hw.wavefronts_b32_many(trace.byte_addr)
    ideal = np.full(w.shape, hw.ideal_wavefronts(kind, trace.atom.num), dtype=np.int64)
    return w, ideal


# ---- coverage ------------------------------------------------------------------------------------


@attrs.frozen
class Coverage:
    """Result of a coverage check: ``ok`` and a one-paragraph ``detail`` for a person."""

    name: str
    ok: bool
    detail: str

    def to_dict(self) -> dict:
        return {"name": self.name, "ok": self.ok, "detail": self.detail}


def coverage_of(name: str, problems: list[str], ok_detail: str) -> Coverage:
    """A check's result: ``ok_detail`` where ``problems`` is empty, else the first problems."""
    return _fail(name, problems) if problems else Coverage(name, True, ok_detail)


def _fail(name: str, problems: list[str]) -> Coverage:
    shown = problems[:4] + ([f"... and {len(problems) - 4} more"] if len(problems) > 4 else [])
    return Coverage(name, False, "; ".join(shown))


def _first(mask: np.ndarray, fmt: Callable[[tuple], str], what: str, limit: int = 3) -> str:
    idx = np.argwhere(mask)
    cells = ", ".join(fmt(tuple(int(x) for x in i)) for i in idx[:limit])
    more = f" (+{len(idx) - limit} more)" if len(idx) > limit else ""
    return f"{len(idx)} {what}: {cells}{more}"


def _where(trace: CopyTrace) -> Callable[[tuple], str]:
    def fmt(i: tuple) -> str:
        w, ins, lane = i[:3]
        idx = ", ".join(f"{n}={int(x)}" for n, x in zip(trace.index_names, trace.index[ins]))
        return f"warp {w} lane {lane} ({idx})"

    return fmt


def _chunk_checks(trace: CopyTrace, problems: list[str]) -> None:
    """16-byte chunk copies: in the tile, chunk-aligned column, contiguous & aligned in smem."""
    fmt = _where(trace)
    r, c = trace.rows[..., 0], trace.cols[..., 0]
    inside = trace.in_tile[..., 0]
    if not inside.all():
        problems.append(_first(~inside, fmt, "chunk(s) outside the tile"))
    bad_col = inside & (c % VEC_ELEMS != 0)
    if bad_col.any():
        problems.append(_first(bad_col, fmt, "chunk(s) not starting at a multiple of 8 columns"))
    R, C = trace.tile
    layout = trace.copy.smem.layout
    table = smem_offset_table(layout)
    ok = inside & ~bad_col
    start = trace.smem_elem[..., 0]
    if (start[ok] % VEC_ELEMS).any():
        problems.append(_first(ok & (start % VEC_ELEMS != 0), fmt, "chunk(s) not 16-byte aligned in shared memory"))
    e = np.arange(VEC_ELEMS)
    cc = np.where(ok, c, 0)[..., None] + e
    rr = np.where(ok, r, 0)[..., None]
    contiguous = (table[np.minimum(rr + R * cc, table.size - 1)] == start[..., None] + e).all(-1) | ~ok
    cc_ok = (cc < C).all(-1) | ~ok
    if not (contiguous & cc_ok).all():
        problems.append(_first(~(contiguous & cc_ok), fmt, "chunk(s) whose 8 elements are not contiguous in shared memory"))


def _count_once(counts: np.ndarray, what: str, fmt_cell: Callable[[int], str], problems: list[str]) -> None:
    missing = np.flatnonzero(counts == 0)
    dup = np.flatnonzero(counts > 1)
    if missing.size:
        problems.append(f"{missing.size} {what} never moved (e.g. {', '.join(fmt_cell(int(i)) for i in missing[:3])})")
    if dup.size:
        problems.append(f"{dup.size} {what} moved more than once (e.g. {', '.join(fmt_cell(int(i)) for i in dup[:3])})")


def check_g2s(trace: CopyTrace) -> Coverage:
    """Every 16-byte chunk of the tile is written exactly once, to its own place in smem."""
    problems: list[str] = []
    _chunk_checks(trace, problems)
    R, C = trace.tile
    cpr = C // VEC_ELEMS
    ok = trace.in_tile[..., 0] & (trace.cols[..., 0] % VEC_ELEMS == 0)
    chunk = trace.rows[..., 0][ok] * cpr + trace.cols[..., 0][ok] // VEC_ELEMS
    counts = np.bincount(chunk, minlength=R * cpr)
    _count_once(counts, "chunk(s)", lambda i: f"(row {i // cpr}, col {VEC_ELEMS * (i % cpr)})", problems)
    starts = trace.smem_elem[..., 0][ok]
    if np.unique(starts).size != starts.size and not problems:
        problems.append("two chunks land on the same shared-memory address")
    if problems:
        return _fail(trace.name, problems)
    threads = trace.n_warps * 32
    return Coverage(
        trace.name, True, f"{R}x{C} tile: all {R * cpr} 16-byte chunks written once ({threads} threads x {trace.n_instr} copies)"
    )


def _origin(origins: Sequence[tuple[int, int]] | None, w: int, owned_rows: int | None) -> tuple[int, int]:
    """Warp ``w``'s first (row, col): ``origins[w]``, or by default rows ``w * owned_rows`` from column 0."""
    return tuple(origins[w]) if origins is not None else (w * (owned_rows or 0), 0)


def check_s2g(trace: CopyTrace, owned_rows: int, origins: Sequence[tuple[int, int]] | None = None,
              owned_cols: int | None = None) -> Coverage:
    """Each warp reads every 16-byte chunk of its own ``owned_rows x owned_cols`` block exactly once
    (from ``origins[w]``; by default rows ``w * owned_rows``, all columns)."""
    problems: list[str] = []
    _chunk_checks(trace, problems)
    R, C = trace.tile
    C = C if owned_cols is None else owned_cols
    cpr = C // VEC_ELEMS
    for w in range(trace.n_warps):
        lo, c0 = _origin(origins, w, owned_rows)
        hi = lo + owned_rows
        r, c = trace.rows[w, ..., 0], trace.cols[w, ..., 0]
        ok = trace.in_tile[w, ..., 0] & (c % VEC_ELEMS == 0)
        foreign = ok & ((r < lo) | (r >= hi) | (c < c0) | (c >= c0 + C))
        if foreign.any():
            problems.append(f"warp {w} reads {int(foreign.sum())} chunk(s) outside its own rows [{lo}, {hi}), columns [{c0}, {c0 + C})")
        mine = ok & ~foreign
        chunk = (r[mine] - lo) * cpr + (c[mine] - c0) // VEC_ELEMS
        counts = np.bincount(chunk, minlength=(hi - lo) * cpr)
        _count_once(counts, f"chunk(s) of warp {w}", lambda i: f"(row {lo + i // cpr}, col {c0 + VEC_ELEMS * (i % cpr)})", problems)
    if problems:
        return _fail(trace.name, problems)
    return Coverage(trace.name, True, f"each warp reads its {owned_rows}x{C} O block: every 16-byte chunk once")


def check_ldmatrix(trace: CopyTrace, owned_rows: int | None = None, need_cols: int | None = None,
                   origins: Sequence[tuple[int, int]] | None = None) -> Coverage:
    """Per warp: the elements ldmatrix delivers (plan's lane addresses + PTX ldmatrix
    semantics) are exactly the warp's operand tile, each delivered once.

    The operand tile of warp ``w`` is rows ``[w*owned_rows, (w+1)*owned_rows)`` (the A
    operand: a warp's own query rows) or, with ``owned_rows`` None, the whole tile (a B
    operand, K or V, which every warp reads in full); columns ``[0, need_cols)`` (the
    head dimension rounded up to the MMA's 16; default: the tile's width). ``origins[w]``,
    when given, moves warp ``w``'s first row (with ``owned_rows``) and first column.
    """
    problems: list[str] = []
    atom = trace.atom
    fmt = _where(trace)
    used = trace.in_tile[:, :, : 8 * atom.num, 0]
    if not used.all():
        problems.append(_first(~used, fmt, "row address(es) outside the tile"))
        return _fail(trace.name, problems)
    lane_elem = trace.smem_elem[..., 0]  # [W, I, 32]
    if (lane_elem[:, :, : 8 * atom.num] % VEC_ELEMS).any():
        problems.append("row address(es) not 16-byte aligned")
        return _fail(trace.name, problems)
    layout = trace.copy.smem.layout
    inv = smem_inverse_table(layout)
    R, C = trace.tile
    C = C if need_cols is None else need_cols
    got = hw.ldmatrix_offsets(lane_elem, atom.num, atom.trans)  # [W, I, 32, num, 2]
    for w in range(trace.n_warps):
        off = got[w].ravel()
        if off.max() >= inv.size or (inv[off] < 0).any():
            problems.append(f"warp {w}: ldmatrix reads shared memory outside the tile")
            continue
        flat = inv[off]  # row + R * col
        rows, cols = flat % R, flat // R
        r0, c0 = _origin(origins, w, owned_rows)
        lo, hi = (0, R) if owned_rows is None else (r0, r0 + owned_rows)
        foreign = (rows < lo) | (rows >= hi)
        if foreign.any():
            problems.append(f"warp {w}: {int(foreign.sum())} element(s) from rows outside its operand rows [{lo}, {hi})")
        beyond = ~foreign & ((cols < c0) | (cols >= c0 + C))
        if beyond.any():
            problems.append(f"warp {w}: {int(beyond.sum())} element(s) from columns outside its operand's [{c0}, {c0 + C})")
            foreign |= beyond
        keep = ~foreign
        counts = np.bincount((rows[keep] - lo) * C + cols[keep] - c0, minlength=(hi - lo) * C)
        _count_once(counts, f"element(s) for warp {w}", lambda i: f"(row {lo + i // C}, col {c0 + i % C})", problems)
    if problems:
        return _fail(trace.name, problems)
    rows = R if owned_rows is None else owned_rows
    return Coverage(
        trace.name, True,
        f"{atom.name}: each warp receives its {rows}x{C} operand tile, every element once "
        f"({trace.n_instr} instructions per warp)",
    )


def check_r2s(trace: CopyTrace, owned_rows: int, need_cols: int | None = None, m_tile: int = 16, n_tile: int = 8,
              origins: Sequence[tuple[int, int]] | None = None, owned_cols: int | None = None) -> Coverage:
    """Each warp writes every element of its O rows exactly once, at its own place.

    Columns ``[0, need_cols)`` (d_head; default the tile's width) must be written once;
    padding columns beyond may be written at most once. With ``origins``, warp ``w``'s block
    starts at ``origins[w]`` and is ``owned_cols`` wide (``need_cols`` then counts within it).

    Instruction ``(v, mi, nt)`` stores accumulator registers ``v, v+1`` of the 16x8
    tile ``(mi, nt)`` (rows ``warp*owned_rows + 16*mi``, cols ``8*nt``) as one 32-bit
    word. Which element a register holds is the PTX C fragment map
    (:data:`hardware.C_ROW`/``C_COL``), not the plan's; the word must be 4-byte aligned
    and its two halves must be where the smem layout puts those two elements.
    """
    problems: list[str] = []
    fmt = _where(trace)
    if trace.atom.elems != 2 or trace.copy.partition.tv.n_values != 4:
        return _fail(trace.name, [f"expected 32-bit stores of 4-value accumulator fragments, got {trace.atom.name}"])
    inside = trace.in_tile[..., 0]
    if not inside.all():
        return _fail(trace.name, [_first(~inside, fmt, "store(s) outside the tile")])
    addr = trace.smem_elem[..., 0]
    if (addr % 2).any():
        problems.append(_first(addr % 2 != 0, fmt, "store(s) not 4-byte aligned"))
    R, C = trace.tile
    table = smem_offset_table(trace.copy.smem.layout)
    v = trace.index_of("v")
    mi = trace.index_of("mi") if "mi" in trace.index_names else np.zeros_like(v)
    nt = trace.index_of("nt") if "nt" in trace.index_names else np.zeros_like(v)
    lane = np.arange(32)
    R_tile, C = R, C if owned_cols is None else owned_cols
    for w in range(trace.n_warps):
        r0, c0 = _origin(origins, w, owned_rows)
        counts = np.zeros(owned_rows * C, dtype=np.int64)
        for e in range(2):
            reg = v + e  # [I]
            true_r = r0 + m_tile * mi[:, None] + hw.C_ROW[lane[None, :], reg[:, None]]  # [I, 32]
            true_c = c0 + n_tile * nt[:, None] + hw.C_COL[lane[None, :], reg[:, None]]
            inside_true = (true_r >= r0) & (true_r < r0 + owned_rows) & (true_c < c0 + C)
            if not inside_true.all():
                problems.append(f"warp {w}: accumulator elements outside the warp's rows")
                continue
            want = table[true_r + R_tile * true_c]
            wrong = want != addr[w] + e
            if wrong.any():
                problems.append(
                    _first(wrong[None], lambda i: fmt((w,) + i[1:]), f"half-word(s) {e} stored away from their element")
                )
            np.add.at(counts, (true_r - r0).ravel() * C + (true_c - c0).ravel(), 1)
        need = C if need_cols is None else need_cols
        grid = counts.reshape(owned_rows, C)
        _count_once(grid[:, :need].ravel(), f"element(s) of warp {w}", lambda i: f"(row {r0 + i // need}, col {c0 + i % need})", problems)
        if (grid[:, need:] > 1).any():
            problems.append(f"warp {w}: padding columns written more than once")
    if problems:
        return _fail(trace.name, problems)
    need = C if need_cols is None else need_cols
    return Coverage(trace.name, True, f"each warp writes its {owned_rows}x{need} O rows: every element once, at its layout offset")


def check_copy(plan: KernelPlan, trace: CopyTrace) -> Coverage:
    if trace.kind == "g2s":
        return check_g2s(trace)
    cfg = plan.cfg
    if trace.kind == "s2r":
        a_operand = trace.name == plan.s2r["Q"].copy.name  # Q: the warp's own rows; K, V: all rows
        return check_ldmatrix(trace, cfg.rows_per_warp if a_operand else None, -(-cfg.d_head // 16) * 16)
    if trace.kind == "r2s":
        return check_r2s(trace, cfg.rows_per_warp, cfg.d_head)
    return check_s2g(trace, plan.cfg.rows_per_warp)


def coverage(plan: KernelPlan, traces: dict[str, CopyTrace] | None = None) -> dict[str, Coverage]:
    """Coverage of every copy of the plan, keyed by copy name."""
    traces = trace_plan(plan) if traces is None else traces
    out = {}
    for name, tr in traces.items():
        try:
            out[name] = check_copy(plan, tr)
        except Exception as exc:  # a malformed plan must give a report, not a traceback
            out[name] = Coverage(name, False, f"check raised {type(exc).__name__}: {exc}")
    return out
