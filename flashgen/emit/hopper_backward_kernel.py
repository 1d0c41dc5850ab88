"""HopperBackwardPlan -> CUDA C++ of the attention backward on wgmma (sm_90a; pure, deterministic).

The same three kernels and launcher ABI as the mma.sync backward (:mod:`flashgen.emit.backward_kernel`:
``preprocess``, ``kernel``, ``convert_dq``, ``<name>_workspace`` / ``<name>_launch`` taking
:func:`flashgen.emit.abi.backward_args_struct`), so one launcher operator runs either. Here the
preprocess also writes lse * log2(e) and D padded to whole query blocks, which the producer loads with
one bulk copy each beside the TMA boxes of Q and dO. Every shared-memory offset, descriptor field, ring
parity, accumulator-to-A table and the consumer's step order come from
:func:`flashgen.dsl.hopper_backward_plan.make_hopper_backward_plan`.
"""
from __future__ import annotations

import json

from ..dsl.atoms.copy import RF2GM_red
from ..dsl.config import LOG2E
from ..dsl.config import WARPGROUP
from ..dsl.hopper_backward_plan import HopperBackwardPlan
from ..dsl.steps import (ConvertP, Gemm, GradScores, Handoff, RecomputeP, ReduceGM, Release, SignalOrder, Step, StoreRF, WaitFull,
                         WaitOrder, WgmmaWait)
from .abi import backward_args_struct
from .backward_aux import aux_kernels, convert_grid
from .backward_kernel import mask_blocks_lines
from .hopper_kernel import TARGET, TENSOR_MAPS, tma_store_calls
from .ptx import hopper as ptx_hopper, math as ptx_math, red, stmatrix as ptx_stmatrix, turns, vec
from .ptx.used import HELPERS_MARK, insert_used
from .source import KernelSource, kernel_meta
from .template import SMEM_ATTRIBUTE, CodeTemplate, compose

__all__ = ["TARGET", "emit_hopper_backward"]

#: per GEMM: its accumulator, A (a descriptor variable or the A-fragment array) and B's descriptor variable;
#: ``staged``: the operand lives in the Q/dO ring (its stage's bytes added) or in a dS buffer
_OPERANDS = {"S": ("s_acc", "desc_k", "desc_q"), "dP": ("dp_acc", "desc_v", "desc_do"), "dV": ("dv_acc", "p_frag", "desc_do_mn"),
             "dK": ("dk_acc", "ds_frag", "desc_q_mn"), "dQ": ("dq_acc", "desc_ds", "desc_k_mn")}
_STAGED = {"desc_q": "st * (Q_BYTES >> 4)", "desc_do": "st * (Q_BYTES >> 4)", "desc_q_mn": "st * (Q_BYTES >> 4)",
           "desc_do_mn": "st * (Q_BYTES >> 4)", "desc_ds": "buf * (DS_BYTES >> 4)"}
#: the accumulators a GEMM's retirement frees (its own, and the A fragments it read)
_HOLDS = {"S": ("s_acc",), "dP": ("dp_acc",), "dV": ("dv_acc", "p_frag"), "dK": ("dk_acc", "ds_frag"), "dQ": ("dq_acc",)}
#: the fresh accumulators (their first k step overwrites: scale-d 0)
_FRESH = ("S", "dP", "dQ")


def _desc(plan: HopperBackwardPlan, var: str, gemm: str, operand: str, tile: str, per_consumer: bool) -> str:
    g = plan.gemms[gemm]
    d = getattr(g, operand)
    base = f"s{tile}" + (f" + cw * {d.row_block_offset}u" if per_consumer and d.row_block_offset else "")
    return f"const uint64_t {var} = smem_desc({base}, {d.lbo}u, {d.sbo}u, {d.swizzle.desc_code}u);  // {g.name}'s {operand.upper()}: {d.operand} {d.major}-major"


def _descriptors(plan: HopperBackwardPlan) -> list[str]:
    ds, k = ("b", "a") if plan.dq_stage.transposed else ("a", "b")
    return [_desc(plan, "desc_k", "S", "a", "K", True), _desc(plan, "desc_q", "S", "b", "Q", False),
            _desc(plan, "desc_v", "dP", "a", "V", True), _desc(plan, "desc_do", "dP", "b", "dO", False),
            _desc(plan, "desc_do_mn", "dV", "b", "dO", False), _desc(plan, "desc_q_mn", "dK", "b", "Q", False),
            _desc(plan, "desc_ds", "dQ", ds, "dS", True), _desc(plan, "desc_k_mn", "dQ", k, "K", True)]


def _operands(plan: HopperBackwardPlan, gemm: str) -> tuple[str, str, str]:
    """_OPERANDS, with dQ^T = K^T dS^T's operands swapped where the plan makes dQ transposed."""
    if gemm == "dQ" and plan.dq_stage.transposed:
        return ("dq_acc", "desc_k_mn", "desc_ds")
    return _OPERANDS[gemm]


def _helper(plan: HopperBackwardPlan, name: str) -> str:
    g = plan.gemms[name]
    if g.a_from == "smem":
        return ptx_hopper.wgmma_helper_name(g.atom, g.trans_b, g.trans_a)
    return ptx_hopper.wgmma_rs_helper_name(g.atom, g.trans_b)


def _operand(var: str, offset: int) -> str:
    staged = f" + {_STAGED[var]}" if var in _STAGED else ""
    return f"{var}{staged} + {offset >> 4}u"


