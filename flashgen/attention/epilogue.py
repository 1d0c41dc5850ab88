"""The epilogue's math: a finished row's sum, O's normalisation, the log-sum-exp, the output's dtype.

After the last key block each thread holds, per row half, the row max (the online softmax's units)
and its share of the row sum. Per row half (:class:`Epilogue`)::

    l   = row_sum joined over the row's lanes   # butterfly, lane masks in order (the softmax's order)
    inv = l > 0 ? 1 / l : 0                     # empty_rows "zero": a row without a kept score outputs 0
                                                #            "nan":  ... outputs NaN
    lse = l > 0 ? fma(row_max, scale, log(l)) : -inf    # exp2 softmax (max in raw S units)
          l > 0 ? row_max + log(l) : -inf               # expf softmax (max already scaled)
    O's row half *= inv, then rounded to the output dtype (cvt.rn)

The LSE is in natural-log units of the scaled scores. How O travels to global memory (registers ->
shared -> 16-byte stores, or TMA) stays with each engine; this object is the math both run.
:meth:`Epilogue.to_cpp` renders ``epilogue_row_sum``, ``epilogue_inv`` and ``epilogue_lse``; O's
normalisation is :func:`flashgen.attention.softmax.scale_row` (``scale_row`` in C++).
"""
from __future__ import annotations

import attrs
import numpy as np

from .softmax import hw_model, butterfly, butterfly_cpp, scale_row

EMPTY_ROWS = ("zero", "nan")


def _add_cpp(a: str, b: str) -> str:
    return f"{a} + {b}"


@attrs.frozen
class Epilogue:
    """The epilogue of rows reduced over the lanes ``lane ^ m`` of ``lanes``."""

    lanes: tuple[int, ...]
    #: the online softmax's ``exp2``: its row max is in raw S units (the LSE scales it)
    exp2: bool = True
    #: what a row without any kept score outputs: "zero" or "nan" (its LSE is -inf either way)
    empty_rows: str = "zero"

    def __attrs_post_init__(self) -> None:
        if self.empty_rows not in EMPTY_ROWS:
            raise ValueError(f"Epilogue: empty_rows must be one of {EMPTY_ROWS}, got {self.empty_rows!r}")

    # ---- numpy evaluators: per-thread scalars [..., threads], fragments [..., threads, values] ----

    def row_sum(self, row_sum: np.ndarray) -> np.ndarray:
        """The row's sum ``l``: every thread's share joined over the row's lanes."""
        return butterfly(np.asarray(row_sum, np.float32), self.lanes, np.add)

    def inv(self, l: np.ndarray) -> np.ndarray:
        """``1 / l``; 0 (or NaN) for a row without a kept score."""
        l = np.asarray(l, np.float32)
        empty = np.float32(0) if self.empty_rows == "zero" else np.float32(np.nan)
        with np.errstate(divide="ignore", over="ignore"):
            return np.where(l > 0, np.float32(1) / l, empty).astype(np.float32)

    def lse(self, row_max: np.ndarray, l: np.ndarray, scale: float) -> np.ndarray:
        """The row's log-sum-exp (natural log); -inf for a row without a kept score."""
        hw, f32 = hw_model(), np.float32
        l = np.asarray(l, f32)
        with np.errstate(divide="ignore", invalid="ignore"):
            log_l = np.log(l.astype(np.float64)).astype(f32)  # logf modelled correctly rounded
            lse = hw.fma32(row_max, f32(scale), log_l) if self.exp2 else (np.asarray(row_max, f32) + log_l).astype(f32)
        return np.where(l > 0, lse, f32(-np.inf)).astype(f32)

    def normalize(self, o: np.ndarray, h: int, inv: np.ndarray) -> np.ndarray:
        """O's row half ``h`` times ``inv`` (``[..., threads, values]``, a copy)."""
        return scale_row(o, h, inv)

    def convert(self, o: np.ndarray, dtype: object) -> np.ndarray:
        """fp32 output values as the dtype's 16-bit patterns, round to nearest even (``cvt.rn``)."""
        return hw_model().encode(o, dtype)

    # ---- C++ ------------------------------------------------------------------------------------

    def to_cpp(self) -> str:
        """``epilogue_row_sum``, ``epilogue_inv``, ``epilogue_lse`` (needs ``__shfl_xor_sync``, ``logf``)."""
        lanes = ", ".join(str(m) for m in self.lanes) or "(none)"
        shfl = "\n".join("    " + line for line in butterfly_cpp("l", self.lanes, _add_cpp))
        empty = "0.f" if self.empty_rows == "zero" else "__int_as_float(0x7fffffff)"
        if self.exp2:
            lse, units = "fmaf(row_max, scale, logf(l))", "row_max in raw S units"
        else:
            lse, units = "row_max + logf(l)", "row_max already scaled; scale unused"
        return f"""// ---- the epilogue's math (flashgen.attention.epilogue.Epilogue) ----
// a row's sum: the thread's share joined over the row's lanes (xor {lanes}, in that order)
__device__ __forceinline__ float epilogue_row_sum(float l) {{
{shfl}
    return l;
}}
// what O's row is multiplied by: 1/l; {empty} for a row without a kept score
__device__ __forceinline__ float epilogue_inv(float l) {{ return l > 0.f ? 1.f / l : {empty}; }}
// the row's log-sum-exp of the scaled scores, natural log ({units}); -inf for a row without a kept score
__device__ __forceinline__ float epilogue_lse(float row_max, float l, float scale) {{
    (void)scale;
    return l > 0.f ? {lse} : -INFINITY;
}}"""


def epilogue(plan) -> Epilogue:
    """The epilogue of a plan of either engine: its row lanes, its softmax's units, empty rows output 0."""
    return Epilogue(tuple(plan.row_reduce_lanes), plan.cfg.optimized_softmax)
