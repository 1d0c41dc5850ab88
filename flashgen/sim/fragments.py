"""Fragments: the plan's ldmatrix maps and register roles fed through the simulated MMA.

The shared-memory image is built by executing the plan's g2s copy; fragments are
loaded with :func:`hardware.ldmatrix` at the plan's lane addresses; registers are
arranged the way the emitter arranges them (Q: ldmatrix.x4 register i = A register
i; K and V: :meth:`OperandLoad.b_operand_regs`; P: the S accumulator repacked by
:func:`flashgen.dsl.atoms.mma.accumulator_as_a_operand`); the MMA is
:func:`hardware.mma_batch_f64`, whose fragment layout comes from the PTX ISA alone.

The warp GEMM loops mirror ``flashgen.emit.kernel._gemm_S`` / ``_gemm_O``: k steps of
``OperandLoad.k_step`` columns, register double buffering (the next step's
fragments are loaded before the current step's MMAs), resident Q fragments.

Bit-exactness of the checks: every simulated MMA returns ``fp32(c + sum of 16 exact
products)`` (see :mod:`hardware`). The reference does the same per 16-wide k chunk,
in the kernel's chunk order: ``acc = fp32(float64(acc) + A[:, chunk] @ B[chunk, :])``
with numpy's float64 matmul. The test data (fp16/bf16 values with magnitudes in
``[2^-6, ~5]``) keeps every float64 partial sum exact (the terms span < 53 bits), so
both sides are the correctly rounded fp32 of the same exact numbers, independent of
summation order, and must agree bit for bit.
"""
from __future__ import annotations

import attrs
import numpy as np

from flashgen.dsl.atoms.mma import accumulator_as_a_operand
from flashgen.dsl.plan import KernelPlan, OperandLoad
from flashgen.sim import hardware as hw
from flashgen.sim.copies import CopyTrace, VEC_ELEMS, smem_total_bytes, trace_plan

# ---- shared-memory image ----------------------------------------------------------------------