def _gemm(plan: HopperBackwardPlan, step: Step) -> list[str]:
    """fence, one wgmma per k16 step (A and B at their per-step offsets), commit."""
    g = plan.gemms[step.arg]
    acc, a, b = _operands(plan, step.arg)
    fn = _helper(plan, step.arg)
    calls = []
    for t, boff in enumerate(g.b.step_offsets):
        scale = 0 if step.arg in _FRESH and t == 0 else 1
        a_arg = _operand(a, g.a.step_offsets[t]) if g.a_from == "smem" else f"{a}[{t}]"
        calls.append(f"{fn}({acc}, {a_arg}, {_operand(b, boff)}, {scale});")
    fence = [f"wgmma_fence_operands({acc});"] + ([f"wgmma_fence_operands({a});"] if g.a_from == "regs" else [])
    return fence + ["wgmma_fence();"] + calls + ["wgmma_commit_group();", f"wgmma_fence_operands({acc});"]


def _retired(plan: HopperBackwardPlan, upto: int, keep: int) -> list[str]:
    """The GEMMs a ``wgmma.wait_group keep`` at schedule position ``upto`` retires: every GEMM issued in
    this block's steps before it, less the ``keep`` newest, less those an earlier wait retired."""
    issued, done = [], set()
    for i, s in enumerate(plan.schedule[:upto]):
        if isinstance(s, Gemm):
            issued.append(s.arg)
        elif isinstance(s, WgmmaWait):
            done |= set(issued[:len(issued) - int(s.arg)])
    return [g for g in issued[:len(issued) - keep] if g not in done]


def _wait(plan: HopperBackwardPlan, step: WgmmaWait, at: int) -> list[str]:
    fences = [f"wgmma_fence_operands({r});" for g in _retired(plan, at, int(step.arg)) for r in _HOLDS[g]]
    return [f"wgmma_wait_group<{step.arg}>();"] + fences


def _per_value(plan: HopperBackwardPlan, n: str, lines: list[str], gemm: str = "S", step: int = 1) -> list[str]:
    """``lines`` for every accumulator value ``i`` of ``gemm`` with its tile row ``r`` and column ``c``."""
    row, col = plan.gemms[gemm].atom.c_map.to_cpp("wtid", "i")
    return ["#pragma unroll", f"for (uint32_t i = 0; i < {n}; i += {step}) {{", f"    const uint32_t r = {row}, c = {col};", "    (void)r; (void)c;"] + \
        ["    " + l for l in lines] + ["}"]


def _per_column_pair(plan: HopperBackwardPlan, lines: list[str]) -> list[str]:
    """``lines`` for every value ``i`` of S^T's accumulator (r, c as :func:`_per_value`), four at a time: a chunk's
    values ``4 k + 2 h + e`` lie in columns ``c0 + e`` of its two rows (the plan's "S^T accumulator pattern"), so one
    8-byte load per chunk gives ``_LSE`` and ``_DSUM``, the lse * log2(e) and D of the value's query column, for all
    four (half the loads of one per value)."""
    if not plan.stat_pairs:  # each value's own loads where they are used (declared at the loop's top, softcap spilled 16-20 B)
        return _per_value(plan, "B_r / 2", [l.replace(_LSE, "lse_log2[c]").replace(_DSUM, "dsum[c]") for l in lines])
    c_map = plan.gemms["S"].atom.c_map
    row, col = c_map.to_cpp("wtid", "i")
    c0 = c_map.to_cpp("wtid", "(4u * k)")[1]
    return ["#pragma unroll", "for (uint32_t k = 0; k < B_r / 8; ++k) {",
            f"    const uint32_t c0 = {c0};  // the chunk's first column (even)",
            "    const float2 lse_pair = *reinterpret_cast<const float2*>(lse_log2 + c0), dsum_pair = *reinterpret_cast<const float2*>(dsum + c0);",
            "    #pragma unroll", "    for (uint32_t e = 0; e < 4; ++e) {",
            f"        const uint32_t i = 4u * k + e, r = {row}, c = {col};", "        (void)r; (void)c;",
            f"        const float {_LSE} = e % 2 ? lse_pair.y : lse_pair.x, {_DSUM} = e % 2 ? dsum_pair.y : dsum_pair.x;",
            f"        (void){_LSE}; (void){_DSUM};"] + ["        " + l for l in lines] + ["    }", "}"]


#: the lse * log2(e) and D of an accumulator value's query column, as _per_column_pair names them
_LSE, _DSUM = "lse_c", "dsum_c"
#: a consumer's accumulator value (r, c): its key and query rows
_KEY, _QUERY = "kb * int(B_c) + int(64 * cw + r)", "q_row0 + int(c)"


def _recompute(plan: HopperBackwardPlan) -> list[str]:
    """P^T from S^T; where the plan makes dS^T in the same pass (its ``fused`` score order), dS^T too (dP^T is ready:
    see the schedule), times the score_mod's derivative at the score where it reads the score."""
    mask = plan.score_mask
    needs = "bwd_block_needs_mask(qb, kb, p.seq_q, p.seq_k, p.mask_offset, p.window_left, p.window_right)"
    grad = "g" if mask.derivative_reads_score else ""
    return [f"const bool masked = {mask.backward_masked_cpp(needs)};"] + mask.backward_items_cpp(
        lambda lines: _per_column_pair(plan, lines), lambda masked: [
            "float s = s_acc[i];", *([f"const int key = {_KEY};"] if mask.recompute_reads_indices(masked) else []),
            *(["float g;  // d score_mod / d score"] if grad else []),
            *mask.recompute_cpp("s", _QUERY, "key", "batch", "head", "g", masked),
            f"s_acc[i] = bwd_prob(s, p.scale_log2, {_LSE});",
        ] + (_grad_lines(plan, grad) if plan.grad_with_p else []))


