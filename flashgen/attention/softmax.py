"""The online softmax: one key block's row max, exponentials, row sums and rescale factor.

Fragment contract (both engines; proven on each plan's accumulator maps by
:mod:`flashgen.sim.verify`): a thread's S (and O) fragment is ``chunks`` chunks of 8 columns x
2 rows, flat value ``4 c + 2 h + e`` being row half ``h``, column ``8 c + e`` of chunk ``c`` (from
the thread's first column). The other columns of a row sit in the lanes ``lane ^ m`` for the masks
``lanes`` (the plan's ``row_reduce_lanes``).

Per key block and row half (:meth:`OnlineSoftmax.update`; ``k`` is the exponent's scale)::

    m_new = fmax(row_max, row_max_of(s))            # max in raw S units (exp2), scaled (expf)
    neg_m = m_new == -inf ? 0 : -m_new * k          # exp2; expf: -m_new. A row masked so far: p = 0
    corr  = ex2(fma(row_max, k, neg_m))             # expf: expf(row_max + neg_m)
    p     = ex2(fma(s, k, neg_m))                   # expf: expf(fma(s, k, neg_m)); in place of s
    row_sum = first ? sum(p) : fma(row_sum, corr, sum(p))
    O's row half *= corr                            # by the caller (the engines place it differently)

``exp2`` (the ``optimized_softmax`` knob) folds ``scale * log2(e)`` into one FMA before ``ex2`` and
lets a row's first block skip the rescale (``first``, for a caller that knows it at compile time:
the sum starts afresh, and the caller leaves O alone). On a fresh row (max -inf, sum 0, O 0) the
rescale is exact anyway (``corr`` is 0 and scales zeros), so a caller that knows the first block
only at run time passes ``first = false`` and skips just O's multiplies. Without ``exp2`` the max
is kept in scaled units, ``k = scale`` and every block rescales.

**Reduction order** (the one order of every max and sum here): over a thread's values of a row a
balanced tree in column order, split at the middle (:func:`balanced`; ``log2`` dependent steps,
the critical path of the softmax), then across the row's lanes a butterfly, one ``shfl.xor`` per
mask of ``lanes`` in order. Row sums stay per thread until the epilogue joins the lanes
(:mod:`flashgen.attention.epilogue`).

:meth:`OnlineSoftmax.to_cpp` renders the rule as small ``__device__`` functions; the numpy
evaluators (same names, vectorised: fragments ``[..., threads, values]``, per-thread scalars
``[..., threads]``, fp32 with the instruction semantics of :mod:`flashgen.sim.hardware`) compute
what they compute; tests/attention compiles the C++ for the host and compares the two.
"""
from __future__ import annotations

from typing import Callable, Sequence, TypeVar

import attrs
import numpy as np

T = TypeVar("T")

#: values of one chunk: 2 row halves x 2 neighbouring columns
CHUNK_VALUES = 4
FULL_MASK = "0xffffffffu"


def balanced(items: Sequence[T], combine: Callable[[T, T], T]) -> T:
    """The reduction order: ``combine`` over ``items`` as a balanced tree, split at the middle."""
    if len(items) == 1:
        return items[0]
    mid = len(items) // 2
    return combine(balanced(items[:mid], combine), balanced(items[mid:], combine))


def row_values(chunks: int, h: int) -> list[int]:
    """Flat indices of row half ``h``'s values in a fragment of ``chunks`` chunks, in column order."""
    return [CHUNK_VALUES * c + 2 * h + e for c in range(chunks) for e in range(2)]


def butterfly(x: np.ndarray, lanes: Sequence[int], op: Callable) -> np.ndarray:
    """``x = op(x, __shfl_xor_sync(x, m))`` for each mask in order; threads on the last axis."""
    t = np.arange(x.shape[-1])
    with np.errstate(over="ignore", invalid="ignore"):
        for m in lanes:
            x = op(x, x[..., t ^ m]).astype(np.float32)
    return x


def butterfly_cpp(var: str, lanes: Sequence[int], op: Callable[[str, str], str]) -> list[str]:
    """:func:`butterfly` in C++: one statement per mask."""
    return [f"{var} = {op(var, f'__shfl_xor_sync({FULL_MASK}, {var}, {m})')};" for m in lanes]


