"""Cheap addresses: split a copy's offsets into a per-thread base and compile-time constants.

A swizzle is linear over GF(2) and a layout is linear over the integers, so for the
tiles the kernels use, ``offset(thread, i) == (offset(thread, 0) ^ X[i]) + A[i]``
where ``i`` enumerates the compile-time indices (the copy's value index and loops),
``X[i]`` only touches the swizzle's bits and ``A[i]`` lies above them. The kernel
then keeps one register per distinct ``X`` and folds ``A`` into the instruction's
immediate offset — the seed's "fewer integer instructions in address math" step,
derived instead of hand-written.

Deriving a split reads one thread (thread 0 of warp 0) over every compile-time index;
that the split then holds for *every* thread and warp is a proof obligation, discharged
by :func:`split_problems` in the cached verification step (:mod:`flashgen.sim.verify`),
not on every emit.
"""
from __future__ import annotations

import functools

import attrs
import numpy as np

from .config import KernelConfig
from .plan import KernelPlan, TiledCopy, make_plan
from .swizzle import ComposedLayout


@attrs.frozen
class OffsetSplit:
    """``offset(thread, idx) = (base(thread) ^ xor[idx]) + add[idx]``, and the coordinate deltas.

    ``index_names``/``extents`` describe the compile-time index space (value index
    ``v`` first, then the partition's loops); tables are row-major over ``extents``
    (last index fastest), matching C array nesting.
    """

    copy_name: str
    index_names: tuple[str, ...]
    extents: tuple[int, ...]
    xor: tuple[int, ...]
    add: tuple[int, ...]
    d_row: tuple[int, ...]  # row(thread, idx) - row(thread, 0)
    d_col: tuple[int, ...]

    @property
    def distinct_xor(self) -> int:
        return len(set(self.xor))


def thread_domain(copy: TiledCopy, n_warps: int) -> list[tuple[int, int]]:
    """The runtime (thread, warp) pairs a copy runs on."""
    n = copy.partition.tv.n_threads
    warps = range(n_warps) if copy.partition.uses_warp else range(1)
    return [(t, w) for w in warps for t in range(n)]


def index_space(copy: TiledCopy) -> tuple[tuple[str, ...], tuple[int, ...]]:
    part = copy.partition
    names = ("v",) + tuple(l.name for l in part.loops)
    extents = (part.tv.n_values,) + tuple(l.extent for l in part.loops)
    return names, extents


def _swizzle_low_mask(copy: TiledCopy) -> int:
    """The offset bits a swizzle may change (below its highest source/target bit); 0 without one."""
    layout = copy.smem.layout
    swz = layout.swizzle if isinstance(layout, ComposedLayout) else None
    if swz is None or swz.is_identity:
        return 0
    return (1 << max(swz.yyy_mask, swz.zzz_mask).bit_length()) - 1


def copy_offsets(copy: TiledCopy, domain: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(rows, cols, smem offsets)`` of ``copy`` for each (thread, warp) of ``domain``, each
    ``[len(domain), n_indices]`` with the compile-time indices row-major over :func:`index_space`."""
    pairs = np.array(domain, dtype=np.int64).reshape(-1, 2)
    rows, cols = copy.partition.coords(pairs[:, 0], pairs[:, 1])
    rows, cols = rows.reshape(len(pairs), -1), cols.reshape(len(pairs), -1)
    return rows, cols, copy.smem.layout.offsets_at(rows, cols)


def split_offsets(copy: TiledCopy) -> OffsetSplit:
    """The base/xor/add split of ``copy``'s shared-memory offsets, read off thread 0 of warp 0.

    ``xor[i]`` is the change of the swizzle's bits from index 0 to index ``i``, ``add[i]``
    the change above them; at thread 0 the split is exact by construction, at every other
    thread :func:`split_problems` proves it.
    """
    names, extents = index_space(copy)
    low = _swizzle_low_mask(copy)
    rows, cols, off = (a[0] for a in copy_offsets(copy, [(0, 0)]))
    base = off[0]
    xor = (off ^ base) & low
    add = (off & ~low) - (base & ~low)
    return OffsetSplit(copy.name, names, extents, _ints(xor), _ints(add), _ints(rows - rows[0]), _ints(cols - cols[0]))


def _ints(a: np.ndarray) -> tuple[int, ...]:
    return tuple(int(x) for x in a)


def split_problems(copy: TiledCopy, split: OffsetSplit, n_warps: int, limit: int = 3) -> list[str]:
    """Where ``split`` differs from ``copy``'s own offsets and coordinates, over every thread, warp
    and compile-time index (empty: the split is exact everywhere)."""
    domain = thread_domain(copy, n_warps)
    rows, cols, off = copy_offsets(copy, domain)
    want = {
        "offset": (off[:, :1] ^ np.array(split.xor)) + np.array(split.add),
        "row": rows[:, :1] + np.array(split.d_row),
        "col": cols[:, :1] + np.array(split.d_col),
    }
    got = {"offset": off, "row": rows, "col": cols}
    problems = []
    for what, w in want.items():
        for d, i in np.argwhere(got[what] != w)[:limit]:
            (t, warp), idx = domain[d], np.unravel_index(i, split.extents)
            at = ", ".join(f"{n}={int(x)}" for n, x in zip(split.index_names, idx))
            problems.append(f"{copy.name} thread {t} warp {warp} ({at}): {what} {int(got[what][d, i])}, split gives {int(w[d, i])}")
    return problems


def smem_copies(plan: KernelPlan) -> list[TiledCopy]:
    """Every shared-memory copy of the plan, in the emitter's order."""
    return [plan.g2s[o] for o in "QKV"] + [plan.s2r[o].copy for o in "QKV"] + [plan.r2s_O, plan.s2g_O]


def plan_splits(plan: KernelPlan) -> dict[str, OffsetSplit]:
    """Offset splits of every shared-memory copy of the plan, keyed by copy name (cached per config)."""
    return _splits_for(plan.cfg)


@functools.lru_cache(maxsize=64)
def _splits_for(cfg: KernelConfig) -> dict[str, OffsetSplit]:
    return {c.name: split_offsets(c) for c in smem_copies(make_plan(cfg))}