def _grad_lines(plan: HopperBackwardPlan, grad: str) -> list[str]:
    return [f"dp_acc[i] = bwd_dscore(s_acc[i], dp_acc[i], {_DSUM});",
            *plan.score_mask.score_grad_cpp("dp_acc[i]", "s_acc[i]", _QUERY, _KEY, "batch", "head", grad)]


def _grad_scores(plan: HopperBackwardPlan) -> list[str]:
    if plan.grad_with_p:
        why = "the score_mod's derivative reads the score" if plan.score_mask.derivative_reads_score else "fewer registers live"
        return [f"// made with P^T ({why})"]
    return _per_column_pair(plan, _grad_lines(plan, ""))


def _convert(plan: HopperBackwardPlan, step: ConvertP) -> list[str]:
    src, dst = {"P": ("s_acc", "p_frag"), "dS": ("dp_acc", "ds_frag")}[step.arg]
    out = [f"// {src} -> A fragments ({dst}): plan.a_from_acc names the two values each 32-bit register packs"]
    for t, regs in enumerate(plan.a_from_acc):
        out.append(" ".join(f"{dst}[{t}][{r}] = pack2({src}[{lo}], {src}[{hi}]);" for r, (lo, hi) in enumerate(regs)))
    return out


def _store_ds(plan: HopperBackwardPlan) -> list[str]:
    """The consumer's dS^T accumulators into buffer ``buf`` of the dS tile (the plan's DsStore): a 32-bit pair per
    two values, or ``B_r / 16`` stmatrix .trans into the [query][key] tile."""
    if not plan.ds_store.trans:
        lay = plan.tiles["dS"].layout.to_cpp(["64 * cw + r", "c"])
        return _per_value(plan, "B_r / 2", [f"st_shared_b32(sdS + buf * DS_BYTES + 2 * ({lay}), pack2(dp_acc[i], dp_acc[i + 1]));"], step=2)
    query, key = plan.ds_store.lane_row_cpp()
    lay = plan.tiles["dS"].layout.to_cpp([query, key])
    regs = ", ".join(f"pack2(dp_acc[8 * t + {lo}], dp_acc[8 * t + {hi}])" for lo, hi in plan.ds_store.regs(0))
    return ["// DsStore: stmatrix .trans of the 8x8 blocks (key half, query chunk); lane l addresses a query row of block l / 8",
            "#pragma unroll", "for (uint32_t t = 0; t < B_r / 16; ++t) {",
            "    const uint32_t lane = wtid % 32u;",
            f"    {ptx_stmatrix.helper_name(plan.ds_store.atom)}(sdS + buf * DS_BYTES + 2 * ({lay}), {regs});", "}"]


def _chunk_index(head: str, qb: str) -> str:
    """The index of query block ``qb`` of query head ``head``: its chunk of the dQ buffer, its turn counters."""
    return f"(int64_t(batch) * p.heads + {head}) * (p.stat_len / int(B_r)) + {qb}"


def _reduce_dq(plan: HopperBackwardPlan) -> list[str]:
    """dQ into this consumer's region of the block's chunk of the fp32 buffer, in fragment order (DqStage):
    unordered, one 16-byte reduction per four values straight from the accumulators, or (``by_producer``) 16-byte
    stores into this consumer's region in the same order (once the producer's reductions of the previous item read
    it), which the producer adds; ordered (staged), through this consumer's staging region (once the previous block's
    reduction read it) and one bulk reduction. The pointer
    is made here, not carried from item to item as the mma.sync backward's (``item_step``): there the next item's
    first instructions no longer waited for these adds, but on an H200 the d_head 64 and 128 backward ran 0.96-1.01x
    as fast (bf16, seq 2048 / 8192, 2 rounds; the rounds' spread 2-7%)."""
    st = plan.dq_stage
    chunk = f"({_chunk_index('head', 'qb')}) * {st.rows * st.cols * st.consumers} + cw * {st.rows * st.cols}"
    if st.by_producer:
        return [
            f"const uint32_t sdQ_t = smem + {st.offset}u + cw * {st.region_bytes}u + 4u * ({st.slot_cpp('wtid', '0u')});",
            "if (w > 0) mbar_wait(bar_dq_empty, uint32_t(w - 1) & 1u);  // the producer's reduction of the last item read the region",
            "#pragma unroll",
            f"for (uint32_t i = 0; i < DQ_COLS / 2; i += {st.vec})  // the direct adds' slots: each warp stores 512 contiguous bytes",
            f"    st_shared_v4(sdQ_t + 4u * ({st.slot_cpp('0u', 'i')}), make_uint4(__float_as_uint(dq_acc[i]), __float_as_uint(dq_acc[i + 1]), "
            "__float_as_uint(dq_acc[i + 2]), __float_as_uint(dq_acc[i + 3])));",
            "fence_proxy_async();  // the producer's bulk reduction (async proxy) reads it once the stages are released",
        ]
    if not st.staged:
        return [
            "// the thread's slots from one pointer (slot(t, v) = slot(t, 0) + slot(0, v)): constant offsets, no 64-bit add each",
            f"float* gdQ = p.dq_accum + {chunk} + {st.slot_cpp('wtid', '0u')};",
            "#pragma unroll",
            f"for (uint32_t i = 0; i < DQ_COLS / 2; i += {st.vec})  // values i to i + 3: each warp's adds cover 512 contiguous bytes",
            f"    red_add_f32x4(gdQ + int({st.slot_cpp('0u', 'i')}), dq_acc[i], dq_acc[i + 1], dq_acc[i + 2], dq_acc[i + 3]);",
        ]
    return [
        "const uint32_t sdQ = smem + " + f"{st.offset}u + cw * {st.region_bytes}u;",
        "if (wtid == 0) bulk_wait_group_read<0>();  // the previous block's reduction has read the region",
        "named_bar_sync(2 + cw, 128);",
        "#pragma unroll",
        f"for (uint32_t i = 0; i < DQ_COLS / 2; i += {st.vec})  // values i, i + 1: conflict-free 8-byte slots",
        f"    st_shared_v2_f32(sdQ + 4u * ({st.slot_cpp('wtid', 'i')}), dq_acc[i], dq_acc[i + 1]);",
        "fence_proxy_async();  // the bulk reduction (async proxy) reads what st.shared wrote",
        "named_bar_sync(2 + cw, 128);",
        "if (wtid == 0) {",
        f"    bulk_reduce_add_f32(p.dq_accum + {chunk}, sdQ, {st.region_bytes}u);",
        "    bulk_commit_group();",
        "}",
    ]