def scale_row(o: np.ndarray, h: int, f: np.ndarray) -> np.ndarray:
    """Row half ``h`` of fragments ``o [..., threads, values]`` times ``f [..., threads]`` (a copy)."""
    out = np.array(o, dtype=np.float32)
    idx = row_values(out.shape[-1] // CHUNK_VALUES, h)
    with np.errstate(over="ignore", invalid="ignore"):  # IEEE results, as the GPU's
        out[..., idx] = (out[..., idx] * np.asarray(f, np.float32)[..., None]).astype(np.float32)
    return out


SCALE_ROW_CPP = """// row half h of a fragment (value 4 c + 2 h + e) times f: O's rescale and its normalisation by 1/l
template <uint32_t N>
__device__ __forceinline__ void scale_row(float (&o)[N], uint32_t h, float f) {
    #pragma unroll
    for (uint32_t c = 0; c < N / 4; ++c) { o[4 * c + 2 * h] *= f; o[4 * c + 2 * h + 1] *= f; }
}"""

#: For fragments declared ``[chunks][4]`` (the mma.sync accumulators): the flat view the rule indexes.
FLAT_CPP = """// a [chunks][4] fragment seen as the flat values 4 c + 2 h + e of the softmax's functions
template <uint32_t R>
__device__ __forceinline__ float (&flat(float (&a)[R][4]))[4 * R] { return reinterpret_cast<float (&)[4 * R]>(a); }"""


def hw_model():
    # imported on use: the hardware model loads numba, which emitting (the renderers) never needs
    from flashgen.sim import hardware

    return hardware


def _fmax_cpp(a: str, b: str) -> str:
    return f"fmaxf({a}, {b})"


def _add_cpp(a: str, b: str) -> str:
    return f"({a} + {b})"


@attrs.frozen
class OnlineSoftmax:
    """The online softmax of fragments of ``chunks`` chunks whose rows span the lanes ``lane ^ m``."""

    chunks: int
    lanes: tuple[int, ...]
    #: ``optimized_softmax``: max in raw S units, ex2 of one FMA, first block not rescaled
    exp2: bool = True

    def __attrs_post_init__(self) -> None:
        if self.chunks < 1:
            raise ValueError(f"OnlineSoftmax: chunks must be at least 1, got {self.chunks}")
        if any(m not in (1, 2, 4, 8, 16) for m in self.lanes) or len(set(self.lanes)) != len(self.lanes):
            raise ValueError(f"OnlineSoftmax: lanes must be distinct single-bit xor masks below 32, got {self.lanes}")

    @property
    def values(self) -> int:
        return CHUNK_VALUES * self.chunks

    @property
    def skip_first(self) -> bool:
        """Whether the first key block of a row skips the rescale (a fresh row has nothing to rescale)."""
        return self.exp2

    # ---- numpy evaluators: fragments [..., threads, values], per-thread scalars [..., threads] --------

    def thread_max(self, s: np.ndarray, h: int) -> np.ndarray:
        """``fmaxf`` over this thread's values of row half ``h`` (NaN ignored, as ``fmaxf``)."""
        s = np.asarray(s, np.float32)
        return balanced([s[..., i] for i in row_values(self.chunks, h)], np.fmax)

    def row_max(self, s: np.ndarray, h: int) -> np.ndarray:
        """The row's max: :meth:`thread_max`, then across the row's lanes."""
        return butterfly(self.thread_max(s, h), self.lanes, np.fmax)

    def thread_sum(self, p: np.ndarray, h: int) -> np.ndarray:
        """This thread's share of row half ``h``'s sum (fp32 adds in the tree order)."""
        p = np.asarray(p, np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            return balanced([p[..., i] for i in row_values(self.chunks, h)], lambda a, b: (a + b).astype(np.float32))

    def neg_max(self, m: np.ndarray, k: float) -> np.ndarray:
        """The exponent's offset for max ``m``: ``-m * k`` (exp2) or ``-m`` (expf); 0 where ``m`` is -inf."""
        m = np.asarray(m, np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            neg = -m * np.float32(k) if self.exp2 else -m
        return np.where(m == -np.inf, np.float32(0), neg).astype(np.float32)

    def exp(self, x: np.ndarray, k: float, neg_m: np.ndarray) -> np.ndarray:
        """``ex2(fma(x, k, neg_m))`` (exp2) or ``expf(fma(x, k, neg_m))``."""
        hw = hw_model()
        with np.errstate(over="ignore", invalid="ignore"):
            arg = hw.fma32(x, np.float32(k), neg_m)
        return hw.ex2_approx_ftz(arg) if self.exp2 else hw.expf(arg)

    def rescale_factor(self, m_old: np.ndarray, k: float, neg_m: np.ndarray) -> np.ndarray:
        """What a row's sum and O are multiplied by when its max moves from ``m_old`` to the one of ``neg_m``."""
        if self.exp2:
            return self.exp(m_old, k, neg_m)
        with np.errstate(over="ignore", invalid="ignore"):
            return hw_model().expf((np.asarray(m_old, np.float32) + neg_m).astype(np.float32))

    def max_step(self, s: np.ndarray, h: int, row_max: np.ndarray, k: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The first half of a block's update: ``(row_max, neg_m, corr)``, the new max, its exponent
        offset and the factor the row's sum and O take."""
        f32 = np.float32
        row_max = np.asarray(row_max, f32)
        mx = self.row_max(s, h)
        with np.errstate(over="ignore", invalid="ignore"):
            m_new = np.fmax(row_max, mx if self.exp2 else (mx * f32(k)).astype(f32))
        neg_m = self.neg_max(m_new, k)
        return m_new.astype(f32), neg_m, self.rescale_factor(row_max, k, neg_m).astype(f32)

    def exp_step(self, s: np.ndarray, h: int, row_sum: np.ndarray, k: float, neg_m: np.ndarray, corr: np.ndarray,
                 first: bool) -> tuple[np.ndarray, np.ndarray]:
        """The second half: ``(s with P in row half h, row_sum)``; the sum starts afresh on a first block."""
        out = np.array(s, dtype=np.float32)
        idx = row_values(self.chunks, h)
        out[..., idx] = self.exp(out[..., idx], k, neg_m[..., None])
        total = self.thread_sum(out, h)
        with np.errstate(over="ignore", invalid="ignore"):
            row_sum = total if first and self.skip_first else hw_model().fma32(row_sum, corr, total)
        return out, row_sum.astype(np.float32)

    def update(self, s: np.ndarray, h: int, row_max: np.ndarray, row_sum: np.ndarray, k: float,
               first: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """One key block of row half ``h``, :meth:`max_step` then :meth:`exp_step`:
        ``(s with P in row half h, row_max, row_sum, corr)``."""
        row_max, neg_m, corr = self.max_step(s, h, row_max, k)
        p, row_sum = self.exp_step(s, h, row_sum, k, neg_m, corr, first)
        return p, row_max, row_sum, corr

    # ---- C++ ------------------------------------------------------------------------------------

    def _variant(self) -> dict[str, str]:
        """The C++ pieces that differ between the exp2 and the expf rule."""
        if self.exp2:
            return dict(units="raw S units; k = scale * log2(e), p = 2^(s k - m k): one FMA + ex2",
                        neg="return m == -INFINITY ? 0.f : -m * k;", factor="ex2_approx(fmaf(m_old, k, neg_m))",
                        exp="ex2_approx(fmaf({x}, k, neg_m))", m_new="fmaxf(row_max, softmax_row_max(s, h))",
                        total="first ? sum : fmaf(row_sum, corr, sum)",
                        first="; `first`: the row's first key block (its sum starts afresh; the caller skips O's rescale)")
        return dict(units="scaled units; k = scale, p = expf(s k - m)",
                    neg="(void)k;\n    return m == -INFINITY ? 0.f : -m;", factor="expf(m_old + neg_m)",
                    exp="expf(fmaf({x}, k, neg_m))", m_new="fmaxf(row_max, softmax_row_max(s, h) * k)",
                    total="fmaf(row_sum, corr, sum)",
                    first="; every block rescales (`first` unused)")

    def to_cpp(self) -> str:
        """The rule as ``__device__`` functions: ``softmax_row_max``, ``softmax_thread_sum``,
        ``softmax_neg_max``, ``softmax_rescale_factor``, ``softmax_max_step``, ``softmax_exp_step`` (a
        block's update: the caller rescales O with ``scale_row`` between the steps or later)
        (needs ``ex2_approx`` with exp2, ``__shfl_xor_sync``, ``fmaxf``/``fmaf``/``expf``)."""
        n, ch, v = self.values, self.chunks, self._variant()
        vals = lambda arr: [f"{arr}[{i} + 2 * h]" for i in row_values(ch, 0)]  # noqa: E731
        lanes = ", ".join(str(m) for m in self.lanes) or "(none)"
        shfl = "\n".join("    " + line for line in butterfly_cpp("m", self.lanes, _fmax_cpp))
        return f"""// ---- online softmax (flashgen.attention.softmax.OnlineSoftmax) ----
// A thread's S and O fragments: chunks of 8 columns x 2 rows, value 4 c + 2 h + e = row half h, column
// 8 c + e; the row's other columns are in the lanes xor {lanes}. Every max and sum over a row: a balanced
// tree over the thread's values in column order, then one shfl.xor per lane mask in that order.
constexpr uint32_t SOFTMAX_CHUNKS = {ch};
// max of row half h over the thread's values, then over the row's lanes
__device__ __forceinline__ float softmax_row_max(const float (&s)[{n}], uint32_t h) {{
    float m = {balanced(vals("s"), _fmax_cpp)};
{shfl}
    return m;
}}
// the thread's share of row half h's sum (the epilogue joins the lanes)
__device__ __forceinline__ float softmax_thread_sum(const float (&p)[{n}], uint32_t h) {{
    return {balanced(vals("p"), _add_cpp)};
}}
// the exponent's offset for a row max m ({v["units"]}); 0 for a row with no kept score yet: p = 0
__device__ __forceinline__ float softmax_neg_max(float m, float k) {{
    {v["neg"]}
}}
// the factor a row's sum and O take when its max moves from m_old to the max of neg_m
__device__ __forceinline__ float softmax_rescale_factor(float m_old, float k, float neg_m) {{ return {v["factor"]}; }}
// a key block's first step for row half h: the new max (into row_max) and its exponent offset (neg_m);
// returns the factor the row's sum and O take
__device__ __forceinline__ float softmax_max_step(const float (&s)[{n}], uint32_t h, float& row_max, float k, float& neg_m) {{
    const float m_new = {v["m_new"]};
    neg_m = softmax_neg_max(m_new, k);
    const float corr = softmax_rescale_factor(row_max, k, neg_m);
    row_max = m_new;
    return corr;
}}
// the second step: P in place of row half h's scores, the row sum rescaled by corr and grown{v["first"]}
__device__ __forceinline__ void softmax_exp_step(float (&s)[{n}], uint32_t h, float& row_sum, float k, float neg_m, float corr, bool first) {{
    (void)first;
    #pragma unroll
    for (uint32_t c = 0; c < SOFTMAX_CHUNKS; ++c) {{
        s[4 * c + 2 * h] = {v["exp"].format(x="s[4 * c + 2 * h]")};
        s[4 * c + 2 * h + 1] = {v["exp"].format(x="s[4 * c + 2 * h + 1]")};
    }}
    const float sum = softmax_thread_sum(s, h);
    row_sum = {v["total"]};
}}
{SCALE_ROW_CPP}"""


def online_softmax(plan) -> OnlineSoftmax:
    """The online softmax of a plan of either engine: ``B_c / 8`` chunks per fragment (an m16 tile's
    n8 tiles; a wgmma m64 accumulator's 8-column chunks), the plan's row lanes, the softmax knob."""
    return OnlineSoftmax(plan.cfg.B_c // 8, tuple(plan.row_reduce_lanes), plan.cfg.optimized_softmax)
