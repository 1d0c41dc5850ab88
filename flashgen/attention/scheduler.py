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
* **Block-mask order** (``ordered``, :meth:`TileScheduler.order`): a persistent kernel with a mask_mod takes
  position ``r * ctas + slot`` of an order its block mask gives (made with the block mask, on the GPU). Its
  tiles differ by the blocks the mask keeps, unlike the built-in masks' in a pattern the round pairs could
  balance: per section of ``ORDER_ROUNDS`` rounds (a few rounds, so the tiles running at once still share K/V
  in L2) the tiles are ranked heaviest first and dealt round by round, each to the CTA with the least work so
  far. No round pairs then: the grid is one CTA per SM.

The same rule renders as C++ (:meth:`TileScheduler.to_cpp`: ``sched_coords``, ``sched_grid``,
``sched_work``, all callable on the host), which the emitted launcher and kernel call; tests
compile it for the host and compare it with these methods (tests/attention/test_scheduler.py).
"""
from __future__ import annotations

import attrs

from ..dsl.tail_split import TailSplit

#: Rounds per section of a block mask's order: its tiles are ranked heaviest first within it. Enough rounds to
#: deal each CTA long and short tiles; few enough that the tiles running at once are near each other in the
#: scheduler's order (its K/V in L2). The CPU model (benchmarks/tile_balance.py) puts 4 rounds within 5% of even
#: for the benchmark's masks (odd counts and 1 round: 7-14% off).
ORDER_ROUNDS = 4
#: The most CTAs (SMs) the block mask's order is made for: one thread of the CTA that makes it per CTA.
ORDER_MAX_CTAS = 1024


def orders_tiles(persistent: bool, mask_mod: bool) -> bool:
    """Whether a forward kernel takes its tiles in the order its block mask holds (:attr:`TileScheduler.ordered`):
    a persistent one with a mask_mod."""
    return persistent and mask_mod


@attrs.frozen
class TileScheduler:
    """The tile rule of one kernel: ``B_r`` query rows per tile; ``persistent``: about one CTA per SM
    looping over rounds (else one CTA per tile); ``masked``: tiles differ in length; ``tail``: the
    wave-tail split; ``ordered``: a launch with a block mask takes the tiles in the order it holds
    (:meth:`order`; persistent only)."""

    B_r: int
    persistent: bool
    masked: bool
    tail: TailSplit
    ordered: bool = attrs.field(default=False)

    @ordered.validator
    def _persistent_only(self, _, ordered):
        if ordered and not self.persistent:
            raise ValueError("a block-mask tile order is for persistent schedulers (a grid has no rounds to deal)")

    @property
    def kind(self) -> str:
        """``"static"`` (persistent rounds in a fixed order) or ``"grid"`` (one CTA per tile)."""
        return "static" if self.persistent else "grid"

    @property
    def rounds_pair(self) -> bool:
        """Whether the grid is sized so round pairs balance (persistent grids of unequal tiles; not a launch
        that takes a block mask's order: that is balanced already)."""
        return self.persistent and self.masked

    # ---- the rule in Python (the simulator's and the tests') ----------------------------------

    def n_q_blocks(self, seq_q: int) -> int:
        return -(-seq_q // self.B_r)

    def coords(self, tile: int, n_q: int, heads: int) -> tuple[int, int, int]:
        """(query block, head, batch entry) of tile ``tile`` of a launch with ``n_q`` query blocks per head."""
        hb = tile // n_q
        return n_q - 1 - tile % n_q, hb % heads, hb // heads

    def grid(self, tiles: int, sms: int, lo: int, n_q: int, equal: bool, ordered: bool = False) -> tuple[int, int]:
        """(CTAs, parts of a split tail tile) of a launch of ``tiles`` tiles on ``sms`` SMs; ``lo``: key
        blocks of the shortest tile, ``equal``: every tile has the same key blocks, ``n_q``: query blocks,
        ``ordered``: the launch has a block mask (and so, if this scheduler is ``ordered``, its order)."""
        ctas = min(tiles, sms) if self.persistent else tiles
        if self.rounds_pair and not (ordered and self.ordered):
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

    def order(self, work, ctas: int) -> list[int]:
        """The block mask's order of a launch of ``len(work)`` tiles on ``ctas`` CTAs (``work[t]``: tile ``t``'s
        cost): position ``r * ctas + slot`` (round ``r``, :meth:`work`'s slot) -> the tile taken there. Per
        section of ``ORDER_ROUNDS`` rounds, the tiles heaviest first (ties in the scheduler's order). A partial
        last round takes the lightest, in rank order, and counts to the CTAs whose slots take them; then each full
        round's go to the CTAs least loaded so far, the heaviest to the least (ties: the lower CTA)."""
        tiles, per = len(work), ORDER_ROUNDS * ctas
        out, load = list(range(tiles)), [0] * ctas
        slot = lambda r, c: ctas - 1 - c if r & 1 else c  # its own inverse
        for s0 in range(0, tiles, per):
            ranked = sorted(range(s0, min(tiles, s0 + per)), key=lambda t: (-work[t], t))
            full = len(ranked) // ctas * ctas
            for k, t in enumerate(ranked[full:]):
                out[s0 + full + k] = t
                load[slot((s0 + full) // ctas, k)] += work[t]
            for c0 in range(0, full, ctas):
                r = (s0 + c0) // ctas
                for k, c in enumerate(sorted(range(ctas), key=lambda c: (load[c], c))):
                    load[c] += work[ranked[c0 + k]]
                    out[s0 + c0 + slot(r, c)] = ranked[c0 + k]
        return out

    # ---- the rule in C++ ----------------------------------------------------------------------

    def to_cpp(self) -> str:
        """``sched_coords`` (tile -> query block, head, batch), ``sched_grid`` (the launcher's: the launch's
        CTAs and parts; needs the tail rule's ``tail_parts``) and ``sched_work`` (round ``r`` of a CTA).
        ``B_r`` is the kernel's own constant: the functions take query blocks, not rows."""
        persistent = "true" if self.persistent else "false"
        pair = "true" if self.rounds_pair else "false"
        ordered = "true" if self.ordered else "false"
        return f"""// tile scheduler (flashgen.attention.scheduler): tile order, grid size, persistent rounds
constexpr bool SCHED_PERSISTENT = {persistent};  // about one CTA per SM looping over rounds; else one CTA per tile
constexpr bool SCHED_ROUND_PAIRS = {pair};  // unequal tiles: size the grid so odd rounds mirror even ones
constexpr bool SCHED_ORDERED = {ordered};  // a launch with a block mask takes the tiles in its order (no round pairs)
// tile -> (query block, head, batch): the last query block first, query blocks fastest, then heads, then batch
__host__ __device__ __forceinline__ void sched_coords(int tile, int n_q, int heads, int* q_block, int* head, int* batch) {{
    const int hb = tile / n_q;
    *q_block = n_q - 1 - tile % n_q;
    *head = hb % heads;
    *batch = hb / heads;
}}
// CTAs of a launch of `tiles` tiles on `sms` SMs and the parts of a split tail tile; lo: key blocks of the
// shortest tile, equal: every tile has the same key blocks, n_q: query blocks per head, ordered: the launch has
// a block mask (the launcher's)
static inline void sched_grid(int64_t tiles, int sms, int lo, int n_q, bool equal, bool ordered, int* ctas, int* parts) {{
    *ctas = SCHED_PERSISTENT ? int(tiles < sms ? tiles : sms) : int(tiles);
    if (SCHED_ROUND_PAIRS && !(ordered && SCHED_ORDERED)) {{
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
}}""" + (_ORDER_CPP if self.ordered else "")


#: The block mask's order in C++ (TileScheduler.order), run by the one CTA that makes it; ``sched_sync`` a barrier of
#: that CTA (nothing on the host, where one thread runs it all: the tests').
_ORDER_CPP = f"""
constexpr int SCHED_ORDER_ROUNDS = {ORDER_ROUNDS}, SCHED_ORDER_MAX_CTAS = {ORDER_MAX_CTAS};
__host__ __device__ __forceinline__ void sched_sync() {{
#ifdef __CUDA_ARCH__
    __syncthreads();
#endif
}}
// The tile order of a launch of `tiles` tiles on `ctas` CTAs: order[r * ctas + slot] (round r, sched_work's slot) = the
// tile taken there; work(t): tile t's cost. Per section of SCHED_ORDER_ROUNDS rounds its tiles heaviest first: a partial
// last round's the lightest (counted to the CTAs that take them), each full round's dealt to the CTAs least loaded so
// far (the heaviest to the least).
// Run by threads tid of nthreads of one CTA; scratch: w and ranked SCHED_ORDER_ROUNDS * ctas ints, load and turn ctas.
template <class Work>
__host__ __device__ void sched_order(int tiles, int ctas, int tid, int nthreads, const Work& work, int* w, int* ranked,
                                     int* load, int* turn, int* order) {{
    const int per = SCHED_ORDER_ROUNDS * ctas;
    for (int c = tid; c < ctas; c += nthreads) load[c] = 0;
    for (int s0 = 0; s0 < tiles; s0 += per) {{
        const int n = tiles - s0 < per ? tiles - s0 : per;
        for (int i = tid; i < n; i += nthreads) w[i] = work(s0 + i);
        sched_sync();
        for (int i = tid; i < n; i += nthreads) {{  // the section's rank of tile s0 + i: heaviest first, ties in order
            int k = 0;
            for (int j = 0; j < n; ++j) k += w[j] > w[i] || (w[j] == w[i] && j < i);
            ranked[k] = i;
        }}
        sched_sync();
        const int full = n / ctas * ctas, r_last = (s0 + full) / ctas;
        for (int k = tid; k < n - full; k += nthreads) {{  // a partial last round: the lightest, counted to their CTAs
            const int i = ranked[full + k];
            order[s0 + full + k] = s0 + i;
            load[(r_last & 1) ? ctas - 1 - k : k] += w[i];
        }}
        sched_sync();
        for (int c0 = 0; c0 < full; c0 += ctas) {{
            const int r = (s0 + c0) / ctas;
            for (int c = tid; c < ctas; c += nthreads) {{  // CTA c's turn: its rank by work so far, least first
                int k = 0;
                for (int j = 0; j < ctas; ++j) k += load[j] < load[c] || (load[j] == load[c] && j < c);
                turn[c] = k;
            }}
            sched_sync();
            for (int c = tid; c < ctas; c += nthreads) {{
                const int i = ranked[c0 + turn[c]];
                load[c] += w[i];
                order[s0 + c0 + ((r & 1) ? ctas - 1 - c : c)] = s0 + i;
            }}
            sched_sync();
        }}
    }}
}}"""