#: this (batch, query head, query block, consumer)'s turn counter of the ordered dQ adds (each consumer adds
#: its own columns, so each orders its adds on its own)
_DQ_TURN = f"p.dq_turns + ({_chunk_index('head', 'qb')}) * CONSUMERS + cw"


def _release(plan: HopperBackwardPlan, step: Step) -> list[str]:
    assert plan.release_arrivals == WARPGROUP, "every consumer thread arrives on the empty barriers"
    return [f"mbar_arrive(bar_{step.arg.lower()}_empty + 8 * st);  // every thread: each read the stage's lse or D"]


_WAIT_ORDER = ["if (wtid == 0) {",
               "    turn_wait(" + _DQ_TURN + ", key_rank(qb, kb, p.seq_q, p.seq_k, p.mask_offset, p.window_left, p.window_right));",
               "    fence_proxy_async_global();  // the bulk reduction (async proxy) comes after the turn",
               "}"]
_SIGNAL_ORDER = ["if (wtid == 0) {",
                 "    bulk_wait_group<0>();  // this consumer's adds of the block are done",
                 "    fence_proxy_async_global();  // ... and ordered before the release below",
                 "    turn_pass(" + _DQ_TURN + ");",
                 "}"]

#: consumer step class -> its code (plan, step, its place in the schedule)
_STEP_CODE = {
    WaitFull: lambda plan, step, at: [f"mbar_wait(bar_{step.arg.lower()}_full + 8 * st, ph);"],
    Release: lambda plan, step, at: _release(plan, step),
    Gemm: lambda plan, step, at: _gemm(plan, step),
    WgmmaWait: _wait,
    RecomputeP: lambda plan, step, at: _recompute(plan),
    ConvertP: lambda plan, step, at: _convert(plan, step),
    GradScores: lambda plan, step, at: _grad_scores(plan),
    StoreRF: lambda plan, step, at: _store_ds(plan),
    Handoff: lambda plan, step, at: ["fence_proxy_async();  // wgmma (async proxy) reads what st.shared wrote",
                                     "named_bar_sync(1, 128 * CONSUMERS);"],
    ReduceGM: lambda plan, step, at: _reduce_dq(plan),
    WaitOrder: lambda plan, step, at: [*plan.grid.wait_note(), *_WAIT_ORDER],
    SignalOrder: lambda plan, step, at: _SIGNAL_ORDER,
}


def _step(plan: HopperBackwardPlan, step: Step, at: int) -> list[str]:
    code = _STEP_CODE.get(type(step))
    if code is None:
        raise KeyError(f"the wgmma backward emitter has no code for step {step}")
    return [f"// [{step}]" + (f" {step.why}" if step.why else "")] + code(plan, step, at)


def _tma(plan: HopperBackwardPlan, name: str, dst: str, bar: str, row: str, head: str) -> list[str]:
    return [f"tma_load_4d({dst} + {b.smem_offset}u, &p.tm_{name.lower()}, {bar}, {b.col0}, {row} + {b.row0}, {head}, batch);"
            for b in plan.loads[name].boxes]


#: the walk over the CTA's items (the plan's ItemWalk): its cursor's start and step, the producer's and the consumers'
_FIRST_ITEM, _NEXT_ITEM = "ItemCursor cur = first_item(n_q, p.kv_group, kb);", "next_item(cur, n_q, p.kv_group)"


