"""KernelPlan -> standalone CUDA C++ translation unit (pure, deterministic, no I/O, no torch).

Layout of the emitted file:
  1. header comment: the short form, the knobs, the plan's objects in text form;
  2. index functions (``__host__ __device__``), every one rendered from a plan object;
     compiling with ``-DFLASHGEN_INDEX_ONLY`` on a host compiler keeps only these;
  3. PTX helpers (one builder per instruction family);
  4. the ``__global__`` kernel, its body walking the plan's pipeline schedule;
  5. an ``extern "C"`` launcher.
"""
from __future__ import annotations

import json
from typing import Any

from ..attention.epilogue import epilogue
from ..attention.softmax import FLAT_CPP, online_softmax
from ..dsl.addressing import OffsetSplit, plan_splits
from ..dsl.atoms.mma import accumulator_as_a_operand
from ..dsl.config import LOG2E
from ..dsl.plan import KernelPlan, OperandLoad, TiledCopy
from ..dsl.steps import Barrier, Commit, Copy, Gemm, LoadRF, Softmax, Step, Wait
from ..dsl.tiling import Partition
from ..targets import Target, named as target_named
from .ptx import cp_async, ldmatrix, math as ptx_math, mma as ptx_mma, vec
from .ptx.used import HELPERS_MARK, insert_used
from .abi import args_struct
from .source import KernelSource, kernel_meta
from .template import CodeTemplate, compose

#: What this emitter writes for: mma.sync, ldmatrix and cp.async of sm_80 (and every later GPU).
TARGET: Target = target_named("sm_80")



# ---- index functions -------------------------------------------------------------------


def _offset_fn(name: str, tensor_name: str, layout: Any) -> str:
    expr = layout.to_cpp(["row", "col"])
    return (
        f"// {tensor_name}: {layout}  ((row, col) -> element offset)\n"
        f"__host__ __device__ __forceinline__ uint32_t {name}(uint32_t row, uint32_t col) {{\n"
        f"    return {expr};\n"
        f"}}"
    )


def _partition_fns(copy: TiledCopy, thread: str, params: list[str]) -> str:
    """``<copy>_row/_col(thread, value, [warp], loops...)`` and, for the smem side, ``<copy>_smem``."""
    part: Partition = copy.partition
    r, c = part.coord_cpp(thread, "v")
    sig = ", ".join(f"uint32_t {p}" for p in params)
    args = ", ".join(params)
    loops = ", ".join(f"{l.name} < {l.extent}" for l in part.loops) or "none"
    smem = copy.smem
    return (
        f"// {copy.name}: {copy.atom.name}; thread-value map {part.tv}; loops: {loops}"
        + (f"; warp w adds {part.warp_text()}" if part.uses_warp else "")
        + "\n"
        f"__host__ __device__ __forceinline__ uint32_t {copy.name}_row({sig}) {{ return {r}; }}\n"
        f"__host__ __device__ __forceinline__ uint32_t {copy.name}_col({sig}) {{ return {c}; }}\n"
        f"__host__ __device__ __forceinline__ uint32_t {copy.name}_smem({sig}) {{\n"
        f"    return {smem.name}_offset({copy.name}_row({args}), {copy.name}_col({args}));\n"
        f"}}"
    )


def index_functions(plan: KernelPlan) -> list[tuple[str, list[str]]]:
    """(function name, parameter names) of every emitted index function, for host tests."""
    out = [(f"{t}_offset", ["row", "col"]) for t in ("sQ", "sK", "sV", "sO")]
    for copy, params in _copies_with_params(plan):
        for suffix in ("row", "col", "smem"):
            out.append((f"{copy.name}_{suffix}", params))
    return out


def _copies_with_params(plan: KernelPlan) -> list[tuple[TiledCopy, list[str]]]:
    res = []
    for op in "QKV":
        res.append((plan.g2s[op], ["tid", "v"]))
    for op in "QKV":
        copy = plan.s2r[op].copy
        params = ["lane", "v"] + (["warp"] if copy.partition.uses_warp else []) + [l.name for l in copy.partition.loops]
        res.append((copy, params))
    res.append((plan.r2s_O, ["lane", "v", "warp"] + [l.name for l in plan.r2s_O.partition.loops]))
    res.append((plan.s2g_O, ["lane", "v", "warp"]))
    return res


def _index_section(plan: KernelPlan) -> str:
    parts = [_offset_fn(f"{t}_offset", t, plan.tensors[t].layout) for t in ("sQ", "sK", "sV", "sO")]
    for copy, params in _copies_with_params(plan):
        thread = params[0]
        parts.append(_partition_fns(copy, thread, params))
    return "\n\n".join(parts)


# ---- addresses: per-thread base ^ constant + constant (see dsl/addressing.py) -----------


def _c_array(values: tuple[int, ...], extents: tuple[int, ...]) -> str:
    if len(extents) == 1:
        return "{" + ", ".join(f"{v}u" for v in values) + "}"
    step = len(values) // extents[0]
    return "{" + ", ".join(_c_array(values[i * step:(i + 1) * step], extents[1:]) for i in range(extents[0])) + "}"


