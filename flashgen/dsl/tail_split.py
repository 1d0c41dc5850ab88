"""Splitting the last round of a persistent kernel: the wave tail's tiles shared by idle CTAs.

A persistent grid of one CTA per SM takes ``tiles`` tiles in rounds; when ``tiles % SMs`` is a
small ``tail`` the last round keeps ``tail`` CTAs busy for a whole tile while the rest idle
(seq 2048, batch 16, 16 heads, B_r 128 on 132 SMs: 4 tiles, 3% of the run; 133 tiles: half).
Fewer tiles than SMs are one partial round: all of them are the tail, and the grid grows to
``tiles * parts`` CTAs (long keys, few query rows). With a split, each
tail tile's key blocks are cut into ``parts`` contiguous ranges, one per CTA. Each part's
consumer warps publish their unnormalised O accumulators and per-thread row max / row sums
(fragment order, so both the writes and the reads are coalesced) and count themselves in per
row block of 16 rows (one warp's rows); the warp that counts last merges every part's
partials into its registers (rescaled to the common max) and writes the finished rows.

Masked kernels and kernels of one CTA per tile (``full_rounds`` False) split only launches of
fewer tiles than SMs: masked full rounds are already paired long with short tiles (and their
tiles differ in length, so the caller passes the shortest tile's key blocks and every part
still gets ``min_blocks``); a grid of one CTA per tile has no rounds of its own to fill.

This object is the one rule: :meth:`parts`, :meth:`ranges` and :meth:`layout` in Python (the
simulator splits tiles with :meth:`ranges`), and the same three as C++ for the emitted launcher
and kernel (:meth:`to_cpp`: ``tail_parts``, ``tail_range``, the workspace sizes and indices),
checked against each other by compiling the C++ on the host (tests/dsl/test_tail_split.py).
"""
from __future__ import annotations

import attrs

# the merge works per warp (its 16 rows of the wgmma accumulator)
from .config import WARPS_PER_WG

LANES = 32
#: the counters sit first in the workspace (the part the caller zeroes), padded to this
COUNTER_ALIGN = 256


