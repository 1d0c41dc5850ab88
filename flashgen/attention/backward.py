"""The backward pass's element-wise math, written once for every engine's kernels and simulators.

With ``S = Q K^T`` (unscaled), ``P = softmax(scale * S)`` recomputed from the forward's log-sum-exp
and ``dP = dO V^T``:

* :class:`RowDot` — the preprocess ``D_i = sum_c dO[i, c] * O[i, c]`` (fp32), in the order a group
  of ``lanes`` threads sums one row: each lane its own ``vec``-element chunks with ``fmaf``, then a
  butterfly (``lane ^ m`` for ``m = lanes/2 .. 1``).
* :class:`Recompute` — ``P = 2^(S * scale*log2(e) - lse*log2(e))``, one ``fmaf`` and ``ex2``; a
  masked score (-inf) gives 0, and so does every score of a row whose lse is -inf (no kept key:
  its log2-domain lse is +inf, not -inf, so no -inf - -inf).
* :class:`ScoreGrad` — ``dS = P * (dP - D)`` (fp32), and where the softmax scale goes:
  ``dS`` stays unscaled in the main loop (it is rounded to 16 bits for ``dK += dS^T Q`` and
  ``dQ += dS K``), and ``dK`` and ``dQ`` are multiplied by ``scale`` once, when they are written.

Each class evaluates itself on numpy arrays (the simulators', with the fp32 ``fmaf`` and ``ex2``
models of :mod:`flashgen.sim.hardware`, imported when evaluating so that plans need no numba) and
renders the same rule as ``__host__ __device__`` C++ (the emitters'); tests compile the C++ for the
host and compare (tests/attention/test_backward.py).
"""
from __future__ import annotations

import attrs
import numpy as np

from ..dsl.config import LOG2E

_F32 = np.float32

#: ``ex2.approx.ftz.f32`` on the GPU, ``exp2f`` on the host (tests): the backward's exponential
EXP2_CPP = """__host__ __device__ __forceinline__ float bwd_exp2(float x) {
#ifdef __CUDA_ARCH__
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#else
    return exp2f(x);
#endif
}"""


@attrs.frozen
class RowDot:
    """``D = rowsum(dO * O)``: ``lanes`` threads per row, each summing ``vec``-element chunks
    ``lane, lane + lanes, ...`` in order with ``fmaf``, then a butterfly over the lanes."""

    lanes: int = 8
    vec: int = 8

    def __attrs_post_init__(self) -> None:
        if self.lanes < 1 or self.lanes > 32 or self.lanes & (self.lanes - 1):
            raise ValueError(f"RowDot lanes={self.lanes}: a power of two between 1 and 32 (a butterfly within a warp)")

    @property
    def masks(self) -> tuple[int, ...]:
        """The butterfly's xor masks, in order."""
        return tuple(self.lanes >> s for s in range(1, self.lanes.bit_length()))

    def partials(self, do: np.ndarray, o: np.ndarray) -> np.ndarray:
        """``[rows, lanes]`` fp32: each lane's own sum (``do``, ``o``: ``[rows, d]`` fp32 values)."""
        from ..sim import hardware as hw

        do, o = np.asarray(do, _F32), np.asarray(o, _F32)
        rows, d = do.shape
        acc = np.zeros((rows, self.lanes), _F32)
        step = self.lanes * self.vec
        for lane in range(self.lanes):
            for c0 in range(lane * self.vec, d, step):
                for e in range(min(self.vec, d - c0)):
                    acc[:, lane] = hw.fma32(do[:, c0 + e], o[:, c0 + e], acc[:, lane])
        return acc

    def evaluate(self, do: np.ndarray, o: np.ndarray) -> np.ndarray:
        """``[rows]`` fp32: D of every row, as every lane of the row holds it after the butterfly."""
        x = self.partials(do, o)
        lane = np.arange(self.lanes)
        for m in self.masks:
            x = (x + x[:, lane ^ m]).astype(_F32)
        return x[:, 0]

    def to_cpp(self) -> str:
        """``rowdot_partial`` (host and device; ``T`` any type converting to float) and the device's
        ``rowdot_reduce`` (the butterfly over the row's lanes)."""
        return f"""// D = rowsum(dO * O) (flashgen.attention.backward.RowDot): {self.lanes} lanes per row, {self.vec}-element chunks
constexpr int ROWDOT_LANES = {self.lanes};
constexpr int ROWDOT_VEC = {self.vec};
// the n <= ROWDOT_VEC elements of a chunk at p; a whole chunk of 16 bytes in one load on the device (rows are
// 16-byte aligned, the launcher ABI's rule: element by element they were 8 loads a lane)
template <class T>
__host__ __device__ __forceinline__ void rowdot_chunk(T (&x)[ROWDOT_VEC], const T* p, int n) {{
#ifdef __CUDA_ARCH__
    if constexpr (sizeof(x) == 16) {{
        if (n == ROWDOT_VEC) {{
            *reinterpret_cast<uint4*>(x) = *reinterpret_cast<const uint4*>(p);
            return;
        }}
    }}
#endif
    for (int e = 0; e < n; ++e) x[e] = p[e];
}}
// lane `lane`'s share of one row of d elements: chunks lane, lane + ROWDOT_LANES, ..., fmaf in order
template <class T>
__host__ __device__ __forceinline__ float rowdot_partial(const T* dO, const T* O, int lane, int d) {{
    float acc = 0.f;
    for (int c0 = lane * ROWDOT_VEC; c0 < d; c0 += ROWDOT_LANES * ROWDOT_VEC) {{
        const int n = d - c0 < ROWDOT_VEC ? d - c0 : ROWDOT_VEC;
        T a[ROWDOT_VEC], b[ROWDOT_VEC];
        rowdot_chunk(a, dO + c0, n);
        rowdot_chunk(b, O + c0, n);
        for (int e = 0; e < n; ++e) acc = fmaf(float(a[e]), float(b[e]), acc);
    }}
    return acc;
}}
#ifdef __CUDACC__
// the row's partials summed: lane ^ m for m = ROWDOT_LANES / 2, ..., 1 (every lane ends with D)
__device__ __forceinline__ float rowdot_reduce(float x) {{
#pragma unroll
    for (int m = ROWDOT_LANES / 2; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
    return x;
}}
#endif"""


