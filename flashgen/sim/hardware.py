"""Hardware semantics of the instructions the kernels use, written from the PTX ISA alone.

Nothing here imports the plan's maps (``flashgen.dsl.atoms``): the simulator applies
these independent semantics to the plan's addresses, so a wrong plan is caught
instead of copied.

Conventions
-----------
* A 32-bit register holding two 16-bit values is an array axis of length 2:
  ``[..., 0]`` is the low half (bits 0..15), ``[..., 1]`` the high half. In every
  PTX fragment the lower-indexed element sits in the low half.
* 16-bit data (fp16 or bf16) is carried as ``uint16`` bit patterns; ``decode`` /
  ``encode`` convert to and from fp32/fp64 values.
* ``gid = lane / 4`` ("groupID") and ``tig = lane % 4`` ("threadID_in_group").

Instructions
------------
``ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16`` (PTX 9.7.14.5.15):
    lanes ``8i .. 8i+7`` supply the addresses of rows 0..7 of matrix ``i``; a row is 8
    consecutive 16-bit elements (16 bytes). Destination register ``i`` of lane ``l``
    receives, of matrix ``i``, row ``l/4`` columns ``2*(l%4) + {0,1}``; with ``.trans``
    it receives the transposed matrix's row, i.e. rows ``2*(l%4) + {0,1}`` of column
    ``l/4``.

``stmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16`` (PTX 9.7.14.5.16, sm_90):
    ldmatrix's addressing and fragment, the other way: register ``i`` of lane ``l``, row ``l/4``
    columns ``2*(l%4) + {0,1}`` of matrix ``i``, is stored there (``.trans``: at rows
    ``2*(l%4) + {0,1}`` of column ``l/4``).

``mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32`` (PTX 9.7.14.5.8,
"Matrix Fragments for mma.m16n8k16 with floating point type")::

    A 16x16, 4 regs x 2 halves, element a_i (i = 2*reg + half):
        row = gid + 8 * (i in {2,3,6,7})   = gid + 8*(reg % 2)
        col = 2*tig + (i % 2) + 8*(i >= 4) = 2*tig + half + 8*(reg / 2)
    B 16x8, 2 regs x 2 halves, element b_i (i = 2*reg + half):
        row (k) = 2*tig + (i % 2) + 8*(i >= 2) = 2*tig + half + 8*reg
        col (n) = gid
    C/D 16x8 f32, 4 regs, element c_i:
        row = gid + 8*(i >= 2) = gid + 8*(reg / 2)
        col = 2*tig + (i % 2)

  Numerics modelled here: every product of two 16-bit inputs is exact in fp64; each
  output is ``fp32(c + sum_k a_k b_k)`` with the 16-term sum formed in float64 in k
  order and rounded to fp32 once (round to nearest even). For inputs whose products
  span fewer than 53 - 22 bits of exponent the float64 sum is exact, so the result is
  independent of summation order: the correctly rounded fp32 of the exact value.
  (Real tensor cores truncate during alignment; the simulator is an idealised MMA
  whose purpose is to check *which* elements meet, bit for bit.)

Shared-memory banks (CUDA C++ Programming Guide, "Shared Memory" of compute
capability 8.x/9.x): 32 banks of 4 bytes; word ``w = byte_addr / 4`` lives in bank
``w % 32``. A request is served in *phases*; in each phase a bank delivers one
distinct word per wavefront (several threads reading the same word share it). So a
phase needs ``max over banks of (distinct words in that bank)`` wavefronts:

* 16 bytes per thread (``ld/st.shared.v4``, the shared side of ``cp.async`` 16 B):
  4 phases of 8 consecutive threads (128 bytes each), ideal 1 wavefront per phase;
* 8 bytes per thread (``ld/st.shared.v2``): 2 phases of 16 consecutive threads, ideal 1 each;
* ``ldmatrix``: one phase per 8x8 matrix (its 8 row addresses x 16 bytes), ideal 1;
* 4 bytes per thread (``st.shared.b32``): one phase of 32 threads, ideal 1.

The conflict ratio of an access is ``wavefronts / ideal wavefronts`` (1.0 = none).
"""
from __future__ import annotations

