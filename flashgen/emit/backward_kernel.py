"""BackwardPlan -> CUDA C++ translation unit of the attention backward (mma.sync; pure, deterministic).

Three kernels and one launcher:

* ``preprocess``: ``D = rowsum(dO * O)`` per query row (the plan's :class:`RowDot` rule), and the dQ buffer zeroed
  (:mod:`flashgen.emit.backward_aux`, which both engines share);
* ``kernel``: one CTA per (key block, kv head, batch entry), on the plan's :class:`BackwardGrid` (its
  block's decode and the launch's grid), walking the plan's schedule over the query blocks of its group's
  heads (:class:`QueryBlocks`); dQ added into an fp32 buffer;
* ``convert_dq``: dQ = the buffer times the softmax scale, in the inputs' dtype;
* ``<name>_launch``: the three in order; the buffer and D live in the launch's workspace
  (``<name>_workspace``).

``deterministic``: the workspace's zeroed part holds one turn counter per (batch, query head, query block);
the CTA of key block ``kb`` adds its dQ of a query block when the counter equals its rank among the
key blocks that visit the block (:meth:`QueryBlocks.key_rank`) and then increments it, so every dQ
element is summed in ascending key blocks. Deadlock freedom: a CTA waits only for CTAs of the same
(kv head, batch) and lower key blocks, which have lower linear block indices in either grid order
(:class:`BackwardGrid`);
it relies on the hardware dispatching CTAs in linear block order (a CTA is resident no later than
those after it), so the lowest unfinished key block always runs and never waits.

Every shared-memory address comes from the plan's index functions (``<copy>_smem``), every
fragment's (row, column) from the MMA's C map, every rule from its object's ``to_cpp``; the
``-DFLASHGEN_INDEX_ONLY`` host build keeps the index functions and rules only.
"""
from __future__ import annotations

import json

from ..attention.backward_grid import BATCH
from ..dsl.atoms.mma import accumulator_as_a_operand
from ..dsl.backward_plan import STATS, STREAMED, BackwardPlan
from ..dsl.plan import OperandLoad, TiledCopy, WarpGemm
from ..dsl.steps import J, Barrier, Commit, Copy, Gemm, GradScores, RecomputeP, ReduceGM, SignalOrder, Step, StoreRF, Wait, WaitOrder
from ..dsl.addressing import split_offsets
from .kernel import TARGET, _base_decl, _offset_fn, _partition_fns, _row_walk_step, _smem_addr, _split_tables
from .ptx import cp_async, ldmatrix, math as ptx_math, mma as ptx_mma, red, sreg, turns, vec
from .ptx.used import HELPERS_MARK, insert_used
from .abi import backward_args_struct
from .backward_aux import aux_kernels, convert_grid
from .source import KernelSource, kernel_meta
from .template import CodeTemplate, compose

__all__ = ["TARGET", "emit_backward"]

#: shared tensors with an offset function, and the 16-bit tiles with a base address (and ``sP`` where the plan has it)
_SMEM_TENSORS = ("sK", "sV", "sQ", "sdO", "sdS", "sdS_t", "sdK", "sdV")



def _optional_tiles(plan: BackwardPlan) -> tuple[str, ...]:
    """The 16-bit tiles only some plans have: ``sP`` (``split_scores``)."""
    return tuple(t for t in ("sP",) if t in plan.tensors)


def _smem_tensors(plan: BackwardPlan) -> tuple[str, ...]:
    return _SMEM_TENSORS + _optional_tiles(plan)


def _params(copy: TiledCopy) -> list[str]:
    part = copy.partition
    thread = "tid" if copy.scope == "cta" else "lane"
    return [thread, "v"] + (["warp"] if part.uses_warp else []) + [l.name for l in part.loops]


def _call(copy: TiledCopy, suffix: str, **args: str) -> str:
    """``<copy>_<suffix>(...)`` with the named arguments (``v`` and loops default to 0)."""
    return f"{copy.name}_{suffix}({', '.join(args.get(p, '0') for p in _params(copy))})"


def _addr(copy: TiledCopy, base: str | None = None, **idx: str) -> str:
    """Shared-memory byte address of ``copy`` at compile-time index ``idx`` (``v`` and loops, default
    0) from the tile's address ``base``: the thread's base, xor and add tables
    (:func:`flashgen.dsl.addressing.split_offsets`)."""
    return _smem_addr(copy, [idx.get(n, "0") for n in ["v"] + [l.name for l in copy.partition.loops]], base)


def _bases(plan: BackwardPlan) -> list[str]:
    """Each shared-memory copy's per-thread base offset (its index 0)."""
    out = []
    for _, copy in plan.copies():
        params = _params(copy)
        out.append(_base_decl(copy, [params[0]] + (["warp"] if "warp" in params else [])))
    return out


def _red_fns(copy: TiledCopy) -> str:
    """Row and column functions of the dQ reduction (global side only)."""
    part = copy.partition
    r, c = part.coord_cpp("lane", "v")
    sig = ", ".join(f"uint32_t {p}" for p in _params(copy))
    steps = [p for p in _params(copy) if p not in ("lane", "warp")]
    at = {"lane": "0u", "warp": "0u"}
    step_sig = ", ".join(f"uint32_t {p}" for p in steps)
    step_fns = [f"__host__ __device__ __forceinline__ int {copy.name}_d{s}({step_sig}) "
                f"{{ return int({copy.name}_{s}({', '.join(at.get(p, p) for p in _params(copy))})) - "
                f"int({copy.name}_{s}({', '.join(at.get(p, '0u') for p in _params(copy))})); }}" for s in ("row", "col")]
    return (f"// {copy.name}: {copy.atom.name}; thread-value map {part.tv}; warp w adds {part.warp_text()}\n"
            f"__host__ __device__ __forceinline__ uint32_t {copy.name}_row({sig}) {{ return {r}; }}\n"
            f"__host__ __device__ __forceinline__ uint32_t {copy.name}_col({sig}) {{ return {c}; }}\n"
            "// the (row, column) step from a thread's value 0 at loop index 0 to its value v at the loop indices: the same\n"
            "// in every lane and warp (the maps are layouts, linear in each coordinate)\n" + "\n".join(step_fns))