def _split_tables(split: OffsetSplit) -> str:
    dims = "".join(f"[{e}]" for e in split.extents)
    n = split.copy_name
    return (
        f"// {n}: smem offset = ({n}_smem(thread, 0...) ^ {n}_xor[i]) + {n}_add[i], row/col += {n}_drow/_dcol[i];\n"
        f"// i = ({', '.join(split.index_names)}); verified for every thread by flashgen.dsl.addressing\n"
        f"__device__ constexpr uint32_t {n}_xor{dims} = {_c_array(split.xor, split.extents)};\n"
        f"__device__ constexpr uint32_t {n}_add{dims} = {_c_array(split.add, split.extents)};"
        + (  # coordinate deltas: only the global side of g2s copies walks rows with them
            f"\n__device__ constexpr uint32_t {n}_drow{dims} = {_c_array(split.d_row, split.extents)};\n"
            f"__device__ constexpr uint32_t {n}_dcol{dims} = {_c_array(split.d_col, split.extents)};"
            if n.startswith("g2s_") and _row_walk_step(split) is None else ""
        )
    )


def _row_walk_step(split: OffsetSplit) -> int | None:
    """Rows between consecutive values when a copy walks whole rows at a constant step (else None)."""
    step = split.d_row[1] if len(split.d_row) > 1 else 0
    if all(c == 0 for c in split.d_col) and all(r == v * step for v, r in enumerate(split.d_row)):
        return step
    return None


def _smem_addr(copy: TiledCopy, idx: list[str], base: str | None = None) -> str:
    """Byte address in shared memory of ``copy`` at compile-time index ``idx`` = (v, loops...), from the
    tile's address ``base`` (default ``<tile>_addr``)."""
    sub = "".join(f"[{i}]" for i in idx)
    return f"{base or copy.smem.name + '_addr'} + 2u * ({copy.name}_base ^ {copy.name}_xor{sub}) + 2u * {copy.name}_add{sub}"


def _base_decl(copy: TiledCopy, thread_args: list[str]) -> str:
    zeros = ["0"] * (1 + len(copy.partition.loops))
    call = ", ".join(thread_args[:1] + zeros[:1] + thread_args[1:] + zeros[1:])
    return f"const uint32_t {copy.name}_base = {copy.name}_smem({call});"


# ---- kernel body pieces ----------------------------------------------------------------


def _g2s_lambda(plan: KernelPlan, op: str) -> str:
    """``copy_<op>(src, ld, rows_valid)``: a block global -> shared; rows >= rows_valid and
    columns >= valid_cols are zero-filled (no global read), the full-block path has no predicates."""
    copy = plan.g2s[op]
    n = copy.partition.tv.n_values
    split = plan_splits(plan)[copy.name]
    dst = _smem_addr(copy, ["v"])
    row = f"(row0 + {copy.name}_drow[v])"
    col = f"(col0 + {copy.name}_dcol[v])"
    first = (
        f"    {_base_decl(copy, ['tid'])}\n"
        f"    const uint32_t row0 = g2s_{op}_row(tid, 0), col0 = g2s_{op}_col(tid, 0);\n"
        f"    const elem_t* g = src + int64_t(row0) * ld + col0;\n"
    )
    src = f"g + int64_t({copy.name}_drow[v]) * ld + {copy.name}_dcol[v]"
    step = _row_walk_step(split)
    if step is not None:
        # value v is `step` rows below value v-1: walk one pointer instead of n 64-bit offsets
        first += f"    const int64_t step_ld = {step} * ld;\n"
        src = "g + int64_t(v) * step_ld"
        row, col = f"(row0 + v * {step}u)", "col0"
    partial_cols = plan.valid_cols < plan.cfg.d_smem
    col_ok = f" && {col} < {plan.valid_cols}u" if partial_cols else ""
    ok = f"{row} < (uint32_t)rows_valid{col_ok}"
    nrows = {"Q": plan.cfg.B_r, "K": plan.cfg.B_c, "V": plan.cfg.B_c}[op]
    if copy.atom.is_async:
        # an invalid chunk reads nothing (src-size 0) and lands as zeros; its source address is kept
        # inside the tensor (the thread's first row)
        pred = f"{{ const bool ok = {ok}; cp_async_16_zfill({dst}, ok ? {src} : g, ok); }}"
        full = f"cp_async_16({dst}, {src});"
    else:
        pred = f"{{ const bool ok = {ok}; st_shared_v4({dst}, ok ? ld_global_v4({src}) : make_uint4(0, 0, 0, 0)); }}"
        full = f"st_shared_v4({dst}, ld_global_v4({src}));"
    if partial_cols:  # padding columns: every block needs the predicate
        body = [f"    #pragma unroll", f"    for (uint32_t v = 0; v < {n}; ++v)", f"        {pred}"]
    else:  # full blocks (all but the tails) copy without predicates
        body = [
            f"    if (rows_valid >= {nrows}) {{",
            f"        #pragma unroll",
            f"        for (uint32_t v = 0; v < {n}; ++v)",
            f"            {full}",
            f"    }} else {{",
            f"        #pragma unroll",
            f"        for (uint32_t v = 0; v < {n}; ++v)",
            f"            {pred}",
            f"    }}",
        ]
    return (
        f"// {copy.atom.name}: {copy.src.name} block -> {copy.dst.name} ({copy.dst.layout}), {n} x 16 B per thread;\n"
        f"// rows >= rows_valid (sequence tails){' and columns >= ' + str(plan.valid_cols) if partial_cols else ''} are zero-filled\n"
        f"auto copy_{op} = [&](const elem_t* src, int64_t ld, int rows_valid) {{\n"
        f"{first}"
        + "\n".join(body) + "\n"
        f"}};"
    )