@attrs.frozen
class TailSplit:
    """Split rule for a persistent plan with ``consumers`` warpgroups and ``d_head`` columns."""

    max_parts: int
    min_blocks: int  # key blocks each part gets at least
    consumers: int
    d_head: int
    #: also split the partial last round after full rounds (persistent, equal tiles); False: only
    #: launches of fewer tiles than SMs (masked kernels and kernels of one CTA per tile)
    full_rounds: bool = True

    def __attrs_post_init__(self) -> None:
        for name, least in (("max_parts", 2), ("min_blocks", 1), ("consumers", 1), ("d_head", 2)):
            if getattr(self, name) < least:
                raise ValueError(f"TailSplit: {name} must be at least {least}, got {getattr(self, name)}")
        if self.d_head % 2:
            raise ValueError(f"TailSplit: d_head must be even (two accumulator values per column pair), got {self.d_head}")

    @property
    def warps(self) -> int:
        """Counters per tail tile: one per consumer warp (16 rows each)."""
        return self.consumers * WARPS_PER_WG

    @staticmethod
    def tail(tiles: int, sms: int) -> int:
        """Tiles of the partial last round: ``tiles % sms``, all of them when fewer than SMs."""
        return tiles if tiles < sms else tiles % sms

    def parts(self, tiles: int, sms: int, n_kv: int) -> int:
        """Parts per tail tile (1: no split): as many as the SMs left idle allow, each part at
        least ``min_blocks`` key blocks (``n_kv``: the shortest tile's), at most ``max_parts``;
        only when a last round is partial (and, without ``full_rounds``, the only round)."""
        tail = self.tail(tiles, sms) if sms > 0 and tiles > 0 else 0
        if tail == 0 or (not self.full_rounds and tiles >= sms):
            return 1
        parts = min(sms // tail, n_kv // self.min_blocks, self.max_parts)
        return parts if parts >= 2 else 1

    @staticmethod
    def ranges(j_begin: int, j_end: int, parts: int) -> list[tuple[int, int]]:
        """The key-block ranges of the parts of a tile whose blocks are ``[j_begin, j_end)``."""
        n = j_end - j_begin
        return [(j_begin + n * k // parts, j_begin + n * (k + 1) // parts) for k in range(parts)]

    def layout(self, tail: int, parts: int) -> dict[str, tuple[int, int]]:
        """Byte ``(offset, size)`` of the workspace's arrays: ``count`` (int32 per tail tile and
        warp; must be zero at launch), ``ml`` (fp32 [unit][warp][max h0, max h1, sum h0, sum h1][lane])
        and ``o`` (fp32 [unit][warp][d_head / 2 values][lane]); unit = tail tile * parts + part."""
        units = tail * parts
        count = tail * self.warps * 4
        count_padded = -(-count // COUNTER_ALIGN) * COUNTER_ALIGN
        ml = units * self.warps * 4 * LANES * 4
        o = units * self.warps * (self.d_head // 2) * LANES * 4
        return {"count": (0, count), "ml": (count_padded, ml), "o": (count_padded + ml, o)}

    def to_cpp(self) -> str:
        """The same rule in C++: ``tail_parts`` (launcher), ``tail_range`` (kernel: a part's key blocks),
        the workspace's sizes (launcher) and element indices (kernel), per :meth:`layout`."""
        w, half = self.warps, self.d_head // 2
        return f"""// wave tail (flashgen.dsl.tail_split): parts per tile of a partial last round, 1 = no split
constexpr int TAIL_MAX_PARTS = {self.max_parts}, TAIL_MIN_BLOCKS = {self.min_blocks}, TAIL_WARPS = {w};
constexpr bool TAIL_FULL_ROUNDS = {"true" if self.full_rounds else "false"};  // false: only fewer tiles than SMs split
// n_kv: key blocks of the shortest tile
static int tail_parts(int64_t tiles, int sms, int n_kv) {{
    const int tail = sms <= 0 || tiles <= 0 ? 0 : tiles < sms ? int(tiles) : int(tiles % sms);
    if (tail == 0 || (!TAIL_FULL_ROUNDS && tiles >= sms)) return 1;
    int parts = sms / tail;
    parts = parts < n_kv / TAIL_MIN_BLOCKS ? parts : n_kv / TAIL_MIN_BLOCKS;
    parts = parts < TAIL_MAX_PARTS ? parts : TAIL_MAX_PARTS;
    return parts >= 2 ? parts : 1;
}}
// workspace bytes: counters (zeroed by the caller), then per unit and warp the row statistics and O
static size_t tail_count_bytes(int tail) {{ return (size_t(tail) * TAIL_WARPS * 4 + {COUNTER_ALIGN - 1}) / {COUNTER_ALIGN} * {COUNTER_ALIGN}; }}
static size_t tail_ml_bytes(int units) {{ return size_t(units) * TAIL_WARPS * 4 * {LANES} * 4; }}
static size_t tail_o_bytes(int units) {{ return size_t(units) * TAIL_WARPS * {half} * {LANES} * 4; }}
// part `part` of `parts` of a tile's key blocks [j_begin, j_end): [*jb, *je)
__host__ __device__ __forceinline__ void tail_range(int j_begin, int j_end, int part, int parts, int* jb, int* je) {{
    const int n = j_end - j_begin;
    *jb = j_begin + n * part / parts;
    *je = j_begin + n * (part + 1) / parts;
}}
// element offsets of (tail tile, warp)'s counter, and of (unit, warp)'s row statistics and O partials (lane 0)
__host__ __device__ __forceinline__ size_t tail_count_at(int tail_tile, uint32_t warp) {{ return size_t(tail_tile) * TAIL_WARPS + warp; }}
__host__ __device__ __forceinline__ size_t tail_ml_at(int unit, uint32_t warp) {{ return (size_t(unit) * TAIL_WARPS + warp) * 4 * {LANES}; }}
__host__ __device__ __forceinline__ size_t tail_o_at(int unit, uint32_t warp) {{ return (size_t(unit) * TAIL_WARPS + warp) * {half} * {LANES}; }}"""