def index_functions(plan: BackwardPlan) -> list[tuple[str, list[str]]]:
    """(function name, parameter names) of every emitted index function, for host tests."""
    out = [(f"{t}_offset", ["row", "col"]) for t in _smem_tensors(plan)]
    for _, copy in plan.copies():
        out += [(f"{copy.name}_{s}", _params(copy)) for s in ("row", "col", "smem")]
    steps = [p for p in _params(plan.red_dQ) if p not in ("lane", "warp")]
    return out + [(f"{plan.red_dQ.name}_{s}", _params(plan.red_dQ)) for s in ("row", "col")] + [
        (f"{plan.red_dQ.name}_d{s}", steps) for s in ("row", "col")]


def _index_section(plan: BackwardPlan) -> str:
    parts = [_offset_fn(f"{t}_offset", t, plan.tensors[t].layout) for t in _smem_tensors(plan)]
    parts += [_partition_fns(copy, _params(copy)[0], _params(copy)) for _, copy in plan.copies()]
    return "\n\n".join(parts + [_red_fns(plan.red_dQ)])


# ---- the kernel body's pieces ----------------------------------------------------------


def _g2s_lambda(plan: BackwardPlan, name: str) -> str:
    """``copy_<name>(tile, src, ld, rows_valid)``: to the tile at shared address ``tile``; rows >=
    rows_valid and columns >= d_head zero-filled. The thread's first chunk is addressed once and the others
    lie compile-time steps from it (one 64-bit add each where the chunks walk rows); a block whose rows all
    exist copies without predicates (the per-chunk 64-bit address and selects had cost about ten
    instructions a chunk, issued by every warp at once after the opening barrier)."""
    copy = plan.g2s[name]
    n = copy.partition.tv.n_values
    split = split_offsets(copy)
    step = _row_walk_step(split)
    dst = _addr(copy, "tile", v="v")
    lines = [f"const uint32_t row0 = {_call(copy, 'row', tid='tid')}, col0 = {_call(copy, 'col', tid='tid')};",
             "const elem_t* g = src + int64_t(row0) * ld + col0;"]
    if step is not None:  # value v is `step` rows below value v-1: one pointer walks them
        lines += [f"const int64_t step_ld = {step} * ld;"]
        src, row, col = "g + int64_t(v) * step_ld", f"row0 + v * {step}u", "col0"
    else:
        src, row, col = (f"g + int64_t({copy.name}_drow[v]) * ld + {copy.name}_dcol[v]",
                         f"row0 + {copy.name}_drow[v]", f"col0 + {copy.name}_dcol[v]")
    pad = plan.cfg.d_smem > plan.cfg.d_head  # padding columns: every block checks them
    ok = f"(int)({row}) < rows_valid" + (f" && {col} < D_HEAD" if pad else "")
    # an invalid chunk reads nothing (src-size 0) and lands as zeros; its source address is the block's first row
    checked = ["#pragma unroll", f"for (uint32_t v = 0; v < {n}; ++v) {{", f"    const bool ok = {ok};",
               f"    cp_async_16_zfill({dst}, ok ? {src} : src, ok);", "}"]
    if pad:
        body = checked
    else:
        rows = plan.cfg.B_r if name in STREAMED else plan.cfg.B_c
        body = ([f"if (rows_valid >= {rows}) {{  // every row of the block exists", "    #pragma unroll",
                 f"    for (uint32_t v = 0; v < {n}; ++v) cp_async_16({dst}, {src});", "} else {"]
                + ["    " + l for l in checked] + ["}"])
    return (
        f"// {copy.name}: {copy.atom.name}, {copy.src.name} -> {copy.dst.name} ({copy.dst.layout}), {n} x 16 B per thread\n"
        f"auto copy_{name} = [&](uint32_t tile, const elem_t* src, int64_t ld, int rows_valid) {{\n"
        + "\n".join("    " + l for l in lines + body) + "\n};"
    )


def _load(load: OperandLoad, frag: str, outer: str, extent: str) -> list[str]:
    """ldmatrix of one k16 step ``kk`` of an operand for every index of its other loop."""
    copy = load.copy
    fn = ldmatrix.helper_name(copy.atom)
    return [f"#pragma unroll", f"for (uint32_t {outer} = 0; {outer} < {extent}; ++{outer}) {fn}({frag}[{outer}], {_addr(copy, kk='kk', **{outer: outer})});"]


def _zero(acc: str, m: str, n: str) -> list[str]:
    return [f"float {acc}[{m}][{n}][4];", f"#pragma unroll", f"for (uint32_t mi = 0; mi < {m}; ++mi)", "    #pragma unroll",
            f"    for (uint32_t nt = 0; nt < {n}; ++nt) {acc}[mi][nt][0] = {acc}[mi][nt][1] = {acc}[mi][nt][2] = {acc}[mi][nt][3] = 0.f;"]