def _operand_loader(plan: KernelPlan, load: OperandLoad) -> str:
    """``load_<op>(buf_array, step)``: one k step of an operand via ldmatrix.x4."""
    op = load.operand
    copy = load.copy
    fn = ldmatrix.helper_name(copy.atom)
    kk_per_step = load.k_step // 16
    if op == "Q":
        return (
            f"// {copy.name}: {copy.atom.name} from {copy.src.name}, {kk_per_step} k16 block(s) of this warp's rows per step\n"
            f"auto load_Q = [&](uint32_t (&dst)[MT][{kk_per_step}][4], uint32_t step) {{\n"
            f"    #pragma unroll\n    for (uint32_t mi = 0; mi < MT; ++mi)\n"
            f"        #pragma unroll\n        for (uint32_t k = 0; k < {kk_per_step}; ++k)\n"
            f"            {fn}(dst[mi][k], {_smem_addr(copy, ['0', 'mi', f'step * {kk_per_step} + k'])});\n"
            f"}};"
        )
    if op == "K":
        return (
            f"// {copy.name}: {copy.atom.name} from {copy.src.name}, all B_c rows x {kk_per_step} k16 block(s) per step\n"
            f"auto load_K = [&](uint32_t (&dst)[B_c / 16][{kk_per_step}][4], uint32_t step) {{\n"
            f"    #pragma unroll\n    for (uint32_t nn = 0; nn < B_c / 16; ++nn)\n"
            f"        #pragma unroll\n        for (uint32_t k = 0; k < {kk_per_step}; ++k)\n"
            f"            {fn}(dst[nn][k], {_smem_addr(copy, ['0', 'nn', f'step * {kk_per_step} + k'])});\n"
            f"}};"
        )
    return (
        f"// {copy.name}: {copy.atom.name} from {copy.src.name}, {kk_per_step} k16 block(s) of B_c x all of d_head per step\n"
        f"auto load_V = [&](uint32_t (&dst)[{kk_per_step}][D_MMA / 16][4], uint32_t step) {{\n"
        f"    #pragma unroll\n    for (uint32_t k = 0; k < {kk_per_step}; ++k)\n"
        f"        #pragma unroll\n        for (uint32_t nn = 0; nn < D_MMA / 16; ++nn)\n"
        f"            {fn}(dst[k][nn], {_smem_addr(copy, ['0', f'step * {kk_per_step} + k', 'nn'])});\n"
        f"}};"
    )


def _k_loop(steps: int, buffers: int, loads: list[str], mmas: list[str], buf_decls: list[str]) -> list[str]:
    """A k loop over ``steps``, loading step s+1 before the MMAs of step s when double-buffered."""
    lines = list(buf_decls)
    if buffers == 2:
        lines += [l.replace("@S", "0").replace("@B", "0") for l in loads]
        lines.append("#pragma unroll")
        lines.append(f"for (uint32_t s = 0; s < {steps}; ++s) {{")
        lines.append(f"    if (s + 1 < {steps}) {{  // double buffering: next step's fragments first")
        lines += ["        " + l.replace("@S", "s + 1").replace("@B", "(s + 1) % 2") for l in loads]
        lines.append("    }")
        lines += ["    " + m.replace("@B", "s % 2") for m in mmas]
        lines.append("}")
    else:
        lines.append("#pragma unroll")
        lines.append(f"for (uint32_t s = 0; s < {steps}; ++s) {{")
        lines += ["    " + l.replace("@S", "s").replace("@B", "0") for l in loads]
        lines += ["    " + m.replace("@B", "0") for m in mmas]
        lines.append("}")
    return lines


def _mma_nest(acc: str, n_tiles: str, kk: int, a: str, b_frag) -> list[str]:
    """``acc[mi][nt] += A * B`` over m tiles, n8 tiles and the step's k16 blocks.

    ``b_frag(x4_index, register)`` names a B register of the ldmatrix.x4 results; which x4
    and which of its registers feed n tile ``nt`` is OperandLoad.b_operand_regs's rule.
    """
    per, regs = OperandLoad.N_TILES_PER_X4, OperandLoad.B_REGS_PER_N_TILE
    nn, r0 = f"nt / {per}", f"{regs} * (nt % {per})"
    return [
        "#pragma unroll",
        "for (uint32_t mi = 0; mi < MT; ++mi)",
        "    #pragma unroll",
        f"    for (uint32_t nt = 0; nt < {n_tiles}; ++nt)",
        "        #pragma unroll",
        f"        for (uint32_t k = 0; k < {kk}; ++k)",
        f"            mma_16816({acc}[mi][nt], {a}, {b_frag(nn, r0)}, {b_frag(nn, r0 + ' + 1')});",
    ]