def _producer(plan: HopperBackwardPlan) -> list[str]:
    ring = plan.ring
    out = ["mbar_arrive_expect_tx(bar_kv_full, 2 * KV_BYTES);"]
    out += _tma(plan, "K", "sK", "bar_kv_full", "kb * int(B_c)", "kv_head") + _tma(plan, "V", "sV", "bar_kv_full", "kb * int(B_c)", "kv_head")
    body = [f"const uint32_t st = {ring.stage_cpp('uint32_t(w)')}, ph = {ring.phase_cpp('uint32_t(w)')};",
            "const Item it = item(cur);",
            "const int64_t stat = (int64_t(batch) * p.heads + it.head) * p.stat_len + it.q_row0;  // its lse and D"]
    for name, stat in (("Q", "LSE"), ("dO", "D")):
        bar = f"bar_{name.lower()}_full + 8 * st"
        src = "p.lse_log2" if stat == "LSE" else "p.delta"
        body += [f"mbar_wait(bar_{name.lower()}_empty + 8 * st, {ring.empty_phase_cpp('ph')});  // a fresh barrier passes parity 1",
                 f"mbar_arrive_expect_tx({bar}, Q_BYTES + STAT_BYTES);"]
        body += _tma(plan, name, f"s{name} + st * Q_BYTES", bar, "it.q_row0", "it.head")
        body += [f"bulk_load(s{stat} + st * STAT_BYTES, {src} + stat, STAT_BYTES, {bar});"]
    if plan.dq_stage.by_producer:
        body += _producer_dq_adds(plan)
    return out + [_FIRST_ITEM, f"for (int w = 0; w < work; ++w, {_NEXT_ITEM}) {{"] + ["    " + l for l in body] + ["}"] + \
        (_producer_dq_tail(plan) if plan.dq_stage.by_producer else [])


def _dq_reduction(plan: HopperBackwardPlan) -> list[str]:
    """The producer's bulk reductions of every consumer's region into the chunk whose index slot ``st`` holds; once
    they read the regions, ``dq_empty`` lets the consumers store the next item's (DqStage.by_producer)."""
    st = plan.dq_stage
    chunk = f"p.dq_accum + int64_t(ld_shared_u32(smem + {st.chunk_slots}u + 4u * st)) * {st.rows * st.cols * st.consumers}"
    return [f"float* gdQ = {chunk};"] + [
        f"bulk_reduce_add_f32(gdQ + {w * st.rows * st.cols}, smem + {st.offset + w * st.region_bytes}u, {st.region_bytes}u);"
        for w in range(st.consumers)] + ["bulk_commit_group();", "bulk_wait_group_read<0>();", "mbar_arrive(bar_dq_empty);"]


def _producer_dq_adds(plan: HopperBackwardPlan) -> list[str]:
    """In the loop, after item w's loads: item w - STAGES released its stages, so its dQ is in the regions; then
    slot ``st`` takes item w's chunk."""
    chunk = f"uint32_t({_chunk_index('it.head', 'qb_begin + cur.q')})"  # fewer than 2^32 chunks: they are in memory
    return (["if (w >= int(STAGES)) {  // item w - STAGES: its stages came back, its dQ is in the regions"] +
            ["    " + l for l in _dq_reduction(plan)] + ["}",
            f"st_shared_b32(smem + {plan.dq_stage.chunk_slots}u + 4u * st, {chunk});  // item w's chunk of the dQ buffer"])


def _producer_dq_tail(plan: HopperBackwardPlan) -> list[str]:
    """After the loop: the last items' reductions, each once its Q stage comes back; all done before the CTA exits."""
    ring = plan.ring
    return (["for (int j = work > int(STAGES) ? work - int(STAGES) : 0; j < work; ++j) {",
             f"    const uint32_t v = uint32_t(j) + STAGES, st = {ring.stage_cpp('v')}, ph = {ring.phase_cpp('v')};  // as the use j + STAGES would",
             f"    mbar_wait(bar_q_empty + 8 * st, {ring.empty_phase_cpp('ph')});"] +
            ["    " + l for l in _dq_reduction(plan)] + ["}", "bulk_wait_group<0>();"])


def _epilogue(plan: HopperBackwardPlan) -> list[str]:
    """dK times the scale and dV staged over this consumer's rows of sK and sV (once every consumer's last dQ GEMM
    read sK), then written by one thread's TMA stores (``plan.stores``; rows past seq_k are not written); the dQ
    reductions and the stores finished reading shared memory before the CTA ends."""
    done = ["if (wtid == 0) bulk_wait_group<0>();"] if plan.dq_stage.staged else []
    k, v = plan.stores["dK"].tile, plan.stores["dV"].tile
    at = ["64 * cw + r", "c"]
    stage = _per_value(plan, "D_HEAD / 2", [
        f"st_shared_b32({k.name} + 2 * ({k.layout.to_cpp(at)}), pack2(bwd_grad_scaled(dk_acc[i], p.scale), bwd_grad_scaled(dk_acc[i + 1], p.scale)));",
        f"st_shared_b32({v.name} + 2 * ({v.layout.to_cpp(at)}), pack2(dv_acc[i], dv_acc[i + 1]));",
    ], gemm="dV", step=2)
    row0 = "kb * int(B_c)"
    store = tma_store_calls(plan.stores["dK"], "p.tm_dk", k.name, row0, "kv_head") + \
        tma_store_calls(plan.stores["dV"], "p.tm_dv", v.name, row0, "kv_head")
    return done + ["named_bar_sync(1, 128 * CONSUMERS);  // every consumer's dQ GEMMs read all rows of sK: done"] + stage + [
        "fence_proxy_async();  // the TMA unit (async proxy) reads what these st.shared wrote",
        "named_bar_sync(2 + cw, 128);  // this consumer's rows are staged",
        "if (wtid == 0) {", *("    " + line for line in store), "    bulk_commit_group();",
        "    bulk_wait_group<0>();  // the stores read shared memory before the CTA exits", "}"]