def _gemm(g: WarpGemm, acc: str, a_acc: str | None, passes: int = 1) -> list[str]:
    """``acc += A B`` over k16 steps ``kk``; A from shared memory (ldmatrix) or, ``a_acc``, from an
    accumulator packed to 16 bits (n tiles (2kk, 2kk+1) form A operand kk). B is loaded one x4
    (two n8 tiles, :meth:`OperandLoad.b_operand_regs`) at a time, so only 4 of its registers live.
    ``passes`` > 1: inside a loop over ``pass``, only that pass's slice of the x4 loads ``nn``, into
    ``acc``'s slots of the slice (``n2``)."""
    mt, nt, steps = g.m_tiles, g.n_tiles, g.k // 16
    lines = [f"uint32_t a[{mt}][4];"]
    if a_acc is None:
        lines += _load(g.a, "a", "mi", str(mt))
    else:
        lines += ["#pragma unroll", f"for (uint32_t mi = 0; mi < {mt}; ++mi) {{"]
        for r in range(4):
            off, c0 = accumulator_as_a_operand(0, r)
            lines.append(f"    a[mi][{r}] = pack2({a_acc}[mi][2 * kk + {off}][{c0}], {a_acc}[mi][2 * kk + {off}][{c0 + 1}]);")
        lines.append("}")
    per = OperandLoad.N_TILES_PER_X4
    slot, n_loop = "nn", [f"for (uint32_t nn = 0; nn < {nt // per}; ++nn) {{"]
    if passes > 1:
        n = nt // per // passes
        slot, n_loop = "n2", [f"for (uint32_t n2 = 0; n2 < {n}; ++n2) {{", f"    const uint32_t nn = pass * {n}u + n2;"]
    mmas = []
    for t in range(per):
        _, (b0, b1) = OperandLoad.b_operand_regs(t)
        mmas.append(f"        mma_16816({acc}[mi][{slot} * {per} + {t}], a[mi], b[{b0}], b[{b1}]);")
    copy = g.b.copy
    lines += ["#pragma unroll", *n_loop, "    uint32_t b[4];",
              f"    {ldmatrix.helper_name(copy.atom)}(b, {_addr(copy, kk='kk', nn='nn')});",
              "    #pragma unroll", f"    for (uint32_t mi = 0; mi < {mt}; ++mi) {{"] + mmas + ["    }", "}"]
    return [f"// {g.name}: warp tile {16 * mt} x {8 * nt}, reduction {g.k} in k16 steps", "#pragma unroll",
            f"for (uint32_t kk = 0; kk < {steps}; ++kk) {{"] + ["    " + l for l in lines] + ["}"]


_ACC = {"S": ("s_acc", None), "dP": ("dp_acc", None), "dV": ("dv_acc", "s_acc"), "dK": ("dk_acc", "dp_acc"), "dQ": ("dq_acc", None)}


def _gemm_code(plan: BackwardPlan, step: Gemm) -> list[str]:
    g = plan.gemms[step.arg]
    acc, a_acc = _ACC[step.arg]
    a_acc = a_acc if g.a is None else None  # else A from shared memory (split_scores: P^T, dS^T)
    if step.arg == "dQ" and plan.dq_passes > 1:
        return _dq_passes_code(plan)
    fresh = step.arg in ("S", "dP", "dQ")
    return (_zero(acc, str(g.m_tiles), str(g.n_tiles)) if fresh else []) + ["{"] + ["    " + l for l in _gemm(g, acc, a_acc)] + ["}"]


#: a step's own lane and warp (:func:`flashgen.emit.ptx.sreg.helpers`): the per-thread indices the step derives
#: from them (the score's key row and query column, the mods' index arithmetic, the dQ adds' rows and columns)
#: are recomputed in it, not held in registers across the query-block loop beside dK and dV (held, the kernels
#: with a score_mod or mask_mod spilled at d_head 128)
FRESH_LANE = "const uint32_t tid_f = fresh_tid(), lane_f = tid_f % 32, warp_f = tid_f / 32;"


def _lanes(plan: BackwardPlan) -> tuple[list[str], str, str]:
    """(the lines opening a per-value step, its lane's name, its warp's name): its own (:data:`FRESH_LANE`) with a
    score_mod / mask_mod or up to d_head 128; past d_head 128 without mods the kernel's, since its registers sit at
    the cap either way and the recomputed indices only cost time (H100, d_head 256: 1.2-1.6% slower)."""
    if plan.score_mask.mods is not None or plan.cfg.d_head <= 128:
        return [FRESH_LANE], "lane_f", "warp_f"
    return [], "lane", "warp"


def _score_tiles(plan: BackwardPlan) -> str:
    """The n8 tiles of a warp's S^T and dP^T: all the query block's, or its columns' (``split_scores``)."""
    n = plan.gemms["S"].n_tiles
    return "B_r / 8" if 8 * n == plan.cfg.B_r else f"{n}u"


def _per_value(plan: BackwardPlan, lines: list[str]) -> list[str]:
    """``lines`` for every S^T / dP^T accumulator value (mi, nt, r) with its key row (the warp's rows
    of the S GEMM's A operand) and query column (the warp's rows of its B operand), in a block of its own
    lane and warp where :func:`_lanes` says so."""
    c = plan.mma.c_map
    opening, lane, warp = _lanes(plan)
    warp_rows, _ = plan.gemms["S"].a.copy.partition.warp_offset_cpp(warp)
    warp_cols, _ = plan.gemms["S"].b.copy.partition.warp_offset_cpp(warp)
    first = "" if warp_cols == "0" else f"{warp_cols} + "
    loops = [
        "#pragma unroll", "for (uint32_t mi = 0; mi < MK; ++mi)", "    #pragma unroll", f"    for (uint32_t nt = 0; nt < {_score_tiles(plan)}; ++nt)",
        "        #pragma unroll", "        for (uint32_t r = 0; r < 4; ++r) {",
        f"            const int key = kb * int(B_c) + int({warp_rows} + mi * 16 + {c.row.to_cpp([lane, 'r'])});",
        f"            const int qc = int({first}nt * 8 + {c.col.to_cpp([lane, 'r'])});  // query row q_row0 + qc",
        "            (void)key;",
    ] + ["            " + l for l in lines] + ["        }"]
    return ["{"] + ["    " + l for l in opening + loops] + ["}"]


def _recompute_code(plan: BackwardPlan, step: Step) -> list[str]:
    """P^T from S^T; where the score_mod's derivative reads the score, dS^T too (dP^T is ready: see the schedule)."""
    mask = plan.score_mask
    needs = "bwd_block_needs_mask(qb, kb, p.seq_q, p.seq_k, p.mask_offset, p.window_left, p.window_right)"
    fused = mask.derivative_reads_score
    return [f"const bool masked = {mask.backward_masked_cpp(needs)};"] + mask.backward_items_cpp(
        lambda lines: _per_value(plan, lines), lambda masked: [
            "float s = s_acc[mi][nt][r];", *(["float g;  // d score_mod / d score"] if fused else []),
            *mask.recompute_cpp("s", "q_row0 + qc", "key", "batch", "head", "g", masked),
            "s_acc[mi][nt][r] = bwd_prob(s, p.scale_log2, bwd_lse_log2(sLSE[qc]));",
        ] + (_grad_lines(plan, "g") if fused else []))