@attrs.frozen
class Recompute:
    """``P = 2^(fmaf(S, scale*log2e, -lse_log2))`` with ``lse_log2 = lse * log2e`` (+inf for lse = -inf)."""

    @staticmethod
    def scale_log2(scale: float) -> np.float32:
        """``scale * log2(e)`` rounded to fp32, as the forward folds it."""
        return _F32(_F32(scale) * _F32(LOG2E))

    @staticmethod
    def lse_log2(lse: np.ndarray) -> np.ndarray:
        lse = np.asarray(lse, _F32)
        return np.where(lse == -np.inf, _F32(np.inf), lse * _F32(LOG2E)).astype(_F32)

    def evaluate(self, s: np.ndarray, scale_log2: np.float32, lse_log2: np.ndarray) -> np.ndarray:
        """P (fp32) of scores ``s`` (fp32, -inf where masked); ``lse_log2`` broadcasts against ``s``."""
        from ..sim import hardware as hw

        with np.errstate(invalid="ignore"):
            return hw.ex2_approx_ftz(hw.fma32(s, scale_log2, -np.asarray(lse_log2, _F32)))

    def to_cpp(self) -> str:
        return f"""// P recomputed from the saved log-sum-exp (flashgen.attention.backward.Recompute)
{EXP2_CPP}
// lse * log2(e); +inf for a row without a kept key, so that every P of that row is 0
__host__ __device__ __forceinline__ float bwd_lse_log2(float lse) {{
    return lse == -INFINITY ? INFINITY : lse * {float(_F32(LOG2E))!r}f;
}}
// s: the unscaled score (-inf where masked); scale_log2 = scale * log2(e) in fp32
__host__ __device__ __forceinline__ float bwd_prob(float s, float scale_log2, float lse_log2) {{
    return bwd_exp2(fmaf(s, scale_log2, -lse_log2));
}}"""


@attrs.frozen
class ScoreGrad:
    """``dS = P * (dP - D)`` in fp32 (unscaled); ``scale`` applied once to dK and dQ as they are written."""

    def evaluate(self, p: np.ndarray, dp: np.ndarray, d: np.ndarray) -> np.ndarray:
        p, dp, d = (np.asarray(x, _F32) for x in (p, dp, d))
        return (p * (dp - d).astype(_F32)).astype(_F32)

    @staticmethod
    def scaled(grad: np.ndarray, scale: float) -> np.ndarray:
        """dK or dQ as written: the accumulated fp32 sum times ``scale`` (fp32)."""
        return (np.asarray(grad, _F32) * _F32(scale)).astype(_F32)

    def to_cpp(self) -> str:
        return """// dS = P * (dP - D), unscaled (flashgen.attention.backward.ScoreGrad)
__host__ __device__ __forceinline__ float bwd_dscore(float p, float dp, float d) { return p * (dp - d); }
// dK and dQ as written: the fp32 sums of dS^T Q and dS K times the softmax scale
__host__ __device__ __forceinline__ float bwd_grad_scaled(float acc, float scale) { return acc * scale; }"""