def _gemm_S(plan: KernelPlan) -> list[str]:
    cfg = plan.cfg
    q, k = plan.s2r["Q"], plan.s2r["K"]
    step_cols = k.k_step
    steps = plan.gemm_S.k // step_cols
    kk = step_cols // 16
    buffers = k.buffers
    decls = [f"uint32_t k_frag[{buffers}][B_c / 16][{kk}][4];"]
    loads = ["load_K(k_frag[@B], @S);"]
    if q.resident:
        a = "q_res[mi][s * %d + k]" % kk
    else:
        decls.append(f"uint32_t q_frag[{buffers}][MT][{kk}][4];")
        loads.insert(0, "load_Q(q_frag[@B], @S);")
        a = "q_frag[@B][mi][k]"
    mmas = _mma_nest("s_acc", "B_c / 8", kk, a, lambda nn, r: f"k_frag[@B][{nn}][k][{r}]")
    head = [
        f"// S = Q K_j^T: warp tile {cfg.rows_per_warp} x {cfg.B_c}, reduction {plan.gemm_S.k} (d_head {cfg.d_head} rounded up to 16) in {steps} step(s) of {step_cols}"
        + (" (register double buffered)" if buffers == 2 else ""),
        "float s_acc[MT][B_c / 8][4];",
        "#pragma unroll",
        "for (uint32_t mi = 0; mi < MT; ++mi)",
        "    #pragma unroll",
        "    for (uint32_t nt = 0; nt < B_c / 8; ++nt)",
        "        s_acc[mi][nt][0] = s_acc[mi][nt][1] = s_acc[mi][nt][2] = s_acc[mi][nt][3] = 0.f;",
    ] + plan.score_mask.init_cpp(value="s_acc[mi][{t}][2 * h + e]", **_fragment_rows(plan))  # a bias: over the zeros
    return head + ["{"] + ["    " + l for l in _k_loop(steps, buffers, loads, mmas, decls)] + ["}"]


def _gemm_O(plan: KernelPlan) -> list[str]:
    cfg = plan.cfg
    v = plan.s2r["V"]
    step_rows = v.k_step
    steps = plan.gemm_O.k // step_rows
    kk = step_rows // 16
    decls = [f"uint32_t v_frag[{v.buffers}][{kk}][D_MMA / 16][4];"]
    loads = ["load_V(v_frag[@B], @S);"]
    mmas = _mma_nest("o_acc", "D_MMA / 8", kk, f"p_frag[mi][s * {kk} + k]", lambda nn, r: f"v_frag[@B][k][{nn}][{r}]")
    head = [
        f"// O += P V_j: warp tile {cfg.rows_per_warp} x {cfg.d_head}, reduction B_c={cfg.B_c} in {steps} step(s) of {step_rows}"
        + (" (register double buffered)" if v.buffers == 2 else ""),
        "// P is the S accumulator rounded to 16 bit: n tiles (2k, 2k+1) form A operand k.",
    ]
    return head + ["{"] + ["    " + l for l in _k_loop(steps, v.buffers, loads, mmas, decls)] + ["}"]


def _fragment_rows(plan: KernelPlan) -> dict:
    """Where the score rule finds a thread's S values: loops over its row halves, their global row and first
    key column, its batch and head. Values 2h and 2h+1 of a lane sit in one row, in neighbouring columns
    (proven on the plan's C map by flashgen.sim.verify), so one kept-column range per row and lane covers both."""
    cfg, c_map = plan.cfg, plan.mma.c_map
    row, col = c_map.row.to_cpp(["lane", "2 * h"]), c_map.col.to_cpp(["lane", "0"])
    return dict(loops=["for (uint32_t mi = 0; mi < MT; ++mi)", "for (uint32_t h = 0; h < 2; ++h)"],
                i=f"q_row0 + int(warp * {cfg.rows_per_warp} + mi * 16 + {row})", c0=f"j * int(B_c) + int({col})",
                b="int(blockIdx.z)", h="int(blockIdx.y)")


def _mask_scores(plan: KernelPlan) -> list[str]:
    """The score rule (mask, and the user's mods where built with them) on S before the softmax."""
    c_map = plan.mma.c_map
    return [
        f"// {plan.score_mask.kind} score mask + key tail. Row/col of accumulator values (2h, 2h+1) from the",
        f"// MMA's C fragment map: row {c_map.row}, col {c_map.col}; value 2h of n tile t is in column c0 + 8t",
    ] + plan.score_mask.apply_cpp(value="s_acc[mi][{t}][2 * h + e]", bits="mask_bits[mi][h]", **_fragment_rows(plan))


def _mask_bits(plan: KernelPlan) -> list[str]:
    """The mask_mod's bits of block j, first thing in the block (a mask_mod only)."""
    lines = plan.score_mask.bits_cpp(bits="mask_bits[mi][h]", **_fragment_rows(plan))
    return ["uint64_t mask_bits[MT][2];", "(void)mask_bits;"] + lines if lines else []


