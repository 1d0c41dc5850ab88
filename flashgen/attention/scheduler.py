"""Which CTA computes which output tile, in what order, on how big a grid: the tile scheduler.

A tile is ``B_r`` query rows of one head of one batch entry; a launch has
``tiles = ceil(seq_q / B_r) * heads * batch`` of them.

* **Order** (:meth:`TileScheduler.coords`): tile ``t`` is query block ``n_q - 1 - t % n_q`` (the
  last block first: with a causal mask its rows are the longest), then heads, then batch
  entries; query blocks vary fastest, so tiles running at the same time share K/V in L2.
* **Grid** (:meth:`TileScheduler.grid`): one CTA per tile, or (``persistent``) one per SM, at
  most one per tile. Persistent grids of unequal tiles (a mask) are rounded down to a multiple of
  ``half`` = half the query blocks of a head (all of them when odd), where that costs at most a
  tenth of the SMs, so that every odd round mirrors the even one before it and each CTA's two
  tiles of a round pair have complementary lengths. Then the wave-tail split (``tail``,
  :class:`flashgen.dsl.tail_split.TailSplit`) decides the parts of a partial last round; with
  fewer tiles than SMs the grid becomes ``tiles * parts`` CTAs.
* **Rounds** (:meth:`TileScheduler.work`): in round ``r`` CTA ``c`` takes tile ``r * ctas + slot``
  with ``slot = c`` in even rounds and ``ctas - 1 - c`` in odd ones (a "snake": a CTA given a long
  tile in one round gets a short one in the next, tiles shrinking along the order). In a partial
  last round that is split, CTA slot ``s`` takes part ``s % parts`` of tile ``first + s / parts``.

The same rule renders as C++ (:meth:`TileScheduler.to_cpp`: ``sched_coords``, ``sched_grid``,
``sched_work``, all callable on the host), which the emitted launcher and kernel call; tests
compile it for the host and compare it with these methods (tests/attention/test_scheduler.py).
"""
from __future__ import annotations

import attrs

from ..dsl.tail_split import TailSplit


@attrs.frozen
class TileScheduler:
    """The tile rule of one kernel: ``B_r`` query rows per tile; ``persistent``: about one CTA per SM
    looping over rounds (else one CTA per tile); ``masked``: tiles differ in length; ``tail``: the
    wave-tail split."""

    B_r: int
    persistent: bool
    masked: bool
    tail: TailSplit

    @property
    def kind(self) -> str:
        """``"static"`` (persistent rounds in a fixed order) or ``"grid"`` (one CTA per tile)."""
        return "static" if self.persistent else "grid"

    @property
    def rounds_pair(self) -> bool:
        """Whether the grid is sized so round pairs balance (persistent grids of unequal tiles)."""
        return self.persistent and self.masked

    # ---- the rule in Python (the simulator's and the tests') ----------------------------------

    def n_q_blocks(self, seq_q: int) -> int:
        return -(-seq_q // self.B_r)

    def coords(self, tile: int, n_q: int, heads: int) -> tuple[int, int, int]:
        """(query block, head, batch entry) of tile ``tile`` of a launch with ``n_q`` query blocks per head."""
        hb = tile // n_q
        return n_q - 1 - tile % n_q, hb % heads, hb // heads

    def grid(self, tiles: int, sms: int, lo: int, n_q: int, equal: bool) -> tuple[int, int]:
        """(CTAs, parts of a split tail tile) of a launch of ``tiles`` tiles on ``sms`` SMs; ``lo``: key
        blocks of the shortest tile, ``equal``: every tile has the same key blocks, ``n_q``: query blocks."""
        ctas = min(tiles, sms) if self.persistent else tiles
        if self.rounds_pair:
            half = n_q if n_q % 2 else n_q // 2
            if tiles > sms and not equal and sms // half * half >= sms - sms // 10:
                ctas = sms // half * half
        parts = self.tail.parts(tiles, sms, lo)
        if tiles < sms:
            ctas = tiles * parts
        return ctas, parts

    def work(self, cta: int, ctas: int, tiles: int, parts: int) -> list[tuple[int, int]]:
        """The (tile, part) CTA ``cta`` of ``ctas`` takes, round by round; part -1: the whole tile."""
        out = []
        r = 0
        while True:
            slot = ctas - 1 - cta if r & 1 else cta
            first = r * ctas
            if parts > 1 and first < tiles < first + ctas:
                if slot >= (tiles - first) * parts:
                    return out
                out.append((first + slot // parts, slot % parts))
            elif first + slot < tiles:
                out.append((first + slot, -1))
            else:
                return out
            r += 1

    # ---- the rule in C++ ----------------------------------------------------------------------

    def to_cpp(self) -> str:
        """``sched_coords`` (tile -> query block, head, batch), ``sched_grid`` (the launcher's: the launch's
        CTAs and parts; needs the tail rule's ``tail_parts``) and ``sched_work`` (round ``r`` of a CTA).
        ``B_r`` is the kernel's own constant: the functions take query blocks, not rows."""
        persistent = "true" if self.persistent else "false"
        pair = "true" if self.rounds_pair else "false"
        return f"""// tile scheduler (flashgen.attention.scheduler): tile order, grid size, persistent rounds
constexpr bool SCHED_PERSISTENT = {persistent};  // about one CTA per SM looping over rounds; else one CTA per tile
constexpr bool SCHED_ROUND_PAIRS = {pair};  // unequal tiles: size the grid so odd rounds mirror even ones
// tile -> (query block, head, batch): the last query block first, query blocks fastest, then heads, then batch
__host__ __device__ __forceinline__ void sched_coords(int tile, int n_q, int heads, int* q_block, int* head, int* batch) {{
    const int hb = tile / n_q;
    *q_block = n_q - 1 - tile % n_q;
    *head = hb % heads;
    *batch = hb / heads;
}}
// CTAs of a launch of `tiles` tiles on `sms` SMs and the parts of a split tail tile; lo: key blocks of the
// shortest tile, equal: every tile has the same key blocks, n_q: query blocks per head (the launcher's)
static inline void sched_grid(int64_t tiles, int sms, int lo, int n_q, bool equal, int* ctas, int* parts) {{
    *ctas = SCHED_PERSISTENT ? int(tiles < sms ? tiles : sms) : int(tiles);
    if (SCHED_ROUND_PAIRS) {{
        const int half = n_q % 2 ? n_q : n_q / 2;
        if (tiles > sms && !equal && sms / half * half >= sms - sms / 10) *ctas = sms / half * half;
    }}
    *parts = tail_parts(tiles, sms, lo);
    if (tiles < sms) *ctas = int(tiles) * *parts;
}}
// round r of CTA `cta` of `ctas`: its tile and part (-1: the whole tile); false once it has no work left.
// Odd rounds are mirrored ("snake"): a CTA given a long tile in one round gets a short one in the next.
__host__ __device__ __forceinline__ bool sched_work(int r, int cta, int ctas, int tiles, int parts, int* tile, int* part) {{
    const int slot = (r & 1) ? ctas - 1 - cta : cta;
    const int first = r * ctas;
    if (parts > 1 && first < tiles && first + ctas > tiles) {{  // the partial last round, split
        if (slot >= (tiles - first) * parts) return false;
        *tile = first + slot / parts;
        *part = slot % parts;
        return true;
    }}
    *tile = first + slot;
    *part = -1;
    return *tile < tiles;
}}"""