def _grad_lines(plan: BackwardPlan, grad: str) -> list[str]:
    at = "[mi][nt][r]"
    return [f"dp_acc{at} = bwd_dscore(s_acc{at}, dp_acc{at}, sD[qc]);",
            *plan.score_mask.score_grad_cpp(f"dp_acc{at}", f"s_acc{at}", "q_row0 + qc", "key", "batch", "head", grad)]


def _grad_scores_code(plan: BackwardPlan, step: Step) -> list[str]:
    if plan.score_mask.derivative_reads_score:
        return ["// made with P^T (the score_mod's derivative reads the score)"]
    return _per_value(plan, _grad_lines(plan, ""))


#: a stored accumulator's registers: P^T in the S^T accumulator, dS^T in the dP^T one
_STORED = {"P": "s_acc", "dS": "dp_acc"}


def _store_code(plan: BackwardPlan, step: Step) -> list[str]:
    """A warp's P^T or dS^T -> shared memory (its ``r2s`` copy), two 16-bit values a word."""
    addr, acc = _addr(plan.r2s[step.arg], v="2 * h", mi="mi", nt="nt"), _STORED[step.arg]
    lines = ["#pragma unroll", "for (uint32_t mi = 0; mi < MK; ++mi)", "    #pragma unroll", f"    for (uint32_t nt = 0; nt < {_score_tiles(plan)}; ++nt)",
             "        #pragma unroll", "        for (uint32_t h = 0; h < 2; ++h)",
             f"            st_shared_b32({addr}, pack2({acc}[mi][nt][2 * h], {acc}[mi][nt][2 * h + 1]));"]
    every = plan.ds_store_every
    if every == 1:
        return lines
    return [f"if (warp % {every}u == 0) {{  // the group's other warps hold the same dS^T"] + ["    " + l for l in lines] + ["}"]


def _reduce_dq_code(plan: BackwardPlan, step: Step, passes: int = 1) -> list[str]:
    """The dQ accumulator added into the fp32 buffer, one 16-byte reduction per 16 x 8 tile at the tile's slot of the
    query block's chunk (:class:`~flashgen.dsl.dq_fragments.DqFragments`); ``passes`` > 1: the slice of pass ``pass``
    (:func:`_dq_passes_code`, which adds each slice itself: the step alone then emits nothing). The chunk holds the
    block's every row, so no add checks its row; columns past d_head (padding of dQ's tiles) are skipped."""
    if plan.dq_passes > 1 and passes == 1:
        return ["// added by the dQ GEMM's passes"]
    opening, lane, warp = _lanes(plan)  # for the padding columns' check
    cols = _dq_cols_name(plan)
    slot, n_loop = "nt", [f"    for (uint32_t nt = 0; nt < {cols} / 8; ++nt)"]
    if passes > 1:
        slot, n_loop = "n4", [f"    for (uint32_t n4 = 0; n4 < {cols} / 8 / {passes}; ++n4) {{",
                              f"        const uint32_t nt = pass * ({cols} / 8 / {passes}) + n4;"]
    acc = ", ".join(f"dq_acc[mi][{slot}][{r}]" for r in range(4))
    # tile (mi, nt)'s slot is a compile-time step from the thread's slot of tile (0, 0): an immediate offset
    add = f"red_add_f32x4(gdQ_t + dq_slot(0u, 0u, mi, nt), {acc});"
    first = ([] if passes > 1 else _dq_advance()) + ["float* const gdQ_t = dq_t;"]
    if plan.dq_fragments.cols > plan.cfg.d_head:  # the tiles' padding columns are never read
        first += opening + [f"const uint32_t col0 = {_call(plan.red_dQ, 'col', lane=lane, warp=warp)};"]
        add = f"if (col0 + {plan.red_dQ.name}_dcol(0u, mi, nt) < D_HEAD) {add}"
    # a warp-uniform branch, always taken (every item's head is one of the heads), that ptxas does not schedule across:
    # without it, it mixed the adds into the GEMMs before them and spilled (d_head 64 on 4 warps: 208 bytes; other
    # always-true conditions left 8-16 bytes at d_head 64 on 8 warps, causal)
    lines = ["if (head < p.heads) {", "    #pragma unroll", "    for (uint32_t mi = 0; mi < MQ; ++mi)", "        #pragma unroll",
             *["    " + l for l in n_loop], "            " + add] + (["        }"] if passes > 1 else []) + ["}"]
    return ["{"] + ["    " + l for l in first + lines] + ["}"]


#: the thread's slot of tile (0, 0) in the chunk of the item whose dQ is added next, made once before the items' loop
_DQ_CURSOR = ["// this thread's slot of tile (0, 0) in the chunk of the item whose dQ is added next (the buffer's fragment order),",
              "// carried from item to item (item_step) where the adds start, so that no other value takes its registers while",
              "// the last item's adds may still read them",
              "float* dq_t = p.dq_accum + (batch64 * p.heads + kv_head * p.kv_group) * dq_head_rows(p.seq_q) * D_HEAD",
              "              + int64_t(qb_begin) * DQ_CHUNK + dq_slot(lane, warp, 0u, 0u);"]


def _dq_advance() -> list[str]:
    """``dq_t`` moved from the previous item's chunk to this item's (the walk of the plan's ``items``)."""
    return ["if (w > 0) dq_t += item_step(head - kv_head * p.kv_group, qb - qb_begin, n_q, p.kv_group, DQ_CHUNK,",
            "                             int64_t(dq_head_rows(p.seq_q)) * D_HEAD);"]


def _dq_cols_name(plan: BackwardPlan) -> str:
    """The constant naming dQ's columns per warp: ``DW`` where dQ's warp grid is dK and dV's, else ``DQW``
    (``dq_split``: :func:`_col_constants`)."""
    return "DW" if plan.gemms["dQ"].n_tiles == plan.gemms["dV"].n_tiles else "DQW"