def _softmax(plan: KernelPlan) -> list[str]:
    """Mask, the online softmax (flashgen.attention.softmax) per m tile and row half, P packed as A."""
    sm = online_softmax(plan)
    # The CTA's first block is known only at run time: the row sum takes the factor anyway (0 times a
    # fresh row's 0, exact, and no branch); O's rescale, 32 multiplies a row, is skipped there (exp2).
    rescale = "if (j != j_begin) " if sm.skip_first else ""
    k = "scale_log2" if sm.exp2 else "scale"
    lines = _mask_scores(plan) + [
        "#pragma unroll",
        "for (uint32_t mi = 0; mi < MT; ++mi)",
        "    #pragma unroll",
        "    for (uint32_t h = 0; h < 2; ++h) {",
        "        float neg_m;",
        f"        const float corr = softmax_max_step(flat(s_acc[mi]), h, row_max[mi][h], {k}, neg_m);",
        # O before the exponentials: measured faster than after them for this engine (H100, 255 registers)
        f"        {rescale}scale_row(flat(o_acc[mi]), h, corr);",
        f"        softmax_exp_step(flat(s_acc[mi]), h, row_sum[mi][h], {k}, neg_m, corr, false);",
        "    }",
    ]
    lines += [
        "// P: accumulator values of n tiles (2k, 2k+1) packed as the A operand of k step k",
        "uint32_t p_frag[MT][B_c / 16][4];",
        "#pragma unroll",
        "for (uint32_t mi = 0; mi < MT; ++mi)",
        "    #pragma unroll",
        "    for (uint32_t k = 0; k < B_c / 16; ++k)",
        "        {",
    ] + [
        f"            p_frag[mi][k][{r}] = pack2(s_acc[mi][2 * k + {off}][{c0}], s_acc[mi][2 * k + {off}][{c0 + 1}]);"
        for r, (off, c0) in ((r, accumulator_as_a_operand(0, r)) for r in range(4))
    ] + [
        "        }",
    ]
    return lines


def _copy_code(plan: KernelPlan, step: Copy, next: str = "") -> list[str]:
    if step.arg == "Q":
        return ["copy_Q(gQ, p.q_ld, q_rows_valid);"]
    blk = step.block.to_cpp(next=next)
    g, ld = f"g{step.arg}", f"p.{step.arg.lower()}_ld"
    return [f"copy_{step.arg}({g} + int64_t({blk}) * B_c * {ld}, {ld}, p.seq_k - {blk} * (int)B_c);"]


#: step class -> its code (the plan's schedule is made of these; see flashgen.dsl.steps)
_STEP_CODE = {
    Copy: _copy_code,
    Commit: lambda plan, step: ["cp_async_commit();"],
    Wait: lambda plan, step: [f"cp_async_wait<{step.arg}>();"],
    Barrier: lambda plan, step: ["__syncthreads();"],
    LoadRF: lambda plan, step: ["load_Q(q_res, 0);"],
    Gemm: lambda plan, step: _gemm_S(plan) if step.arg == "S" else _gemm_O(plan),
    Softmax: lambda plan, step: _softmax(plan),
}


def _step_code(plan: KernelPlan, step: Step, j: str = "j", next: str = "") -> list[str]:
    """One schedule step's code with its comment, inside ``if (guard)`` when guarded; ``j``: the block
    index (``j_begin`` in the prologue); ``next``: the block walked after ``j`` when that is not ``j + 1``."""
    code = _copy_code(plan, step, next) if isinstance(step, Copy) else _STEP_CODE[type(step)](plan, step)
    comment = [f"// [{step.op}{' ' + step.arg if step.arg else ''}{' block ' + str(step.block) if step.block else ''}] {step.why}".rstrip()] if step.why else []
    if step.guard:
        return comment + [f"if ({step.guard.to_cpp(end='n_blocks', j=j, next=next)}) {{"] + ["    " + c for c in code] + ["}"]
    return comment + code


def _walk_next(plan: KernelPlan) -> tuple[list[str], str]:
    """With a mask_mod, the body's first line naming the block walked after ``j`` (the block mask skips
    empty blocks), and that name for the steps on block ``j + 1`` and their guards; else nothing."""
    mask = plan.score_mask
    if mask.mask_mod is None or not any((s.guard and s.guard.offset) or (s.block and s.block.base == "j" and s.block.offset)
                                        for s in plan.schedule.body):
        return [], ""
    return [f"const int j_next = {mask.next_cpp('bm_row', 'j', 'n_blocks')};  // the next key block walked (empty ones skipped)"], "j_next"


#: The file's head and its index functions (all a host compile with -DFLASHGEN_INDEX_ONLY keeps).
_HEADER = CodeTemplate(
    r"""// Generated by flashgen. Do not edit: change the config and re-emit.
//
// $short_form
// knobs: $knobs_json
// grid: (ceil(seq_q / $B_r), heads, batch), block: $threads threads, dynamic shared memory: $smem_bytes bytes
//
// plan:
$plan_lines
#include <stdint.h>
#ifdef FLASHGEN_INDEX_ONLY
#ifndef __CUDACC__
#define __host__
#define __device__
#define __forceinline__ inline
#endif
#else
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <math.h>
#include <type_traits>
#endif

namespace $name {

constexpr uint32_t B_r = $B_r, B_c = $B_c, N_WARPS = $n_warps, THREADS = $threads;
static_assert(THREADS == 32 * N_WARPS, "one warp = 32 threads");
constexpr uint32_t D_HEAD = $d_head, D_MMA = $d_mma, D_SMEM = $d_smem;  // data, MMA-covered, shared-memory columns
static_assert(D_HEAD <= D_MMA && D_MMA <= D_SMEM && D_SMEM % 64 == 0, "tile widths");
constexpr uint32_t MT = $m_tiles;  // 16-row MMA tiles per warp

// ---- index functions: every shared-memory address of the kernel comes from these ----
$index_fns

$mask_fns

// ---- address splits: cheap per-thread addressing derived from the functions above ----
$split_tables

}  // namespace $name"""
)