_HEADER = CodeTemplate(
    r"""// Generated by flashgen. Do not edit: change the config and re-emit.
//
// $short_form
// knobs: $knobs_json
// grid: $grid, block: $threads threads (warpgroup 0: TMA producer$producer_role, warpgroups
// 1..$consumers: consumers of 64 key rows each), dynamic shared memory: $smem_bytes bytes
// build: $gencode
// schedule per query block: $schedule
#include <stdint.h>
#include <cuda.h>  // CUtensorMap and its enums (types only: the encoder is fetched through the runtime)
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <math.h>

namespace $name {

constexpr uint32_t B_r = $B_r, B_c = $B_c, D_HEAD = $d_head, STAGES = $stages, CONSUMERS = $consumers, THREADS = $threads;
static_assert(THREADS == 128 * (1 + CONSUMERS), "one producer and CONSUMERS consumer warpgroups");
constexpr uint32_t Q_BYTES = $q_bytes, KV_BYTES = $kv_bytes, DS_BYTES = $ds_bytes;  // a Q or dO stage, K or V, a dS^T buffer
constexpr uint32_t STAT_BYTES = B_r * 4;  // a query block's lse or D (fp32)
constexpr uint32_t DS_BUFFERS = $ds_buffers;  // dS^T buffers: item w's rows in buffer w % DS_BUFFERS
constexpr uint32_t DQ_COLS = $dq_cols;  // columns of dQ per consumer

// ---- the score mask, and the mask seen from a key block ----
$mask_fns
$query_block_fns
$item_walk_fns

// ---- the backward's rules ----
$rule_fns

$dq_index_fn

using elem_t = $elem_t;

// ---- PTX helpers ----
$ptx_helpers

struct Params {
    CUtensorMap tm_q, tm_k, tm_v, tm_do;  // (d_head, seq, heads, batch) maps, 64-column boxes of B_r or B_c rows, 128B swizzle
    CUtensorMap tm_dk, tm_dv;  // the same of dK and dV, boxes of $store_rows rows (one consumer's)
    const elem_t* o; const elem_t* dout; elem_t* dq;  // dK and dV are written through tm_dk, tm_dv
    const float* lse;   // the forward's log-sum-exp (natural log), (batch, heads, seq_q)
    const float* dlse;  // the gradient of the returned lse, the same shape, or nullptr
    float* delta;       // D = rowsum(dO * O) - dlse, (batch, heads, stat_len): the workspace's, padded
    float* lse_log2;    // lse * log2(e), (batch, heads, stat_len): the workspace's, padded with +inf
    int* dq_turns;      // deterministic: key blocks done adding dQ, (batch, heads, query blocks, consumers), zero at launch; else nullptr
    float* dq_accum;    // fp32 dQ sums, (batch, heads, stat_len / B_r) chunks of B_r x D_HEAD in fragment order (dq_chunk_index): the workspace's, zeroed by the preprocess
    int64_t o_batch, o_head, o_ld, do_batch, do_head, do_ld;
    int64_t dq_batch, dq_head, dq_ld;
    int heads, seq_q, seq_k, kv_group, stat_len;  // stat_len: seq_q rounded up to whole query blocks
    int mask_offset, window_left, window_right;
    float scale, scale_log2;
    $mod_params
};

}  // namespace $name"""
)

_KERNEL = CodeTemplate(
    r"""namespace $name {

$aux_code

// One key block of one kv head ($cta_indices) over the query blocks of its
// group's heads.
__global__ void __launch_bounds__(THREADS, 1) kernel(const __grid_constant__ Params p) {
    extern __shared__ unsigned char smem_raw[];
    // the 128B swizzle repeats every 1024 bytes of absolute address: align the base (slack is in the size)
    const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)), smem = (raw + 1023u) & ~1023u;
    $smem_decls
    const uint32_t wg = $warpgroup, wtid = threadIdx.x % 128;
    $cta
    int qb_begin, qb_end;  // query blocks holding kept scores of this key block
    q_block_range(kb, p.seq_q, p.seq_k, p.mask_offset, p.window_left, p.window_right, &qb_begin, &qb_end);
    $block_mask_clip
    const int n_q = qb_end - qb_begin, work = n_q > 0 ? n_q * p.kv_group : 0;  // (query head, query block) items
    struct Item { int head, q_row0; };
    auto item = [&](const ItemCursor& c) { return Item{kv_head * p.kv_group + c.h, (qb_begin + c.q) * int(B_r)}; };
    if (threadIdx.x == 0) {
        $barrier_init
        fence_mbarrier_init();
    }
    __syncthreads();

    if (wg == 0) {
        // ---- producer: registers back to the pool, one thread issues every copy ----
        setmaxnreg_dec<$producer_regs>();
        if (wtid == 0 && work > 0) {
            $producer
        }
        return;
    }

    // ---- consumers: 64 key rows each ----
    setmaxnreg_inc<$consumer_regs>();
    const uint32_t cw = wg - 1;
    $descriptors
    float dk_acc[D_HEAD / 2], dv_acc[D_HEAD / 2];
    #pragma unroll
    for (uint32_t i = 0; i < D_HEAD / 2; ++i) dk_acc[i] = dv_acc[i] = 0.f;
    if (work > 0) mbar_wait(bar_kv_full, 0);
    $first_item
    for (int w = 0; w < work; ++w, $next_item) {
        const Item it = item(cur);
        const int head = it.head, q_row0 = it.q_row0, qb = qb_begin + cur.q;
        (void)head;  // unread where the producer adds dQ and no score_mod reads the head
        const uint32_t st = $stage, ph = $phase, buf = uint32_t(w) % DS_BUFFERS;  // ring slot and parity; dS^T buffer
        const float* lse_log2 = reinterpret_cast<const float*>(smem_raw + (sLSE - raw) + st * STAT_BYTES);
        const float* dsum = reinterpret_cast<const float*>(smem_raw + (sD - raw) + st * STAT_BYTES);
        float s_acc[B_r / 2], dp_acc[B_r / 2], dq_acc[DQ_COLS / 2];
        uint32_t p_frag[B_r / 16][4], ds_frag[B_r / 16][4];
        $body
    }

    // ---- epilogue ----
    $epilogue
}

}  // namespace $name"""
)