def _col_constants(plan: BackwardPlan) -> list[str]:
    """The kernel's constants of the columns per warp, from the dV and dQ GEMMs' n8 tiles."""
    dw, qw = 8 * plan.gemms["dV"].n_tiles, 8 * plan.gemms["dQ"].n_tiles
    if _dq_cols_name(plan) == "DW":
        return [f"constexpr uint32_t DW = {dw};  // columns of dK, dV and dQ per warp (of D_MMA)"]
    return [f"constexpr uint32_t DW = {dw};  // columns of dK and dV per warp (of D_MMA)",
            f"constexpr uint32_t DQW = {qw};  // columns of dQ per warp (dQ's own warp grid: dq_split {plan.cfg.dq_split})"]


def _dq_passes_code(plan: BackwardPlan) -> list[str]:
    """The dQ GEMM and its adds in ``plan.dq_passes`` passes over slices of the warp's columns: a slice's
    accumulators, its GEMM (the dS fragments reloaded each pass) and its adds. The adds' step must follow the
    GEMM's in the schedule (they are made here)."""
    body = plan.schedule.body
    at = body.index(next(s for s in body if isinstance(s, Gemm) and s.arg == "dQ"))
    if at + 1 == len(body) or not isinstance(body[at + 1], ReduceGM):
        raise ValueError(f"{plan.cfg.short_form()}: the dQ GEMM in {plan.dq_passes} passes adds each pass's slice, so the "
                         "schedule's dQ adds must follow it directly")
    g, passes = plan.gemms["dQ"], plan.dq_passes
    lines = _zero("dq_acc", str(g.m_tiles), str(g.n_tiles // passes)) + ["{"] + ["    " + l for l in _gemm(g, "dq_acc", None, passes)]
    lines += ["}"] + _reduce_dq_code(plan, body[at + 1], passes)
    return _dq_advance() + [f"// in {passes} passes of {8 * g.n_tiles // passes} columns, each added as soon as it is made (fewer live accumulators)",
            "#pragma unroll", f"for (uint32_t pass = 0; pass < {passes}; ++pass) {{"] + ["    " + l for l in lines] + ["}"]


#: this (batch, query head, query block)'s turn counter of the ordered dQ adds
_DQ_TURN = "p.dq_turns + (batch64 * p.heads + head) * ((p.seq_q + int(B_r) - 1) / int(B_r)) + qb"


def _wait_order_code(plan: BackwardPlan, step: Step) -> list[str]:
    """One thread spins until the key blocks below this one that visit the query block have added,
    then a barrier holds the CTA's adds behind it."""
    return [*plan.grid.wait_note(),
            "if (tid == 0) turn_wait(" + _DQ_TURN + ", key_rank(qb, kb, p.seq_q, p.seq_k, p.mask_offset, p.window_left, p.window_right));",
            "__syncthreads();"]


def _signal_order_code(plan: BackwardPlan, step: Step) -> list[str]:
    """After the barrier behind every warp's adds: the next visiting key block's turn (fence + add)."""
    return [f"if (tid == 0) turn_pass({_DQ_TURN});"]


#: a streamed tensor's (source base, row stride) in the kernel's parameters, per query head ``it.head``
_SOURCES = {"Q": ("p.q + batch64 * p.q_batch + it.head * p.q_head", "p.q_ld"),
            "dO": ("p.dout + batch64 * p.do_batch + it.head * p.do_head", "p.do_ld"),
            "LSE": ("p.lse + (batch64 * p.heads + it.head) * p.seq_q", ""),
            "D": ("p.delta + (batch64 * p.heads + it.head) * p.seq_q", "")}


def _copy_code(plan: BackwardPlan, step: Copy) -> list[str]:
    """K and V of the key block; a streamed tile or statistic of work item ``step.block`` into its stage."""
    name = step.arg
    if name in ("K", "V"):
        return [f"copy_{name}(s{name}_addr, g{name}, p.{name.lower()}_ld, p.seq_k - kb * int(B_c));"]
    block = step.block or J
    w = block.to_cpp(j="w", begin="0", end="work")
    src, ld = _SOURCES[name]
    stage = f" + uint32_t({w} % STAGES) * {plan.stage_bytes[name]}u" if block.base == "j" else ""  # the first: stage 0
    dst = f"s{name}_stage0{stage}"
    if name in STATS and plan.stats[name].atom.is_async:
        copy = [f"const float* src = {src};", f"const uint32_t dst = {dst};",
                "for (uint32_t i = tid; i < B_r; i += THREADS) {",
                "    const bool ok = it.q_row0 + int(i) < p.seq_q;",
                "    cp_async_4_zfill(dst + 4u * i, ok ? src + it.q_row0 + int(i) : src, ok);", "}"]
    elif name in STATS:
        copy = [f"const float* src = {src};", f"float* dst = reinterpret_cast<float*>(smem_raw + ({dst} - smem));",
                "for (uint32_t i = tid; i < B_r; i += THREADS) dst[i] = it.q_row0 + int(i) < p.seq_q ? src[it.q_row0 + int(i)] : 0.f;"]
    else:
        copy = [f"copy_{name}({dst}, {src} + int64_t(it.q_row0) * {ld}, {ld}, p.seq_q - it.q_row0);"]
    this = "Item{head, q_row0}" if block == J else f"item({w})"  # the loop's own block: its variables
    lines = ["{", f"    const Item it = {this};"] + ["    " + l for l in copy] + ["}"]
    if step.guard is None:
        return lines
    cond = step.guard.to_cpp(begin="0", end="work", j="w" if block.base == "j" else w)
    return [f"if ({cond}) " + lines[0]] + lines[1:]


#: step class -> its code
_STEP_CODE = {
    Copy: _copy_code,
    Commit: lambda plan, step: ["cp_async_commit();"],
    Wait: lambda plan, step: [f"cp_async_wait<{step.arg}>();"],
    Barrier: lambda plan, step: ["__syncthreads();"],
    Gemm: _gemm_code,
    RecomputeP: _recompute_code,
    GradScores: _grad_scores_code,
    StoreRF: _store_code,
    ReduceGM: _reduce_dq_code,
    WaitOrder: _wait_order_code,
    SignalOrder: _signal_order_code,
}


def _steps(plan: BackwardPlan, steps) -> list[str]:
    out = []
    for step in steps:
        if step.guard is not None and not isinstance(step, Copy):
            raise ValueError(f"backward step {step}: only copies take guards")
        out += [f"// [{step}] {step.why}".rstrip()] + _STEP_CODE[type(step)](plan, step)
    return out


def _epilogue(plan: BackwardPlan) -> list[str]:
    """dK times the scale; dK, dV -> sK, sV (each warp its own rows), __syncwarp, 16-byte stores."""
    if plan.closing_barrier:
        lines = ["if (work == 0) {  // no query block ran: K and V may still be in flight before their space is reused",
                 "    cp_async_wait<0>();", "    __syncthreads();", "}"]
    else:
        lines = ["if (work == 0) cp_async_wait<0>();  // no query block ran: K and V may still be in flight",
                 "__syncthreads();  // every warp done reading sK and sV (the last block's GEMMs) before dK and dV go there"]
    lines += ["#pragma unroll", "for (uint32_t mi = 0; mi < MK; ++mi)", "    #pragma unroll", "    for (uint32_t nt = 0; nt < DW / 8; ++nt)",
              "        #pragma unroll", "        for (uint32_t r = 0; r < 4; ++r) dk_acc[mi][nt][r] = bwd_grad_scaled(dk_acc[mi][nt][r], p.scale);"]
    for name, acc, tile in (("dK", "dk_acc", "sK"), ("dV", "dv_acc", "sV")):
        r2s, s2g = plan.r2s[name], plan.s2g[name]
        addr = _addr(r2s, v="2 * h", mi="mi", nt="nt")
        lines += ["#pragma unroll", "for (uint32_t mi = 0; mi < MK; ++mi)", "    #pragma unroll", "    for (uint32_t nt = 0; nt < DW / 8; ++nt)",
                  "        #pragma unroll", "        for (uint32_t h = 0; h < 2; ++h)",
                  f"            st_shared_b32({addr}, pack2({acc}[mi][nt][2 * h], {acc}[mi][nt][2 * h + 1]));",
                  "__syncwarp();", "#pragma unroll", f"for (uint32_t v = 0; v < {s2g.partition.tv.n_values}; ++v) {{",
                  f"    const uint32_t row = {_call(s2g, 'row', lane='lane', v='v', warp='warp')}, col = {_call(s2g, 'col', lane='lane', v='v', warp='warp')};",
                  f"    if (kb * int(B_c) + int(row) < p.seq_k && col < D_HEAD)",
                  f"        st_global_v4(g{name} + int64_t(row) * p.{name.lower()}_ld + col, ld_shared_v4({_addr(s2g, v='v')}));",
                  "}"]
    return lines


# ---- the file ------------------------------------------------------------------------------

#: The file's head, index functions, mask and rules (all a -DFLASHGEN_INDEX_ONLY host build keeps).
_HEADER = CodeTemplate(
    r"""// Generated by flashgen. Do not edit: change the config and re-emit.
//
// $short_form
// knobs: $knobs_json
// grid: $grid, block: $threads threads, dynamic shared memory: $smem_bytes bytes
// schedule per query block: $schedule
#include <stdint.h>
#ifdef FLASHGEN_INDEX_ONLY
#ifndef __CUDACC__
#define __host__
#define __device__
#define __forceinline__ inline
#endif
#include <math.h>
#else
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <math.h>
#endif

namespace $name {

constexpr uint32_t B_r = $B_r, B_c = $B_c, N_WARPS = $n_warps, THREADS = $threads;
constexpr uint32_t STAGES = $stages;  // query blocks whose Q, dO, lse and D are in shared memory at once
static_assert(THREADS == 32 * N_WARPS, "one warp = 32 threads");
constexpr uint32_t D_HEAD = $d_head, D_MMA = $d_mma, D_SMEM = $d_smem;  // data, MMA-covered, shared-memory columns
static_assert(D_HEAD <= D_MMA && D_MMA <= D_SMEM && D_SMEM % 64 == 0, "tile widths");
constexpr uint32_t KR = $key_rows, MK = KR / 16;  // key rows (of dK, dV, S^T) per warp, their 16-row MMA tiles
constexpr uint32_t QR = $query_rows, MQ = QR / 16;  // query rows of dQ per warp
$col_constants

// ---- index functions: every shared-memory address of the kernel comes from these ----
$index_fns

$dq_fragment_fns

// ---- the score mask, and the mask seen from a key block ----
$mask_fns
$query_block_fns

// ---- the backward's rules ----
$rule_fns

// ---- address splits: cheap per-thread addressing derived from the functions above ----
$split_tables

}  // namespace $name"""
)

#: The device side's element type, PTX helpers and kernel parameters.
_DEVICE = CodeTemplate(
    r"""#ifndef FLASHGEN_INDEX_ONLY
namespace $name {

using elem_t = $elem_t;

// ---- PTX helpers ----
$ptx_helpers

struct Params {
    const elem_t* q; const elem_t* k; const elem_t* v; const elem_t* o; const elem_t* dout;
    elem_t* dq; elem_t* dk; elem_t* dv;
    const float* lse;  // the forward's log-sum-exp (natural log), (batch, heads, seq_q)
    const float* dlse; // the gradient of the returned lse, the same shape, or nullptr
    float* delta;      // D = rowsum(dO * O) - dlse, (batch, heads, seq_q): the workspace's
    float* dq_accum;   // fp32 dQ sums, (batch, heads) x dq_head_rows(seq_q) x D_HEAD, chunks in fragment order (DqFragments): the workspace's, zeroed by the preprocess
    int* dq_turns;     // deterministic: key blocks done adding dQ, (batch, heads, query blocks), zero at launch; else nullptr
    int64_t q_batch, q_head, q_ld, k_batch, k_head, k_ld, v_batch, v_head, v_ld;
    int64_t o_batch, o_head, o_ld, do_batch, do_head, do_ld;
    int64_t dq_batch, dq_head, dq_ld, dk_batch, dk_head, dk_ld, dv_batch, dv_head, dv_ld;
    int heads, seq_q, seq_k, kv_group;
    int mask_offset, window_left, window_right;
    float scale, scale_log2;
    $mod_params
};"""
)

#: The main kernel: one key block of one kv head, over the query blocks of its group's heads.
_KERNEL = CodeTemplate(
    r"""__global__ void __launch_bounds__(THREADS, 1) kernel(const __grid_constant__ Params p) {  // 1: no register cap for occupancy (ptxas spilled for it)
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const uint32_t smem = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
    $smem_addrs
    const uint32_t sdS_t_addr = sdS_addr, sdK_addr = sK_addr, sdV_addr = sV_addr;  // the same memory, other coordinates
    const uint32_t sLSE_stage0 = smem + $sLSE_offset, sD_stage0 = smem + $sD_offset;
    const uint32_t tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    $cta
    (void)batch;  // read where a score_mod, a mask_mod or the ordered dQ adds are
    // the batch index for 64-bit address math, widened from the unsigned $batch_index: known non-negative, so
    // no sign word lives in a register across the query-block loop (with it the score_mod kernels spilled)
    const int64_t batch64 = $batch_index;
    const elem_t* gK = p.k + batch64 * p.k_batch + kv_head * p.k_head + int64_t(kb) * B_c * p.k_ld;
    const elem_t* gV = p.v + batch64 * p.v_batch + kv_head * p.v_head + int64_t(kb) * B_c * p.v_ld;
    elem_t* gdK = p.dk + batch64 * p.dk_batch + kv_head * p.dk_head + int64_t(kb) * B_c * p.dk_ld;
    elem_t* gdV = p.dv + batch64 * p.dv_batch + kv_head * p.dv_head + int64_t(kb) * B_c * p.dv_ld;
    int qb_begin, qb_end;  // query blocks holding kept scores of this key block
    q_block_range(kb, p.seq_q, p.seq_k, p.mask_offset, p.window_left, p.window_right, &qb_begin, &qb_end);
    $block_mask_clip
    const int n_q = qb_end - qb_begin, work = n_q * p.kv_group;  // (query head of the group, query block) pairs
    struct Item { int head, q_row0; };  // work item w: its query head and first query row
    auto item = [&](int w) { return Item{kv_head * p.kv_group + w / n_q, (qb_begin + w % n_q) * int(B_r)}; };
    $bases

    $g2s_K
    $g2s_V
    $g2s_Q
    $g2s_dO

    float dk_acc[MK][DW / 8][4], dv_acc[MK][DW / 8][4];
    #pragma unroll
    for (uint32_t mi = 0; mi < MK; ++mi)
        #pragma unroll
        for (uint32_t nt = 0; nt < DW / 8; ++nt)
            #pragma unroll
            for (uint32_t r = 0; r < 4; ++r) dk_acc[mi][nt][r] = dv_acc[mi][nt][r] = 0.f;

    // ---- prologue ----
    $prologue

    $dq_cursor
    // ---- the query blocks of every query head of the group ----
    for (int w = 0; w < work; ++w) {
        const int head = item(w).head, q_row0 = item(w).q_row0, qb = q_row0 / int(B_r);
        const uint32_t stage = uint32_t(w % STAGES);  // this block's Q, dO, lse and D
        $stage_addrs
        const float* sLSE = reinterpret_cast<const float*>(smem_raw + (sLSE_stage0 - smem) + stage * $stats_bytes);
        const float* sD = reinterpret_cast<const float*>(smem_raw + (sD_stage0 - smem) + stage * $stats_bytes);
        $body
    }

    // ---- epilogue ----
    $epilogue
}

}  // namespace $name"""
)

#: The C entry points: the workspace (dQ buffer, D) and the launch of the three kernels.
_LAUNCHER = CodeTemplate(
    r"""$args_struct

namespace $name {
// Turn counters of the ordered dQ adds: one per (batch, query head, query block) where deterministic, else none.
// Rounded up to whole 16 bytes: D and the other fp32 rows after them are read by 16-byte (vector and bulk) copies.
inline size_t dq_turn_count(const ${name}_args* a) {
    (void)a;
    return ($turn_count + 3) / 4 * 4;
}
}  // namespace $name

// The turn counters (zeroed), then the dQ fp32 buffer (the preprocess zeroes it) and D.
extern "C" int ${name}_workspace(const ${name}_args* a, size_t* bytes, size_t* zeroed) {
    const size_t rows = size_t(a->batch) * a->heads * a->seq_q;
    *zeroed = $name::dq_turn_count(a) * sizeof(int);
    *bytes = *zeroed + (size_t(a->batch) * a->heads * $name::dq_head_rows(a->seq_q) * $d_head + rows) * sizeof(float);
    return 0;
}

extern "C" int ${name}_launch(const ${name}_args* a, void* stream) {
    using namespace $name;
    if (a->batch <= 0 || a->heads <= 0 || a->kv_heads <= 0 || a->heads % a->kv_heads || a->seq_q <= 0 || a->seq_k <= 0 || !a->workspace$grid_check)
        return (int)cudaErrorInvalidValue;
    int* turns = (int*)a->workspace;
    int* dq_turns = dq_turn_count(a) ? turns : nullptr;
    float* dq_accum = (float*)(turns + dq_turn_count(a));
    float* delta = dq_accum + size_t(a->batch) * a->heads * dq_head_rows(a->seq_q) * $d_head;
    Params p{(const elem_t*)a->q, (const elem_t*)a->k, (const elem_t*)a->v, (const elem_t*)a->o, (const elem_t*)a->dout,
             (elem_t*)a->dq, (elem_t*)a->dk, (elem_t*)a->dv, a->lse, a->dlse, delta, dq_accum, dq_turns,
             a->q_stride[0], a->q_stride[1], a->q_stride[2], a->k_stride[0], a->k_stride[1], a->k_stride[2],
             a->v_stride[0], a->v_stride[1], a->v_stride[2], a->o_stride[0], a->o_stride[1], a->o_stride[2],
             a->do_stride[0], a->do_stride[1], a->do_stride[2], a->dq_stride[0], a->dq_stride[1], a->dq_stride[2],
             a->dk_stride[0], a->dk_stride[1], a->dk_stride[2], a->dv_stride[0], a->dv_stride[1], a->dv_stride[2],
             a->heads, a->seq_q, a->seq_k, a->heads / a->kv_heads, a->mask_offset, a->window_left, a->window_right,
             a->softmax_scale, a->softmax_scale * $log2e};
    $mod_fill
    cudaStream_t s = (cudaStream_t)stream;
    preprocess<<<dim3(unsigned((dq_head_rows(a->seq_q) * ROWDOT_LANES + 127) / 128), a->heads, a->batch), 128, 0, s>>>(p);  // zeroes the chunks
    constexpr int smem = $smem_bytes;
    static bool attr_set = false;  // the attribute is per function; set it once
    if (smem > 48 * 1024 && !attr_set) {
        cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        if (e != cudaSuccess) return (int)e;
        attr_set = true;
    }
    kernel<<<$grid_dims, THREADS, smem, s>>>(p);
    convert_dq<<<$convert_grid, 256, 0, s>>>(p);
    return (int)cudaGetLastError();
}
$mask_blocks
#endif  // FLASHGEN_INDEX_ONLY"""
)

_FILE = CodeTemplate("""$header_code

$device_code

$aux_code

$kernel_code

$launcher_code
""")
_PARTS = [("header_code", _HEADER), ("device_code", _DEVICE), ("kernel_code", _KERNEL),
          ("launcher_code", _LAUNCHER), ("file", _FILE)]


def mask_blocks_lines(plan, name: str) -> list[str]:
    """The backward's block-mask kernels and entry points (a mask_mod only; no lines otherwise)."""
    text = plan.score_mask.mask_blocks_cpp(name, transposed=True)
    return [text] if text else []


def emit_backward(plan: BackwardPlan) -> KernelSource:
    """The CUDA source of one mma.sync backward plan. Pure and deterministic."""
    from ..dsl.config import LOG2E

    cfg = plan.cfg
    if plan.items.rotates:  # item(w) and the dQ pointer's item_step walk from item 0
        raise ValueError(f"{cfg.short_form()}: the mma.sync backward walks its items from item 0; the plan's walk rotates")
    name = plan.score_mask.kernel_name(cfg.mangle())
    lay = plan.smem_layout
    atoms = {load.copy.atom for g in plan.gemms.values() for load in (g.a, g.b) if load is not None}
    helpers = [cp_async.helpers(plan.g2s["Q"].atom), vec.helpers(), ptx_math.helpers(cfg.dtype), ptx_mma.helper(plan.mma),
               red.helpers(plan.red_dQ.atom), sreg.helpers()] + ([turns.helpers()] if cfg.deterministic else []) + [ldmatrix.helper(a) for a in sorted(atoms, key=lambda a: a.name)]
    if plan.stats["LSE"].atom.is_async:
        helpers.append(cp_async.helpers(plan.stats["LSE"].atom))
    text = compose(_PARTS, dict(
        name=name, short_form=cfg.short_form(), knobs_json=json.dumps(cfg.to_dict()),
        schedule=" | ".join(str(s) for s in plan.schedule.body),
        B_r=cfg.B_r, B_c=cfg.B_c, n_warps=cfg.n_warps, threads=cfg.threads, smem_bytes=cfg.smem_bytes,
        d_head=cfg.d_head, d_mma=cfg.d_mma, d_smem=cfg.d_smem, key_rows=cfg.key_rows_per_warp, query_rows=cfg.query_rows_per_warp,
        col_constants=_col_constants(plan),
        index_fns=_index_section(plan), dq_fragment_fns=plan.dq_fragments.to_cpp(), mask_fns=plan.score_mask.to_cpp(backward=True), query_block_fns=[plan.query_blocks.to_cpp(), plan.items.step_cpp()], dq_cursor=_DQ_CURSOR,
        grid=plan.grid.described(cfg.B_c), cta=plan.grid.kernel_cpp(), batch_index=plan.grid.block_index(BATCH),
        grid_check=plan.grid.launch_check_cpp(), grid_dims=plan.grid.launch_dims_cpp(),
        rule_fns=[plan.recompute.to_cpp(), plan.score_grad.to_cpp(), plan.row_dot.to_cpp()],
        elem_t=cfg.dtype.cpp, ptx_helpers=HELPERS_MARK, aux_code=aux_kernels(plan.dq_fragments),
        mod_params=plan.score_mask.params_cpp(backward=True), mod_fill=plan.score_mask.fill_cpp(backward=True),
        smem_addrs=[f"const uint32_t {t}_addr = smem + {lay[t]}u;" for t in ("sK", "sV", "sdS") + _optional_tiles(plan)]
                   + [f"const uint32_t {t}_stage0 = smem + {lay[t]}u;" for t in ("sQ", "sdO")],
        stage_addrs=[f"const uint32_t s{n}_addr = s{n}_stage0 + stage * {plan.stage_bytes[n]}u;" for n in ("Q", "dO")],
        sLSE_offset=lay["sLSE"], sD_offset=lay["sD"], stats_bytes=f"{plan.stage_bytes['LSE']}u", stages=cfg.stages,
        g2s_K=_g2s_lambda(plan, "K"), g2s_V=_g2s_lambda(plan, "V"), g2s_Q=_g2s_lambda(plan, "Q"), g2s_dO=_g2s_lambda(plan, "dO"),
        prologue=_steps(plan, plan.schedule.prologue), body=_steps(plan, plan.schedule.body), epilogue=_epilogue(plan),
        log2e=f"{LOG2E!r}f", bases=_bases(plan), convert_grid=convert_grid(plan.dq_fragments), turn_count=f"size_t(a->batch) * a->heads * ((a->seq_q + {cfg.B_r} - 1) / {cfg.B_r})"
        if cfg.deterministic else "0", args_struct=backward_args_struct(name),
        block_mask_clip=plan.score_mask.backward_clip_cpp(cfg.deterministic), mask_blocks=mask_blocks_lines(plan, name),
        split_tables=[_split_tables(split_offsets(copy)) for _, copy in plan.copies()],
    ))
    meta = {**kernel_meta(cfg, name, cfg.threads, cfg.smem_bytes, grid=plan.grid.described(cfg.B_c), kind="backward"),
            "arguments": f"{name}_args", "workspace": f"{name}_workspace"}
    return KernelSource(name, insert_used(text, helpers), meta)