#: The device side's element type, PTX helpers and kernel parameters.
_DEVICE_TYPES = CodeTemplate(
    r"""#ifndef FLASHGEN_INDEX_ONLY
namespace $name {

using elem_t = $elem_t;

// ---- PTX helpers ----
$ptx_helpers

$softmax_fns

struct Params {
    const elem_t* q; const elem_t* k; const elem_t* v; elem_t* o;
    int64_t q_batch, q_head, q_ld;  // element strides: batch, head, sequence row (d_head is contiguous)
    int64_t k_batch, k_head, k_ld;
    int64_t v_batch, v_head, v_ld;
    int64_t o_batch, o_head, o_ld;
    float* lse; int64_t lse_batch, lse_head;  // optional fp32 log-sum-exp per row (seq contiguous)
    int seq_q, seq_k;
    int kv_group;  // query heads per key/value head (GQA/MQA)
    int mask_offset, window_left, window_right;  // see ScoreMask
    float scale, scale_log2;  // softmax scale, and scale * log2(e) for exp2
    $mod_params
};"""
)

#: The kernel: setup, the copy and MMA routines, the prologue and the loop over key blocks.
_KERNEL = CodeTemplate(
    r"""__global__ void __launch_bounds__(THREADS) kernel(const __grid_constant__ Params p) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const uint32_t sQ_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
    const uint32_t sK_addr = sQ_addr + $sQ_bytes;
    const uint32_t sV_addr = sK_addr + $sK_bytes;
    const uint32_t sO_addr = sQ_addr;  // O is staged in Q's shared memory (each warp its own rows)
    const uint32_t tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int q_row0 = int(blockIdx.x) * int(B_r);
    const int q_rows_valid = p.seq_q - q_row0;  // < B_r in the last query block
    const elem_t* gQ = p.q + blockIdx.z * p.q_batch + blockIdx.y * p.q_head + int64_t(q_row0) * p.q_ld;
    const uint32_t kv_head = blockIdx.y / uint32_t(p.kv_group);  // GQA/MQA: query heads share a k/v head
    const elem_t* gK = p.k + blockIdx.z * p.k_batch + kv_head * p.k_head;
    const elem_t* gV = p.v + blockIdx.z * p.v_batch + kv_head * p.v_head;
    elem_t* gO = p.o + blockIdx.z * p.o_batch + blockIdx.y * p.o_head + int64_t(q_row0) * p.o_ld;
    const float scale = p.scale;
    const float scale_log2 = p.scale_log2;
    int j_begin, n_blocks;  // key blocks [j_begin, n_blocks) hold scores the mask keeps
    kv_block_range(q_row0, p.seq_q, p.seq_k, p.mask_offset, p.window_left, p.window_right, &j_begin, &n_blocks);
    $block_mask_tile
    $bias_tile
    (void)scale; (void)scale_log2;

    $bases
    $g2s_Q
    $g2s_K
    $g2s_V
    $load_Q
    $load_K
    $load_V

    float o_acc[MT][D_MMA / 8][4];
    float row_max[MT][2], row_sum[MT][2];
    #pragma unroll
    for (uint32_t mi = 0; mi < MT; ++mi) {
        row_max[mi][0] = row_max[mi][1] = -INFINITY;
        row_sum[mi][0] = row_sum[mi][1] = 0.f;
        #pragma unroll
        for (uint32_t nt = 0; nt < D_MMA / 8; ++nt) o_acc[mi][nt][0] = o_acc[mi][nt][1] = o_acc[mi][nt][2] = o_acc[mi][nt][3] = 0.f;
    }
    $q_res_decl

    // ---- prologue ----
    $prologue

    // ---- main loop over key/value blocks ----
    // One key block; `masked` is a compile-time flag: blocks every score of which the mask keeps
    // (all but the diagonal/window edges and the key tail) run a copy of the body without mask code.
    auto kv_block = [&](const int j, auto masked) {
        $body
    };
    for (int j = j_begin; j < n_blocks; $kv_step) {
        if (block_needs_mask(j, q_row0, p.seq_q, p.seq_k, p.mask_offset, p.window_left, p.window_right)$block_mask_masked)
            kv_block(j, std::true_type{});
        else
            kv_block(j, std::false_type{});
    }

    $epilogue_code
}

}  // namespace $name"""
)