import numba
import numpy as np

WARP = 32
N_BANKS = 32
BANK_BYTES = 4

# ---- 16-bit float formats -----------------------------------------------------------

FP16, BF16 = "fp16", "bf16"


def _dtype_name(dtype: object) -> str:
    name = getattr(dtype, "value", dtype)
    if name not in (FP16, BF16):
        raise ValueError(f"unknown 16-bit dtype {dtype!r}: expected 'fp16' or 'bf16'")
    return str(name)


def decode(bits: np.ndarray, dtype: object = FP16) -> np.ndarray:
    """float32 values of 16-bit patterns (``uint16``); a ``float16`` array is taken as fp16 values."""
    bits = np.asarray(bits)
    if bits.dtype == np.float16:
        return bits.astype(np.float32)
    if bits.dtype != np.uint16:
        raise ValueError(f"decode: expected uint16 bit patterns or float16, got {bits.dtype}")
    if _dtype_name(dtype) == FP16:
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def operand_rows(name: str, x: np.ndarray, dtype: object, d_head: int) -> np.ndarray:
    """A simulator input ``[rows, d_head]`` as uint16 patterns: patterns as given, floats rounded
    to ``dtype``; any other shape is a ValueError naming the operand."""
    x = np.asarray(x)
    if x.dtype != np.uint16:
        x = encode(x, dtype)
    if x.ndim != 2 or x.shape[1] != d_head:
        raise ValueError(f"{name}: expected [rows, {d_head}], got {x.shape}")
    return x