_HOST = CodeTemplate(
    r"""$args_struct

namespace $name {

$tensor_maps_code

}  // namespace $name

namespace $name {
// Turn counters of the ordered dQ adds: one per (batch, query head, query block, consumer) where deterministic, else none.
// Rounded up to whole 16 bytes: D and the other fp32 rows after them are read by 16-byte (vector and bulk) copies.
inline size_t dq_turn_count(const ${name}_args* a) {
    (void)a;
    return ($turn_count + 3) / 4 * 4;
}
}  // namespace $name

// The turn counters (zeroed), then the dQ fp32 buffer (the preprocess zeroes it), D and lse * log2(e); all padded
// to whole query blocks.
extern "C" int ${name}_workspace(const ${name}_args* a, size_t* bytes, size_t* zeroed) {
    const size_t padded = size_t(a->batch) * a->heads * ((a->seq_q + $B_r - 1) / $B_r * $B_r);
    *zeroed = $name::dq_turn_count(a) * sizeof(int);
    *bytes = *zeroed + padded * ($d_head + 2) * sizeof(float);
    return 0;
}

// Launch on `stream`. cudaErrorInvalidValue for sizes the kernels cannot take or strides a tensor map cannot
// describe (multiples of 16 bytes); cudaErrorNotSupported when the driver has no cuTensorMapEncodeTiled.
extern "C" int ${name}_launch(const ${name}_args* a, void* stream) {
    using namespace $name;
    if (a->batch <= 0 || a->heads <= 0 || a->kv_heads <= 0 || a->heads % a->kv_heads || a->seq_q <= 0 || a->seq_k <= 0 || !a->workspace$grid_check)
        return (int)cudaErrorInvalidValue;
    if (tensor_map_encoder() == nullptr) return (int)cudaErrorNotSupported;
    static Params p;  // large (6 tensor maps): built in static storage, passed by value to the launches
    p = Params{};
    const int stat_len = (a->seq_q + int(B_r) - 1) / int(B_r) * int(B_r);
    int* turns = (int*)a->workspace;
    float* dq_accum = (float*)(turns + dq_turn_count(a));
    float* delta = dq_accum + size_t(a->batch) * a->heads * stat_len * D_HEAD;
    float* lse_log2 = delta + size_t(a->batch) * a->heads * stat_len;
    p.o = (const elem_t*)a->o; p.dout = (const elem_t*)a->dout; p.dq = (elem_t*)a->dq;
    p.lse = a->lse; p.dlse = a->dlse; p.delta = delta; p.lse_log2 = lse_log2; p.dq_accum = dq_accum;
    p.dq_turns = dq_turn_count(a) ? turns : nullptr;
    p.o_batch = a->o_stride[0]; p.o_head = a->o_stride[1]; p.o_ld = a->o_stride[2];
    p.do_batch = a->do_stride[0]; p.do_head = a->do_stride[1]; p.do_ld = a->do_stride[2];
    p.dq_batch = a->dq_stride[0]; p.dq_head = a->dq_stride[1]; p.dq_ld = a->dq_stride[2];
    p.heads = a->heads; p.seq_q = a->seq_q; p.seq_k = a->seq_k; p.kv_group = a->heads / a->kv_heads; p.stat_len = stat_len;
    p.mask_offset = a->mask_offset; p.window_left = a->window_left; p.window_right = a->window_right;
    p.scale = a->softmax_scale; p.scale_log2 = a->softmax_scale * $log2e;
    $mod_fill
    cudaStream_t s = (cudaStream_t)stream;
    preprocess<<<dim3((stat_len * ROWDOT_LANES + 127) / 128, a->heads, a->batch), 128, 0, s>>>(p);  // reads no map
    // after a launch: cuTensorMapEncodeTiled is a driver call and needs a current context, which a thread of its own
    // (autograd's backward thread) has only once the runtime bound one (compute-sanitizer: invalid device context)
    if (!make_map(&p.tm_q, a->q, a->seq_q, a->heads, a->batch, a->q_stride, B_r) ||
        !make_map(&p.tm_do, a->dout, a->seq_q, a->heads, a->batch, a->do_stride, B_r) ||
        !make_map(&p.tm_k, a->k, a->seq_k, a->kv_heads, a->batch, a->k_stride, B_c) ||
        !make_map(&p.tm_v, a->v, a->seq_k, a->kv_heads, a->batch, a->v_stride, B_c) ||
        !make_map(&p.tm_dk, a->dk, a->seq_k, a->kv_heads, a->batch, a->dk_stride, $store_rows) ||
        !make_map(&p.tm_dv, a->dv, a->seq_k, a->kv_heads, a->batch, a->dv_stride, $store_rows))
        return (int)cudaErrorInvalidValue;
    constexpr int smem = $smem_bytes;
    $smem_attribute
    kernel<<<$grid_dims, THREADS, smem, s>>>(p);
    convert_dq<<<$convert_grid, 256, 0, s>>>(p);
    return (int)cudaGetLastError();
}
$mask_blocks"""
)

_FILE = CodeTemplate("""$header_code

$kernel_code

$host_code
""")
_PARTS = [("header_code", _HEADER), ("kernel_code", _KERNEL), ("tensor_maps_code", TENSOR_MAPS), ("host_code", _HOST), ("file", _FILE)]