#: The kernel's output: O /= l and the LSE, registers -> shared (own rows) -> global.
_EPILOGUE = CodeTemplate(
    r"""// ---- epilogue: O /= l, registers -> shared (own rows) -> global, 16-byte stores ----
$final_wait
#pragma unroll
for (uint32_t mi = 0; mi < MT; ++mi) {
    #pragma unroll
    for (uint32_t h = 0; h < 2; ++h) {
        const float l = epilogue_row_sum(row_sum[mi][h]);
        scale_row(flat(o_acc[mi]), h, epilogue_inv(l));
        if (p.lse != nullptr) {
            const int row = q_row0 + int(warp * $rows_per_warp + mi * 16 + $c_row_h);
            if ($lse_writer_lane && row < p.seq_q)
                p.lse[blockIdx.z * p.lse_batch + blockIdx.y * p.lse_head + row] = epilogue_lse(row_max[mi][h], l, scale);
        }
    }
}
$epilogue_bases
// $r2s_comment
#pragma unroll
for (uint32_t mi = 0; mi < MT; ++mi)
    #pragma unroll
    for (uint32_t nt = 0; nt < D_MMA / 8; ++nt)
        #pragma unroll
        for (uint32_t h = 0; h < 2; ++h)
            st_shared_b32($r2s_addr, pack2(o_acc[mi][nt][2 * h], o_acc[mi][nt][2 * h + 1]));
__syncwarp();
// $s2g_comment
#pragma unroll
for (uint32_t v = 0; v < $s2g_values; ++v) {
    const uint32_t row = s2g_O_row(lane, v, warp), col = s2g_O_col(lane, v, warp);
    if ((int)row < q_rows_valid && col < D_HEAD)  // query tail rows and padding columns stay unwritten
        st_global_v4(gO + int64_t(row) * p.o_ld + col, ld_shared_v4($s2g_addr));
}"""
)

#: The C entry points: the workspace (none) and the launch.
_LAUNCHER = CodeTemplate(
    r"""$args_struct

// Scratch memory a launch uses (the launcher asks every kernel): none here.
extern "C" int ${name}_workspace(const ${name}_args* a, size_t* bytes, size_t* zeroed) {
    (void)a;
    *bytes = *zeroed = 0;
    return 0;
}

// Launch on `stream` (a cudaStream_t). Returns a cudaError_t: cudaErrorInvalidValue for
// sizes the kernel cannot take (non-positive sizes, heads not a multiple of kv_heads).
extern "C" int ${name}_launch(const ${name}_args* a, void* stream) {
    using namespace $name;
    if (a->batch <= 0 || a->heads <= 0 || a->kv_heads <= 0 || a->heads % a->kv_heads || a->seq_q <= 0 || a->seq_k < 0)
        return (int)cudaErrorInvalidValue;
    Params p{(const elem_t*)a->q, (const elem_t*)a->k, (const elem_t*)a->v, (elem_t*)a->o,
             a->q_stride[0], a->q_stride[1], a->q_stride[2], a->k_stride[0], a->k_stride[1], a->k_stride[2],
             a->v_stride[0], a->v_stride[1], a->v_stride[2], a->o_stride[0], a->o_stride[1], a->o_stride[2],
             a->lse, a->lse_stride[0], a->lse_stride[1],
             a->seq_q, a->seq_k, a->heads / a->kv_heads, a->mask_offset, a->window_left, a->window_right,
             a->softmax_scale, a->softmax_scale * $log2e};
    $mod_fill
    constexpr int smem = $smem_bytes;
    if (smem > 48 * 1024) {
        static bool attr_set = false;  // the attribute is per function; set it once
        if (!attr_set) {
            cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
            if (e != cudaSuccess) return (int)e;
            attr_set = true;
        }
    }
    dim3 grid((a->seq_q + B_r - 1) / B_r, a->heads, a->batch);
    kernel<<<grid, THREADS, smem, (cudaStream_t)stream>>>(p);
    return (int)cudaGetLastError();
}
$mask_blocks
#endif  // FLASHGEN_INDEX_ONLY"""
)

#: The file: every part above, in order (see compose).
_FILE = CodeTemplate("""$header_code

$device_types_code

$kernel_code

$launcher_code
""")
_PARTS = [("epilogue_code", _EPILOGUE), ("kernel_code", _KERNEL), ("header_code", _HEADER), ("device_types_code", _DEVICE_TYPES),
          ("launcher_code", _LAUNCHER), ("file", _FILE)]


def _plan_lines(plan: KernelPlan) -> list[str]:
    out = []
    for t in ("sQ", "sK", "sV", "sO"):
        out.append(f"//   {plan.tensors[t]}")
    for op in "QKV":
        c = plan.g2s[op]
        out.append(f"//   {c.name}: {c.atom.name}, {c.partition.tv.n_values} x 16 B per thread")
    for op in "QKV":
        l = plan.s2r[op]
        out.append(
            f"//   {l.copy.name}: {l.copy.atom.name}, k step {l.k_step} cols, {l.buffers} buffer(s)" + (", resident" if l.resident else "")
        )
    out.append(f"//   mma: {plan.mma.name} ({plan.mma.ptx})")
    out.append(f"//   schedule: {' | '.join(s.op + (' ' + s.arg if s.arg else '') for s in plan.schedule.body)}")
    return out