def encode(values: np.ndarray, dtype: object = FP16) -> np.ndarray:
    """uint16 patterns of ``values`` rounded to fp16/bf16, round to nearest even (``cvt.rn``).

    ``values`` are first rounded to fp32 (they are fp32 in the kernel). Overflow gives
    infinity; bf16 NaNs become the quiet NaN 0x7fc0 with the sign kept.
    """
    f32 = np.asarray(values, dtype=np.float32)
    if _dtype_name(dtype) == FP16:
        return f32.astype(np.float16).view(np.uint16)
    u = f32.view(np.uint32).astype(np.uint64)
    rounded = (u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
    nan = np.isnan(f32)
    out = rounded.astype(np.uint16)
    if nan.any():
        out[nan] = ((u[nan] >> np.uint64(16)) & np.uint64(0x8000)).astype(np.uint16) | np.uint16(0x7FC0)
    return out


def pack2(lo: np.ndarray, hi: np.ndarray, dtype: object = FP16) -> np.ndarray:
    """``cvt.rn.{f16x2,bf16x2}.f32``: two fp32 arrays -> ``[..., 2]`` register halves (lo first)."""
    return np.stack([encode(lo, dtype), encode(hi, dtype)], axis=-1)


# ---- ldmatrix ---------------------------------------------------------------------------


def ldmatrix_offsets(lane_addr: np.ndarray, num: int, trans: bool) -> np.ndarray:
    """Element offsets read into ``[lane, reg, half]`` by one ``ldmatrix.x{num}[.trans]``.

    ``lane_addr``: ``[..., 32]`` element offsets (the 16-bit element index of each row
    start; lanes ``8i..8i+7`` give matrix ``i``'s rows 0..7, lanes ``>= 8*num`` are
    ignored). Returns ``[..., 32, num, 2]`` int64.
    """
    if num not in (1, 2, 4):
        raise ValueError(f"ldmatrix moves 1, 2 or 4 matrices, not {num}")
    addr = np.asarray(lane_addr, dtype=np.int64)
    if addr.shape[-1] != WARP:
        raise ValueError(f"ldmatrix: need 32 lane addresses, got shape {addr.shape}")
    lane = np.arange(WARP)[:, None, None]
    mat = np.arange(num)[None, :, None]
    half = np.arange(2)[None, None, :]
    gid, tig = lane // 4, lane % 4
    if trans:  # stored row 2*tig + half, column gid
        src_lane = 8 * mat + 2 * tig + half
        col = np.broadcast_to(gid, src_lane.shape)
    else:  # stored row gid, columns 2*tig + half
        src_lane = np.broadcast_to(8 * mat + gid, (WARP, num, 2))
        col = np.broadcast_to(2 * tig + half, (WARP, num, 2))
    return addr[..., src_lane] + col


def ldmatrix(smem: np.ndarray, lane_addr: np.ndarray, num: int = 4, trans: bool = False) -> np.ndarray:
    """Registers ``[..., 32 lanes, num, 2 halves]`` loaded from the flat 16-bit array ``smem``.

    ``smem``: 1-D array of 16-bit elements (uint16 patterns or float16); ``lane_addr``:
    ``[..., 32]`` element offsets into it, each a multiple of 8 (16-byte aligned rows).
    """
    addr = np.asarray(lane_addr, dtype=np.int64)
    used = addr[..., : 8 * num]
    if np.any(used % 8):
        raise ValueError("ldmatrix: row addresses must be 16-byte aligned (element offset % 8 == 0)")
    off = ldmatrix_offsets(addr, num, trans)
    if off.min() < 0 or off.max() >= smem.shape[0]:
        raise IndexError("ldmatrix: a row address lies outside the shared-memory array")
    return smem[off]


def stmatrix_offsets(lane_addr: np.ndarray, num: int, trans: bool) -> np.ndarray:
    """Element offsets written from ``[lane, reg, half]`` by one ``stmatrix.x{num}[.trans]``.

    The ISA gives stmatrix ldmatrix's addressing and fragment (lanes ``8i..8i+7`` name matrix ``i``'s
    rows, register ``i`` of lane ``l`` holds row ``l/4`` columns ``2*(l%4) + {0,1}`` of matrix ``i``, stored
    transposed under ``.trans``), so each register half goes to the element ldmatrix would load it from.
    """
    return ldmatrix_offsets(lane_addr, num, trans)


# ---- mma.m16n8k16 fragment maps (PTX ISA) -----------------------------------------------


def _lane_parts() -> tuple[np.ndarray, np.ndarray]:
    lane = np.arange(WARP)
    return lane // 4, lane % 4


def _a_tables() -> tuple[np.ndarray, np.ndarray]:
    gid, tig = _lane_parts()
    reg = np.arange(4)[None, :, None]
    half = np.arange(2)[None, None, :]
    row = gid[:, None, None] + 8 * (reg % 2) + 0 * half
    col = 2 * tig[:, None, None] + half + 8 * (reg // 2)
    return row.astype(np.int64), col.astype(np.int64)


def _b_tables() -> tuple[np.ndarray, np.ndarray]:
    gid, tig = _lane_parts()
    reg = np.arange(2)[None, :, None]
    half = np.arange(2)[None, None, :]
    k = 2 * tig[:, None, None] + half + 8 * reg
    n = gid[:, None, None] + 0 * reg + 0 * half
    return k.astype(np.int64), n.astype(np.int64)


def _c_tables() -> tuple[np.ndarray, np.ndarray]:
    gid, tig = _lane_parts()
    reg = np.arange(4)[None, :]
    row = gid[:, None] + 8 * (reg // 2)
    col = 2 * tig[:, None] + reg % 2
    return row.astype(np.int64), col.astype(np.int64)


A_ROW, A_COL = _a_tables()  # [32, 4, 2]: (lane, reg, half) -> A (16x16) row, col
B_K, B_N = _b_tables()  # [32, 2, 2]: (lane, reg, half) -> B (16x8) k, n
C_ROW, C_COL = _c_tables()  # [32, 4]: (lane, reg) -> C/D (16x8) row, col


def _scatter(regs: np.ndarray, rows: np.ndarray, cols: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Registers ``[..., *rows.shape]`` -> ``[..., *shape]`` matrix via a (row, col) table."""
    regs = np.asarray(regs)
    out = np.zeros(regs.shape[: regs.ndim - rows.ndim] + shape, dtype=regs.dtype)
    out[..., rows, cols] = regs
    return out


def a_fragment_to_matrix(a: np.ndarray) -> np.ndarray:
    """``[..., 32, 4, 2]`` A registers -> ``[..., 16, 16]`` matrix (any dtype)."""
    return _scatter(a, A_ROW, A_COL, (16, 16))


def b_fragment_to_matrix(b: np.ndarray) -> np.ndarray:
    """``[..., 32, 2, 2]`` B registers -> ``[..., 16, 8]`` matrix (k, n)."""
    return _scatter(b, B_K, B_N, (16, 8))


def c_fragment_to_matrix(c: np.ndarray) -> np.ndarray:
    """``[..., 32, 4]`` accumulator -> ``[..., 16, 8]`` matrix."""
    return _scatter(c, C_ROW, C_COL, (16, 8))


def a_matrix_to_fragment(m: np.ndarray) -> np.ndarray:
    """``[..., 16, 16]`` -> ``[..., 32, 4, 2]`` A registers."""
    return np.asarray(m)[..., A_ROW, A_COL]


def b_matrix_to_fragment(m: np.ndarray) -> np.ndarray:
    """``[..., 16, 8]`` (k, n) -> ``[..., 32, 2, 2]`` B registers."""
    return np.asarray(m)[..., B_K, B_N]


def c_matrix_to_fragment(m: np.ndarray) -> np.ndarray:
    """``[..., 16, 8]`` -> ``[..., 32, 4]`` accumulator registers."""
    return np.asarray(m)[..., C_ROW, C_COL]


@numba.njit(cache=True)
def _mma_batch_kernel(a, b, c, a_row, a_col, b_k, b_n, c_row, c_col):
    """d[i] = fp32(c[i] + A[i] B[i]) per the fragment tables; sums in float64, k ascending."""
    n = a.shape[0]
    d = np.empty((n, 32, 4), np.float32)
    A = np.zeros((16, 16), np.float64)
    B = np.zeros((16, 8), np.float64)
    for i in range(n):
        for lane in range(32):
            for r in range(4):
                for h in range(2):
                    A[a_row[lane, r, h], a_col[lane, r, h]] = a[i, lane, r, h]
            for r in range(2):
                for h in range(2):
                    B[b_k[lane, r, h], b_n[lane, r, h]] = b[i, lane, r, h]
        for lane in range(32):
            for r in range(4):
                row = c_row[lane, r]
                col = c_col[lane, r]
                acc = np.float64(c[i, lane, r])
                for k in range(16):
                    acc += A[row, k] * B[k, col]
                d[i, lane, r] = np.float32(acc)
    return d


def mma_batch_f64(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Batched m16n8k16 on decoded operands: a ``[n,32,4,2]`` and b ``[n,32,2,2]`` float64
    values (exactly the 16-bit inputs), c ``[n,32,4]`` float32 -> d ``[n,32,4]`` float32."""
    a = np.ascontiguousarray(a, dtype=np.float64)
    b = np.ascontiguousarray(b, dtype=np.float64)
    c = np.ascontiguousarray(c, dtype=np.float32)
    if a.shape[1:] != (32, 4, 2) or b.shape[1:] != (32, 2, 2) or c.shape[1:] != (32, 4):
        raise ValueError(f"mma: bad fragment shapes a{a.shape} b{b.shape} c{c.shape}")
    if not (a.shape[0] == b.shape[0] == c.shape[0]):
        raise ValueError("mma: batch sizes differ")
    return _mma_batch_kernel(a, b, c, A_ROW, A_COL, B_K, B_N, C_ROW, C_COL)


def mma_m16n8k16(a: np.ndarray, b: np.ndarray, c: np.ndarray, dtype: object = None) -> np.ndarray:
    """``mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32``: d ``[32,4]`` f32 = A B + C.

    ``a``: ``[32, 4, 2]`` and ``b``: ``[32, 2, 2]`` 16-bit operands, either ``float16``
    arrays (fp16 values) or ``uint16`` bit patterns of ``dtype`` ('fp16' or 'bf16');
    ``c``: ``[32, 4]`` float32. Also accepts a leading batch axis on all three.
    """
    if dtype is None:
        if np.asarray(a).dtype != np.float16:
            raise ValueError("mma_m16n8k16: give dtype='fp16' or 'bf16' for uint16 operands")
        dtype = FP16
    a_v = decode(a, dtype).astype(np.float64)
    b_v = decode(b, dtype).astype(np.float64)
    c_v = np.asarray(c, dtype=np.float32)
    single = a_v.ndim == 3
    if single:
        a_v, b_v, c_v = a_v[None], b_v[None], c_v[None]
    d = mma_batch_f64(a_v, b_v, c_v)
    return d[0] if single else d


# ---- shared-memory banks ----------------------------------------------------------------


@numba.njit(cache=True)
def _phase_wavefronts(words: np.ndarray) -> int:
    """Max over banks of the number of distinct 4-byte words a phase touches in that bank."""
    n = words.shape[0]
    best = 0
    for bank in range(32):
        count = 0
        for i in range(n):
            w = words[i]
            if w % 32 != bank:
                continue
            seen = False
            for k in range(i):
                if words[k] == w:
                    seen = True
                    break
            if not seen:
                count += 1
        if count > best:
            best = count
    return best


@numba.njit(cache=True)
def _wavefronts_many(byte_addrs: np.ndarray, lanes_per_phase: int, n_phases: int, words_per_lane: int) -> np.ndarray:
    """Per access (row of ``byte_addrs [n, 32]``): sum over phases of the phase's wavefronts."""
    n = byte_addrs.shape[0]
    out = np.zeros(n, np.int64)
    words = np.empty(lanes_per_phase * words_per_lane, np.int64)
    for i in range(n):
        total = 0
        for p in range(n_phases):
            for t in range(lanes_per_phase):
                base = byte_addrs[i, p * lanes_per_phase + t] // 4
                for k in range(words_per_lane):
                    words[t * words_per_lane + k] = base + k
            total += _phase_wavefronts(words)
        out[i] = total
    return out


def _as_accesses(byte_addrs: np.ndarray, align: int, what: str) -> np.ndarray:
    a = np.ascontiguousarray(byte_addrs, dtype=np.int64)
    if a.shape[-1] != WARP:
        raise ValueError(f"{what}: need 32 addresses per access, got shape {a.shape}")
    if np.any(a % align) or np.any(a < 0):
        raise ValueError(f"{what}: byte addresses must be non-negative multiples of {align}")
    return a.reshape(-1, WARP)


def wavefronts_vec16_many(byte_addrs: np.ndarray) -> np.ndarray:
    """Wavefronts of each 16-byte-per-thread warp access in ``byte_addrs [..., 32]``."""
    a = _as_accesses(byte_addrs, 16, "wavefronts_vec16")
    return _wavefronts_many(a, 8, 4, 4).reshape(np.shape(byte_addrs)[:-1])


def wavefronts_vec8_many(byte_addrs: np.ndarray) -> np.ndarray:
    """Wavefronts of each 8-byte-per-thread warp access in ``byte_addrs [..., 32]``."""
    a = _as_accesses(byte_addrs, 8, "wavefronts_vec8")
    return _wavefronts_many(a, 16, 2, 2).reshape(np.shape(byte_addrs)[:-1])


def wavefronts_ldmatrix_many(row_byte_addrs: np.ndarray, num: int) -> np.ndarray:
    """Wavefronts of each ``ldmatrix.x{num}`` in ``row_byte_addrs [..., 32]`` (lanes >= 8*num ignored)."""
    if num not in (1, 2, 4):
        raise ValueError(f"ldmatrix moves 1, 2 or 4 matrices, not {num}")
    a = _as_accesses(row_byte_addrs, 16, "wavefronts_ldmatrix")
    return _wavefronts_many(a, 8, num, 4).reshape(np.shape(row_byte_addrs)[:-1])


def wavefronts_b32_many(byte_addrs: np.ndarray) -> np.ndarray:
    """Wavefronts of each 4-byte-per-thread warp access in ``byte_addrs [..., 32]``."""
    a = _as_accesses(byte_addrs, 4, "wavefronts_b32")
    return _wavefronts_many(a, 32, 1, 1).reshape(np.shape(byte_addrs)[:-1])


def wavefronts_vec16(byte_addrs: np.ndarray) -> int:
    """Wavefronts of one warp access moving 16 bytes per thread (4 phases of 8 threads)."""
    return int(wavefronts_vec16_many(np.asarray(byte_addrs)[None])[0])


def wavefronts_ldmatrix(row_byte_addrs: np.ndarray, num: int) -> int:
    """Wavefronts of one ``ldmatrix.x{num}`` (one phase per 8x8 matrix)."""
    return int(wavefronts_ldmatrix_many(np.asarray(row_byte_addrs)[None], num)[0])


def wavefronts_b32(byte_addrs: np.ndarray) -> int:
    """Wavefronts of one warp access moving 4 bytes per thread (one phase; same word broadcasts)."""
    return int(wavefronts_b32_many(np.asarray(byte_addrs)[None])[0])


IDEAL_WAVEFRONTS = {"vec16": 4, "vec8": 2, "b32": 1}


def ideal_wavefronts(kind: str, num: int = 4) -> int:
    """Wavefronts of a conflict-free full-warp access: ``vec16`` 4, ``vec8`` 2, ``ldmatrix`` num, ``b32`` 1."""
    if kind == "ldmatrix":
        return num
    return IDEAL_WAVEFRONTS[kind]


# ---- fp32 helpers matching the kernel's float arithmetic ---------------------------------


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``fmaf(a, b, c)`` in fp32 with one rounding (round to nearest even), elementwise.

    a*b is exact in float64; the float64 sum is rounded *to odd* (TwoSum error term
    decides the sticky bit), after which rounding to fp32 is correct.
    """
    a64 = np.asarray(a, dtype=np.float32).astype(np.float64)
    b64 = np.asarray(b, dtype=np.float32).astype(np.float64)
    c64 = np.asarray(c, dtype=np.float32).astype(np.float64)
    p = a64 * b64
    with np.errstate(invalid="ignore"):
        s = p + c64
        bb = s - p
        err = (p - (s - bb)) + (c64 - bb)
        inexact = np.isfinite(s) & (err != 0)
        even = (s.view(np.int64) & 1) == 0
        bump = inexact & even
        if np.any(bump):
            s = np.where(bump, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def ex2_approx_ftz(x: np.ndarray) -> np.ndarray:
    """``ex2.approx.ftz.f32`` modelled as the correctly rounded 2^x with subnormals flushed to 0."""
    x32 = np.asarray(x, dtype=np.float32)
    tiny = np.finfo(np.float32).tiny
    x32 = np.where(np.abs(x32) < tiny, np.float32(0), x32)
    with np.errstate(over="ignore", under="ignore"):
        y = np.exp2(x32.astype(np.float64)).astype(np.float32)
    return np.where(np.abs(y) < tiny, np.float32(0), y).astype(np.float32)


def expf(x: np.ndarray) -> np.ndarray:
    """``expf`` (CUDA: within 2 ulp) modelled as the correctly rounded fp32 e^x."""
    with np.errstate(over="ignore", under="ignore"):
        return np.exp(np.asarray(x, dtype=np.float32).astype(np.float64)).astype(np.float32)