def _smem_decls(plan: HopperBackwardPlan) -> list[str]:
    tiles = ", ".join(f"s{n} = smem + {t.offset}u" for n, t in plan.tiles.items())
    stats = ", ".join(f"s{n} = smem + {off}u" for n, (off, _, _) in plan.stats.items())
    bars = [f"const uint32_t bar_{n} = smem + {off}u;  // [{stages}] x 8 bytes" for n, (_, off, stages) in plan.barriers.items()]
    return [f"const uint32_t {tiles};", f"const uint32_t {stats};"] + bars


def emit_hopper_backward(plan: HopperBackwardPlan) -> KernelSource:
    """The CUDA source of one wgmma backward plan. Pure and deterministic."""
    cfg = plan.cfg
    name = plan.score_mask.kernel_name(cfg.mangle())
    g = plan.gemms
    wgmma_fns = [ptx_hopper.wgmma(g[n].atom, g[n].trans_b, g[n].trans_a) if g[n].a_from == "smem" else ptx_hopper.wgmma_rs(g[n].atom, g[n].trans_b)
                 for n in ("S", "dV", "dQ")]
    stores = [ptx_stmatrix.helper(plan.ds_store.atom)] if plan.ds_store.trans else []
    helpers = [*stores, vec.helpers(), ptx_math.helpers(cfg.dtype), ptx_hopper.helpers(), *wgmma_fns] + \
        ([turns.helpers()] if cfg.deterministic else []) + ([] if plan.dq_stage.in_smem else [red.helpers(RF2GM_red())])
    env = dict(
        name=name, short_form=cfg.short_form(), knobs_json=json.dumps(cfg.to_dict()), gencode=TARGET.gencode,
        schedule=" | ".join(str(s) for s in plan.schedule), B_r=cfg.B_r, B_c=cfg.B_c, d_head=cfg.d_head, stages=cfg.stages,
        consumers=plan.consumers, threads=plan.threads, smem_bytes=plan.smem_bytes,
        q_bytes=f"{plan.tiles['Q'].stage_bytes}u", kv_bytes=f"{plan.tiles['K'].stage_bytes}u", ds_bytes=f"{plan.tiles['dS'].stage_bytes}u",
        dq_cols=plan.dq_cols, mask_fns=plan.score_mask.to_cpp(backward=True), item_walk_fns=plan.items.to_cpp(), mod_params=plan.score_mask.params_cpp(backward=True),
        mod_fill=plan.score_mask.fill_cpp(backward=True), query_block_fns=plan.query_blocks.to_cpp(),
        grid=plan.grid.described(cfg.B_c), cta_indices=plan.grid.indices_described(), cta=plan.grid.kernel_cpp(),
        warpgroup="warpgroup_index()" if plan.uniform_warpgroup else "threadIdx.x / 128",
        grid_check=plan.grid.launch_check_cpp(), grid_dims=plan.grid.launch_dims_cpp(),
        rule_fns=[plan.recompute.to_cpp(), plan.score_grad.to_cpp(), plan.row_dot.to_cpp()], elem_t=cfg.dtype.cpp,
        dq_index_fn=plan.dq_stage.index_cpp(), ds_buffers=plan.tiles["dS"].stages, first_item=_FIRST_ITEM, next_item=_NEXT_ITEM,
        ptx_helpers=HELPERS_MARK, aux_code=aux_kernels(plan.dq_stage), convert_grid=convert_grid(plan.dq_stage), smem_decls=_smem_decls(plan),
        barrier_init=[f"for (uint32_t s = 0; s < {stages}; ++s) mbar_init(bar_{n} + 8 * s, {bar.arrive_count});"
                      for n, (bar, _, stages) in plan.barriers.items()],
        producer_regs=plan.producer_regs, consumer_regs=plan.consumer_regs, producer=_producer(plan),
        producer_role=" and dQ's bulk reductions" if plan.dq_stage.by_producer else "",
        descriptors=_descriptors(plan), stage=plan.ring.stage_cpp("uint32_t(w)"), phase=plan.ring.phase_cpp("uint32_t(w)"),
        body=[line for i, s in enumerate(plan.schedule) for line in _step(plan, s, i)], epilogue=_epilogue(plan),
        args_struct=backward_args_struct(name), log2e=f"{LOG2E!r}f",
        turn_count=f"size_t(a->batch) * a->heads * ((a->seq_q + {cfg.B_r} - 1) / {cfg.B_r}) * {plan.consumers}" if cfg.deterministic else "0",
        box_cols=plan.loads["Q"].tma.box_cols, store_rows=plan.stores["dK"].tma.box_rows, tma_dtype={"fp16": "CU_TENSOR_MAP_DATA_TYPE_FLOAT16", "bf16": "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16"}[cfg.dtype.value],
        tma_swizzle=plan.loads["Q"].tma.swizzle.tma_name, smem_attribute=SMEM_ATTRIBUTE,
        block_mask_clip=plan.score_mask.backward_clip_cpp(cfg.deterministic), mask_blocks=mask_blocks_lines(plan, name),
    )
    text = compose(_PARTS, env)
    meta = {**kernel_meta(cfg, name, plan.threads, plan.smem_bytes, grid=plan.grid.described(cfg.B_c), arch=TARGET.name,
                          kind="backward", strides="multiples of 8 elements (16 bytes)"),
            "arguments": f"{name}_args", "workspace": f"{name}_workspace"}
    return KernelSource(name, insert_used(text, helpers), meta)