def emit(plan: KernelPlan) -> KernelSource:
    """The CUDA source of one mma.sync plan. Pure and deterministic."""
    cfg = plan.cfg
    name = plan.score_mask.kernel_name(cfg.mangle())
    q = plan.s2r["Q"]
    helpers = [vec.helpers(), ptx_math.helpers(cfg.dtype), ldmatrix.helper(q.copy.atom), ldmatrix.helper(plan.s2r["V"].copy.atom), ptx_mma.helper(plan.mma)]
    if cfg.async_copy:
        helpers.insert(0, cp_async.helpers(plan.g2s["Q"].atom))
    q_res = f"uint32_t q_res[MT][D_MMA / 16][4];  // Q fragments, resident for the whole CTA" if q.resident else "// Q fragments are re-read from shared memory every block"
    body, next = _walk_next(plan)
    body += _mask_bits(plan)
    for step in plan.schedule.body:
        body += _step_code(plan, step, next=next)
    prologue: list[str] = []
    for step in plan.schedule.prologue:
        prologue += _step_code(plan, step, j="j_begin")
    text = compose(_PARTS, dict(
        name=name,
        short_form=cfg.short_form(),
        knobs_json=json.dumps(cfg.to_dict()),
        plan_lines=_plan_lines(plan),
        B_r=cfg.B_r,
        B_c=cfg.B_c,
        d_head=cfg.d_head,
        n_warps=cfg.n_warps,
        threads=cfg.threads,
        m_tiles=cfg.m_tiles_per_warp,
        smem_bytes=cfg.smem_bytes,
        index_fns=_index_section(plan),
        elem_t=cfg.dtype.cpp,
        ptx_helpers=HELPERS_MARK,
        sQ_bytes=f"{plan.tensors['sQ'].bytes}u",
        sK_bytes=f"{plan.tensors['sK'].bytes}u",
        log2e=f"{LOG2E!r}f",
        g2s_Q=_g2s_lambda(plan, "Q"),
        g2s_K=_g2s_lambda(plan, "K"),
        g2s_V=_g2s_lambda(plan, "V"),
        load_Q=_operand_loader(plan, q),
        load_K=_operand_loader(plan, plan.s2r["K"]),
        load_V=_operand_loader(plan, plan.s2r["V"]),
        q_res_decl=q_res,
        prologue=prologue,
        body=body,
        softmax_fns=[online_softmax(plan).to_cpp(), FLAT_CPP, epilogue(plan).to_cpp()],
        d_mma=cfg.d_mma,
        d_smem=cfg.d_smem,
        mask_fns=plan.score_mask.to_cpp(),
        mod_params=plan.score_mask.params_cpp(),
        mod_fill=plan.score_mask.fill_cpp(),
        block_mask_tile=plan.score_mask.tile_cpp("bm_row", "int(blockIdx.z)", "int(blockIdx.y)", "int(blockIdx.x)",
                                                 "int(gridDim.y)", "j_begin", "n_blocks"),
        block_mask_masked=plan.score_mask.masked_cpp("bm_row", "j"),
        bias_tile=plan.score_mask.bias_tile_cpp("int(blockIdx.z)", "int(blockIdx.y)") or ["// no bias per tile"],
        kv_step="++j" if plan.score_mask.mask_mod is None else "j = " + plan.score_mask.next_cpp("bm_row", "j", "n_blocks"),
        mask_blocks=plan.score_mask.mask_blocks_cpp(name),
        final_wait=(
            "if (j_begin >= n_blocks) {  // no key block ran: make sure the Q copy has landed before O reuses its space\n"
            + ("    cp_async_wait<0>();\n" if cfg.async_copy else "")
            + "    __syncthreads();\n}"
        ),
        rows_per_warp=cfg.rows_per_warp,
        c_row_h=plan.mma.c_map.row.to_cpp(["lane", "2 * h"]),
        lse_writer_lane=f"(lane & {sum(plan.row_reduce_lanes)}u) == 0",
        args_struct=args_struct(name),
        split_tables=[_split_tables(sp) for sp in plan_splits(plan).values()],
        bases=[_base_decl(plan.s2r["Q"].copy, ["lane", "warp"]), _base_decl(plan.s2r["K"].copy, ["lane"]), _base_decl(plan.s2r["V"].copy, ["lane"])],
        epilogue_bases=[_base_decl(plan.r2s_O, ["lane", "warp"]), _base_decl(plan.s2g_O, ["lane", "warp"])],
        r2s_addr=_smem_addr(plan.r2s_O, ["2 * h", "mi", "nt"]),
        s2g_addr=_smem_addr(plan.s2g_O, ["v"]),
        r2s_comment=f"{plan.r2s_O.name}: {plan.r2s_O.atom.name} of packed pairs into {plan.r2s_O.dst.name}",
        s2g_comment=f"{plan.s2g_O.name}: {plan.s2g_O.atom.name}, this warp's rows",
        s2g_values=plan.s2g_O.partition.tv.n_values,
    ))
    meta = kernel_meta(cfg, name, cfg.threads, cfg.smem_bytes)
    return KernelSource(name, insert_used(text, helpers), meta)