def cta_smem_image(plan: KernelPlan) -> np.ndarray:
    """Zeroed flat ``uint16`` image of the CTA's dynamic shared memory (sQ, sK, sV)."""
    return np.zeros(smem_total_bytes(plan) // 2, dtype=np.uint16)


def g2s_payload(trace: CopyTrace, block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(image element indices, values) written by one execution of a g2s copy.

    ``block``: ``[rows_valid, cols_valid]`` uint16, the part of the global tensor the
    block holds (row-major; tile coordinates index it directly). Each lane's 16-byte
    vector writes ``block[row, col:col+8]`` to ``smem[offset : offset+8]``; chunks at
    rows >= rows_valid (sequence tails) or columns >= cols_valid (head padding) are
    zero-filled, as the kernel's predicated copies (``cp.async`` src-size 0) do.
    """
    R, C = trace.tile
    tile = np.zeros((R, C), dtype=np.uint16)
    rows, cols = min(R, block.shape[0]), min(C, block.shape[1])
    tile[:rows, :cols] = block[:rows, :cols]
    ok = trace.in_tile[..., 0]
    r = trace.rows[..., 0][ok]
    c = trace.cols[..., 0][ok]
    e = np.arange(VEC_ELEMS)
    dst = trace.base_bytes // 2 + trace.smem_elem[..., 0][ok][:, None] + e
    src = tile[r[:, None], np.minimum(c[:, None] + e, C - 1)]
    return dst.ravel(), src.ravel()


def g2s_store(trace: CopyTrace, block: np.ndarray, image: np.ndarray) -> None:
    """Execute a g2s copy at once (a synchronous copy, or an async one that has landed)."""
    dst, val = g2s_payload(trace, block)
    image[dst] = val


def operand_addresses(trace: CopyTrace) -> np.ndarray:
    """Lane row addresses of an s2r copy as element offsets into the CTA image.

    Shape ``[n_warps, extent(loop 0), extent(loop 1), 32]`` (loops in the partition's order:
    Q ``(mi, kk)``, K ``(nn, kk)``, V ``(kk, nn)``).
    """
    loops = trace.copy.partition.loops
    shape = (trace.n_warps,) + tuple(l.extent for l in loops) + (32,)
    if trace.copy.partition.tv.n_values != 1:
        raise ValueError(f"{trace.name}: expected one row address per lane")
    return (trace.base_bytes // 2 + trace.smem_elem[..., 0]).reshape(shape)


# ---- accumulators ----------------------------------------------------------------------------


def acc_to_matrix(acc: np.ndarray) -> np.ndarray:
    """``[mt, nt, 32, 4]`` accumulators of 16x8 tiles -> ``[16 mt, 8 nt]`` matrix (PTX C map)."""
    mt, nt = acc.shape[:2]
    tiles = hw.c_fragment_to_matrix(acc)  # [mt, nt, 16, 8]
    return tiles.transpose(0, 2, 1, 3).reshape(16 * mt, 8 * nt)


def matrix_to_acc(m: np.ndarray) -> np.ndarray:
    """Inverse of :func:`acc_to_matrix`."""
    rows, cols = m.shape
    tiles = m.reshape(rows // 16, 16, cols // 8, 8).transpose(0, 2, 1, 3)
    return hw.c_matrix_to_fragment(tiles)


def pack_P(s_acc: np.ndarray, dtype: object) -> np.ndarray:
    """P registers ``[mt, B_c/16, 32, 4, 2]`` from the S accumulator ``[mt, B_c/8, 32, 4]``.

    A-operand register ``r`` of k step ``k`` packs C values ``(c0, c0+1)`` of n tile
    ``2k + off`` where ``(off, c0) = accumulator_as_a_operand(2k, r)`` (the plan's rule),
    rounded with ``cvt.rn`` (lo = first value).
    """
    mt, n_tiles = s_acc.shape[:2]
    out = np.empty((mt, n_tiles // 2, 32, 4, 2), dtype=np.uint16)
    for k in range(n_tiles // 2):
        for r in range(4):
            off, c0 = accumulator_as_a_operand(2 * k, r)
            src = s_acc[:, 2 * k + off]
            out[:, k, :, r, :] = hw.pack2(src[..., c0], src[..., c0 + 1], dtype)
    return out


# ---- warp GEMMs as the emitter runs them -----------------------------------------------------------


def _k_loop(steps: int, buffers: int, load, mma) -> None:
    """``flashgen.emit.kernel._k_loop``: with 2 buffers, step s+1 is loaded before step s's MMAs."""
    if buffers == 2:
        load(0, 0)
        for s in range(steps):
            if s + 1 < steps:
                load(s + 1, (s + 1) % 2)
            mma(s, s % 2)
    elif buffers == 1:
        for s in range(steps):
            load(s, 0)
            mma(s, 0)
    else:
        raise ValueError(f"register buffers must be 1 or 2, got {buffers}")


def reduction_steps(k: int, k_step: int, what: str) -> int:
    """k steps of a warp GEMM; ValueError when the step does not divide the reduction."""
    if k_step <= 0 or k % k_step:
        raise ValueError(f"{what}: the k step of {k_step} does not divide the reduction length {k} "
                         f"({k // max(k_step, 1)} step(s) would leave {k % max(k_step, 1)} columns out)")
    return k // k_step


def b_operand_pairs(n_tiles: int) -> tuple[np.ndarray, np.ndarray]:
    """(x4 index, [reg b0, reg b1]) of each n8 tile, from ``OperandLoad.b_operand_regs``."""
    nn = np.empty(n_tiles, dtype=np.int64)
    regs = np.empty((n_tiles, 2), dtype=np.int64)
    for nt in range(n_tiles):
        x4, (r0, r1) = OperandLoad.b_operand_regs(nt)
        nn[nt], regs[nt] = x4, (r0, r1)
    return nn, regs


def mma_step(acc: np.ndarray, a: np.ndarray, b: np.ndarray, dtype: object) -> np.ndarray:
    """acc ``[M, N, 32, 4]`` += a ``[M, 32, 4, 2]`` x b ``[N, 32, 2, 2]`` for every (m, n) pair."""
    M, N = acc.shape[:2]
    a_v = hw.decode(a, dtype).astype(np.float64)
    b_v = hw.decode(b, dtype).astype(np.float64)
    aa = np.broadcast_to(a_v[:, None], (M, N, 32, 4, 2)).reshape(-1, 32, 4, 2)
    bb = np.broadcast_to(b_v[None, :], (M, N, 32, 2, 2)).reshape(-1, 32, 2, 2)
    return hw.mma_batch_f64(aa, bb, acc.reshape(-1, 32, 4)).reshape(acc.shape)


def load_resident_Q(plan: KernelPlan, image: np.ndarray, addr_q: np.ndarray, warp: int) -> np.ndarray:
    """All Q fragments of a warp ``[mt, kk, 32, 4, 2]`` (the ``load_rf Q`` step)."""
    atom = plan.s2r["Q"].copy.atom
    return hw.ldmatrix(image, addr_q[warp], atom.num, atom.trans)


def warp_gemm_S(
    plan: KernelPlan, image: np.ndarray, addr_q: np.ndarray, addr_k: np.ndarray, warp: int, q_res: np.ndarray | None = None
) -> np.ndarray:
    """S accumulator ``[mt, B_c/8, 32, 4]`` f32 of one warp: S = Q K^T from shared memory.

    The reduction is ``plan.gemm_S.k`` columns in steps of the K operand's ``k_step``
    (the emitter's loop), which must divide it.

    ``q_res``: the warp's resident Q fragments when the plan keeps Q in registers.
    """
    cfg = plan.cfg
    q, k = plan.s2r["Q"], plan.s2r["K"]
    dt = cfg.dtype
    kk = k.k_step // 16
    steps = reduction_steps(plan.gemm_S.k, k.k_step, "S = Q K^T")
    n_tiles = plan.gemm_S.n_tiles
    nn_of, regs_of = b_operand_pairs(n_tiles)
    if q.resident and q_res is None:
        raise ValueError("warp_gemm_S: the plan keeps Q resident; pass its fragments (q_res)")
    if not q.resident and q.k_step != k.k_step:
        raise ValueError(f"Q k step {q.k_step} != K k step {k.k_step}: the emitter loads Q and K in lock-step")
    s_acc = np.zeros((cfg.m_tiles_per_warp, n_tiles, 32, 4), dtype=np.float32)
    k_buf = np.zeros((k.buffers, cfg.B_c // 16, kk, 32, 4, 2), dtype=np.uint16)
    q_buf = np.zeros((k.buffers, cfg.m_tiles_per_warp, kk, 32, 4, 2), dtype=np.uint16)
    katom, qatom = k.copy.atom, q.copy.atom

    def load(step: int, buf: int) -> None:
        cols = slice(step * kk, (step + 1) * kk)
        k_buf[buf] = hw.ldmatrix(image, addr_k[warp][:, cols], katom.num, katom.trans)
        if not q.resident:
            q_buf[buf] = hw.ldmatrix(image, addr_q[warp][:, cols], qatom.num, qatom.trans)

    def mma(step: int, buf: int) -> None:
        nonlocal s_acc
        for kq in range(kk):
            a = q_res[:, step * kk + kq] if q.resident else q_buf[buf, :, kq]  # [mt, 32, 4, 2]
            x4 = k_buf[buf, nn_of, kq]  # [n_tiles, 32, 4, 2]
            b = np.take_along_axis(x4, regs_of[:, None, :, None], axis=2)  # [n_tiles, 32, 2, 2]
            s_acc = mma_step(s_acc, a, b, dt)

    _k_loop(steps, k.buffers, load, mma)
    return s_acc


def warp_gemm_O(
    plan: KernelPlan, image: np.ndarray, addr_v: np.ndarray, warp: int, p_frag: np.ndarray, o_acc: np.ndarray
) -> np.ndarray:
    """O accumulator ``[mt, gemm_O.n_tiles, 32, 4]`` += P V for one warp (V via ldmatrix.trans).

    The reduction is ``plan.gemm_O.k`` (= B_c) rows of V in steps of ``k_step``.
    """
    v = plan.s2r["V"]
    kk = v.k_step // 16
    steps = reduction_steps(plan.gemm_O.k, v.k_step, "O = P V")
    n_tiles = plan.gemm_O.n_tiles
    nn_of, regs_of = b_operand_pairs(n_tiles)
    v_buf = np.zeros((v.buffers, kk, addr_v.shape[2], 32, 4, 2), dtype=np.uint16)
    atom = v.copy.atom

    def load(step: int, buf: int) -> None:
        v_buf[buf] = hw.ldmatrix(image, addr_v[warp][step * kk : (step + 1) * kk], atom.num, atom.trans)

    def mma(step: int, buf: int) -> None:
        nonlocal o_acc
        for kq in range(kk):
            a = p_frag[:, step * kk + kq]
            x4 = v_buf[buf, kq, nn_of]
            b = np.take_along_axis(x4, regs_of[:, None, :, None], axis=2)
            o_acc = mma_step(o_acc, a, b, plan.cfg.dtype)

    _k_loop(steps, v.buffers, load, mma)
    return o_acc


# ---- checks ----------------------------------------------------------------------------------------


@attrs.frozen
class FragmentCheck:
    name: str
    ok: bool
    detail: str

    def to_dict(self) -> dict:
        return {"name": self.name, "ok": self.ok, "detail": self.detail}


def random_values(rng: np.random.Generator, shape: tuple[int, ...], dtype: object, positive: bool = False) -> np.ndarray:
    """uint16 patterns of random values with magnitudes in [2^-6, ~5] (keeps MMA sums exact)."""
    x = rng.uniform(2.0**-6, 1.0, shape) if positive else rng.standard_normal(shape)
    x = np.where(np.abs(x) < 2.0**-6, np.copysign(2.0**-6, x), x)
    return hw.encode(x, dtype)


def chunked_reference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """fp32 ``a @ b`` accumulated per 16-wide k chunk: ``acc = fp32(acc + a[:, c] @ b[c, :])``.

    ``a``, ``b``: float64 values of 16-bit inputs.
    """
    acc = np.zeros((a.shape[0], b.shape[1]), dtype=np.float32)
    for k0 in range(0, a.shape[1], 16):
        acc = (acc.astype(np.float64) + a[:, k0 : k0 + 16] @ b[k0 : k0 + 16, :]).astype(np.float32)
    return acc


def _compare(name: str, got: np.ndarray, want: np.ndarray, what: str) -> FragmentCheck:
    bad = got.view(np.uint32) != want.view(np.uint32)
    if not bad.any():
        return FragmentCheck(name, True, f"{what}: bit-exact in fp32 ({got.shape[0]}x{got.shape[1]} per warp)")
    r, c = np.argwhere(bad)[0]
    return FragmentCheck(
        name, False,
        f"{what}: {int(bad.sum())} of {bad.size} elements differ; first at (row {r}, col {c}): "
        f"simulated {got[r, c]!r}, numpy {want[r, c]!r}",
    )


def _stage(plan: KernelPlan, traces: dict[str, CopyTrace], tiles: dict[str, np.ndarray]) -> np.ndarray:
    image = cta_smem_image(plan)
    for op, tile in tiles.items():
        g2s_store(traces[f"g2s_{op}"], tile, image)
    return image


def check_S(plan: KernelPlan, seed: int = 0, traces: dict[str, CopyTrace] | None = None) -> FragmentCheck:
    """S = Q K^T of every warp, through g2s + ldmatrix + simulated MMA, equals numpy bit for bit."""
    cfg = plan.cfg
    traces = trace_plan(plan) if traces is None else traces
    rng = np.random.default_rng(seed)
    q = random_values(rng, (cfg.B_r, cfg.d_head), cfg.dtype)
    k = random_values(rng, (cfg.B_c, cfg.d_head), cfg.dtype)
    try:
        image = _stage(plan, traces, {"Q": q, "K": k})
        addr_q = operand_addresses(traces["s2r_Q"])
        addr_k = operand_addresses(traces["s2r_K"])
        qv = hw.decode(q, cfg.dtype).astype(np.float64)
        kv = hw.decode(k, cfg.dtype).astype(np.float64)
        rpw = cfg.rows_per_warp
        kpad = plan.gemm_S.k  # the MMAs cover d_head rounded up to 16; padding columns are zero
        qv = np.pad(qv, ((0, 0), (0, max(0, kpad - cfg.d_head))))
        kv = np.pad(kv, ((0, 0), (0, max(0, kpad - cfg.d_head))))
        for w in range(cfg.n_warps):
            q_res = load_resident_Q(plan, image, addr_q, w) if plan.s2r["Q"].resident else None
            got = acc_to_matrix(warp_gemm_S(plan, image, addr_q, addr_k, w, q_res))
            want = chunked_reference(qv[w * rpw : (w + 1) * rpw, :kpad], kv[:, :kpad].T)
            res = _compare("S", got, want, f"S = Q K^T ({cfg.dtype}), warp {w}")
            if not res.ok:
                return res
    except (ValueError, IndexError) as exc:
        return FragmentCheck("S", False, f"S = Q K^T: simulation failed: {exc}")
    return FragmentCheck("S", True, f"S = Q K^T ({cfg.dtype}): bit-exact in fp32 for all {cfg.n_warps} warps ({rpw}x{cfg.B_c} each)")


def check_O(plan: KernelPlan, seed: int = 1, traces: dict[str, CopyTrace] | None = None) -> FragmentCheck:
    """O = P V of every warp (P repacked from an S accumulator, V by ldmatrix.trans) equals numpy."""
    cfg = plan.cfg
    traces = trace_plan(plan) if traces is None else traces
    rng = np.random.default_rng(seed)
    v = random_values(rng, (cfg.B_c, cfg.d_head), cfg.dtype)
    rpw = cfg.rows_per_warp
    try:
        image = _stage(plan, traces, {"V": v})
        addr_v = operand_addresses(traces["s2r_V"])
        vv = hw.decode(v, cfg.dtype).astype(np.float64)
        for w in range(cfg.n_warps):
            p32 = rng.uniform(2.0**-6, 1.0, (rpw, cfg.B_c)).astype(np.float32)
            s_acc = matrix_to_acc(p32)  # an S accumulator holding P (fp32)
            p_frag = pack_P(s_acc, cfg.dtype)
            o_acc = np.zeros((cfg.m_tiles_per_warp, plan.gemm_O.n_tiles, 32, 4), dtype=np.float32)
            got = acc_to_matrix(warp_gemm_O(plan, image, addr_v, w, p_frag, o_acc))
            p16 = hw.decode(hw.encode(p32, cfg.dtype), cfg.dtype).astype(np.float64)
            want = chunked_reference(p16, np.pad(vv, ((0, 0), (0, max(0, got.shape[1] - cfg.d_head)))))
            res = _compare("O", got, want, f"O = P V ({cfg.dtype}, V by ldmatrix.trans), warp {w}")
            if not res.ok:
                return res
    except (ValueError, IndexError) as exc:
        return FragmentCheck("O", False, f"O = P V: simulation failed: {exc}")
    return FragmentCheck("O", True, f"O = P V ({cfg.dtype}, V by ldmatrix.trans): bit-exact in fp32 for all {cfg.n_warps} warps ({rpw}x{cfg.d_head} each)")


def check_fragments(plan: KernelPlan, traces: dict[str, CopyTrace] | None = None, seed: int = 0) -> dict[str, FragmentCheck]:
    """Both fragment checks, keyed ``"S"`` and ``"O"``."""
    traces = trace_plan(plan) if traces is None else traces
    return {"S": check_S(plan, seed, traces), "O": check_O(plan, seed + 1, traces)}
