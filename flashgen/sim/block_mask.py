"""A mask_mod's block mask in numpy: what the emitted ``<name>_mask_blocks`` kernels make on the GPU.

Shape and meaning are :meth:`flashgen.mods.KernelMods.block_mask_shape`'s: per (batch, head, query
block) of the mask, ``[lo, hi)`` the key blocks holding a kept score (``[0, 0)`` when none does),
then one class per key block: 0 empty, 1 partial, 2 full, over the scores with ``i < seq_q`` and
``j < seq_k`` (the key tail is the kernels' own rule). Batch and head extents are 1 where the
mask_mod ignores them. :func:`row` picks a tile's row as ``block_mask_row`` does, :func:`clip`
narrows a tile's key blocks as ``block_mask_clip`` does, :func:`walk` lists the blocks a tile visits
(``block_mask_next`` steps over the empty ones); the simulators use them all. :func:`tile_order` is the
tile order a persistent forward's block mask holds after its rows (``mask_order_kernel``).

The backward's block mask (``transposed=True``, made by a backward kernel's ``<name>_mask_blocks`` with its own
B_r and B_c) holds the same classes per (key block, query block), a row per key block: ``[lo, hi)`` the query
blocks holding a kept score, then a class per query block. :class:`BackwardView` reads it as the backward kernels
do (``bwd_block_mask_clip``, ``bwd_block_mask_partial``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

if TYPE_CHECKING:
    from ..attention.scheduler import TileScheduler
    from ..attention.score_mask import ScoreMask

EMPTY, PARTIAL, FULL = 0, 1, 2


def block_mask(score_mask: "ScoreMask", mask_values: Any, batch: int, heads: int, seq_q: int, seq_k: int,
               transposed: bool = False) -> np.ndarray:
    """The int32 block mask of a call: ``score_mask``'s mask_mod evaluated (``mask_values``: its
    :meth:`~flashgen.mods.ModArgs.values`) at every score of every block; ``transposed``: a backward kernel's
    (a row per key block, a class per query block)."""
    mods = score_mask.mods
    if mods is None or mods.mask is None:
        raise ValueError("a block mask needs a plan built with a mask_mod")
    if min(batch, heads, seq_q, seq_k) <= 0:
        raise ValueError(f"block mask of batch={batch}, heads={heads}, seq_q={seq_q}, seq_k={seq_k}: sizes must be positive")
    B_r, B_c = score_mask.B_r, score_mask.B_c
    shape = mods.block_mask_shape(batch, heads, seq_q, seq_k, B_r, B_c)
    n_qb, n_kb = shape[2], shape[3] - 2
    out = np.zeros(shape, np.int32)
    classes = np.zeros(shape[:2] + (n_qb, n_kb), np.int32)
    i = np.arange(seq_q, dtype=np.int32)[:, None]
    j = np.arange(seq_k, dtype=np.int32)[None, :]
    for b in range(shape[0]):
        for h in range(shape[1]):
            keep = np.broadcast_to(mods.mask.evaluate(b, h, i, j, args=mask_values), (seq_q, seq_k)).astype(bool)
            # scores past the sequences count for neither class: False for "any", True for "all"
            some = np.zeros((n_qb * B_r, n_kb * B_c), bool)
            every = np.ones_like(some)
            some[:seq_q, :seq_k] = every[:seq_q, :seq_k] = keep
            some = some.reshape(n_qb, B_r, n_kb, B_c).any(axis=(1, 3))
            every = every.reshape(n_qb, B_r, n_kb, B_c).all(axis=(1, 3))
            classes[b, h] = np.where(some, np.where(every, FULL, PARTIAL), EMPTY)
    if transposed:
        classes = classes.swapaxes(2, 3)
        out = np.zeros(mods.block_mask_shape(batch, heads, seq_q, seq_k, B_r, B_c, transposed=True), np.int32)
    out[..., 2:] = classes
    for b, h, r in np.ndindex(*classes.shape[:3]):
        nonempty = np.flatnonzero(classes[b, h, r])
        out[b, h, r, :2] = (nonempty[0], nonempty[-1] + 1) if nonempty.size else (0, 0)
    return out


def row(score_mask: "ScoreMask", mask: "np.ndarray | None", b: int, h: int, q_block: int) -> "np.ndarray | None":
    """The row of query block ``q_block`` of batch ``b``, query head ``h`` (None without a block mask)."""
    if mask is None:
        return None
    mods = score_mask.mods
    return mask[b if mods.uses("b") else 0, h if mods.uses("h") else 0, q_block]


def clip(r: "np.ndarray | None", begin: int, end: int) -> tuple[int, int]:
    """Key blocks ``[begin, end)`` narrowed to the row's ``[lo, hi)``, then to its first and last
    non-empty block (never reversed), as ``block_mask_clip``."""
    if r is None:
        return begin, end
    begin, end = max(begin, int(r[0])), min(end, int(r[1]))
    end = max(begin, end)
    while begin < end and r[2 + begin] == EMPTY:
        begin += 1
    while end > begin and r[2 + end - 1] == EMPTY:
        end -= 1
    return begin, end


def next_block(r: "np.ndarray | None", j: int, end: int) -> int:
    """The key block walked after block ``j`` of ``[begin, end)``: the next one the row does not call
    empty, else ``end`` (``j + 1`` without a block mask), as ``block_mask_next``."""
    if r is None:
        return j + 1
    j += 1
    while j < end and r[2 + j] == EMPTY:
        j += 1
    return j


def walk(r: "np.ndarray | None", begin: int, end: int) -> list[int]:
    """The key blocks a tile visits, in order, from ``[begin, end)``: :func:`clip`, then :func:`next_block`
    from the first (both engines' loops; the simulators evaluate their steps at the position in this list,
    so a guard such as "a next block exists" or a step on "block j + 1" means the list's next entry)."""
    begin, end = clip(r, begin, end)
    out = []
    j = begin
    while j < end:
        out.append(j)
        j = next_block(r, j, end)
    return out


def tile_costs(scheduler: "TileScheduler", score_mask: "ScoreMask", mask: np.ndarray, batch: int, heads: int,
               seq_q: int, seq_k: int, offset: int = 0, left: int = -1, right: int = -1, partial: "float | None" = None) -> list:
    """Each tile's cost in the tile order (``mask_order_kernel``'s): per key block of its row's ``[lo, hi)`` within the
    built-in mask's range (:func:`clip` of :meth:`~flashgen.attention.score_mask.ScoreMask.block_range` with the call's diagonal
    ``offset`` and window), 1 if full and ``partial`` if partial (the kernels' integer
    :data:`~flashgen.attention.block_mask_cpp.PARTIAL_BLOCK_COST` unless given); tiles in the scheduler's order
    (:meth:`~flashgen.attention.scheduler.TileScheduler.coords`)."""
    from ..attention.block_mask_cpp import PARTIAL_BLOCK_COST

    weight = PARTIAL_BLOCK_COST if partial is None else partial
    n_q = scheduler.n_q_blocks(seq_q)
    spans = [score_mask.block_range(qb * scheduler.B_r, seq_q, seq_k, offset, left, right) for qb in range(n_q)]
    out = []
    for t in range(n_q * heads * batch):
        qb, h, b = scheduler.coords(t, n_q, heads)
        r = row(score_mask, mask, b, h, qb)
        begin, end = clip(r, *spans[qb])  # the key blocks the tile walks
        kept = r[2 + begin:2 + end]
        cost = np.sum(kept == FULL) + weight * np.sum(kept == PARTIAL)
        out.append(int(cost) if partial is None else float(cost))
    return out


def tile_order(scheduler: "TileScheduler", score_mask: "ScoreMask", mask: np.ndarray, batch: int, heads: int,
               seq_q: int, seq_k: int, ctas: int, offset: int = 0, left: int = -1, right: int = -1) -> list[int]:
    """The tile order after a forward block mask's rows (``mask`` as :func:`block_mask` makes it) for a launch on
    ``ctas`` CTAs: :meth:`~flashgen.attention.scheduler.TileScheduler.order` of :func:`tile_costs`."""
    return scheduler.order(tile_costs(scheduler, score_mask, mask, batch, heads, seq_q, seq_k, offset, left, right), ctas)


@attrs.frozen
class BackwardView:
    """The backward's block mask ``mask`` (:func:`block_mask` ``transposed``) as one backward CTA reads it: batch
    ``b``, the query heads ``heads`` of its kv head's group; None: every block partial, none skipped."""

    score_mask: "ScoreMask"
    mask: "np.ndarray | None" = attrs.field(eq=False)
    b: int
    heads: tuple

    def _row(self, h: int, kb: int) -> "np.ndarray":
        mods = self.score_mask.mods
        return self.mask[self.b if mods.uses("b") else 0, h if mods.uses("h") else 0, kb]

    def clip(self, kb: int, begin: int, end: int, deterministic: bool) -> tuple[int, int]:
        """Query blocks ``[begin, end)`` of key block ``kb`` narrowed to the union over the group's heads of the
        rows' ``[lo, hi)`` (never reversed; empty where no row keeps a score), as ``bwd_block_mask_clip``; the
        deterministic variant walks them unclipped."""
        if self.mask is None or deterministic:
            return begin, end
        rows = [self._row(h, kb) for h in (self.heads if self.score_mask.mods.uses("h") else self.heads[:1])]
        kept = [(int(r[0]), int(r[1])) for r in rows if r[1] > r[0]]
        if not kept:
            return begin, begin
        begin, end = max(begin, min(lo for lo, _ in kept)), min(end, max(hi for _, hi in kept))
        return begin, max(begin, end)

    def masked(self, g: int, kb: int, qb: int, needs: bool) -> bool:
        """Whether work item (the group's ``g``-th query head, query block ``qb``) takes the masked path: the
        built-in rule ``needs`` it, or the block mask does not call the block full (as ``bwd_block_mask_partial``)."""
        return needs or self.mask is None or int(self._row(self.heads[g], kb)[2 + qb]) != FULL
