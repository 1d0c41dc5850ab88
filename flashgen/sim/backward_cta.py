"""The backward's CTAs, step by step through ``plan.schedule``, and a whole backward pass from them.

:class:`_BwdCta` executes one CTA of a :class:`~flashgen.dsl.backward_plan.BackwardPlan`: the
prologue (K and V of its key block), then the body once per (query head of the group, query block
of :class:`~flashgen.attention.query_blocks.QueryBlocks`), then the epilogue (dK times the scale;
dK and dV registers -> shared over sK / sV -> global), on a flat shared-memory image, with the
forward simulator's :class:`~flashgen.sim.cta.HazardTracker` watching every shared tile:

* copies through the plan's copy traces (:func:`flashgen.sim.copies.trace_plan`; rows past the
  sequence end and columns past d_head zero-filled), landing when their cp.async group completes;
* GEMM operands loaded by :func:`hardware.ldmatrix` at the traces' lane addresses, registers
  paired by :meth:`OperandLoad.b_operand_regs` and :func:`accumulator_as_a_operand` (P^T and dS^T
  reused as A operands), multiplied by the PTX-semantics MMA (:func:`hardware.mma_batch_f64`);
* P^T, dS^T, the scale through the plan's rule objects (:mod:`flashgen.attention.backward`), with
  the query block's lse and D read from the shared copies by each value's column; a plan built with a
  score_mod / mask_mod applies its score rule (:func:`backward_scores`, :func:`backward_dscores`: the
  plan's ``ScoreMask``), and where the score_mod's derivative reads the score, dS^T is made in the
  RecomputeP step from dP^T as it stands then (the emitters' order: a schedule that has not made dP^T
  by then gives wrong gradients);
* dS^T and dK / dV stored where the r2s traces put each register, dQ added into the fp32 buffer
  at the coordinates the ``red_dQ`` partition gives each register (fp32 adds, in the order the CTAs
  make them);
* ``deterministic``: the turn counters of the ordered dQ adds (one per query head and query block):
  a CTA at :class:`WaitOrder` is suspended until the counter equals its rank
  (:meth:`QueryBlocks.key_rank`), :class:`SignalOrder` increments it. :func:`run_ctas` runs the CTAs
  of one (batch, kv head) in a given arrival order, each as far as its turns allow; CTAs that all
  wait for turns that never come are a hazard (the kernel would hang).

:func:`simulate_backward` runs every CTA of a problem (batch, kv heads, key blocks) in the order the
grid starts them (:meth:`BwdPass.arrivals`), the preprocess (D from the rule, O and lse from a float64
forward of the 16-bit inputs) and the dQ conversion, and returns dQ, dK, dV in the inputs' 16-bit type.
``key_block_order`` permutes the order in which the CTAs of a (batch, kv head) arrive: without
``deterministic`` their dQ adds come in that order, with it always in ascending key blocks.
"""
from __future__ import annotations

import attrs
import numpy as np

from flashgen.attention.score_mask import key_window
from flashgen.dsl.backward_config import BackwardConfig
from flashgen.dsl.backward_plan import STATS, STREAMED, BackwardPlan, make_backward_plan
from flashgen.dsl.plan import OperandLoad, WarpGemm
from flashgen.dsl.steps import (Barrier, Commit, Copy, Gemm, GradScores, RecomputeP, ReduceGM, SignalOrder, Step, StoreRF, Wait,
                                WaitOrder, runs)
from flashgen.sim import fragments as fr
from flashgen.sim.block_mask import BackwardView
from flashgen.sim import hardware as hw
from flashgen.sim.copies import VEC_ELEMS, CopyTrace, trace_copy
from flashgen.sim.cta import CTA, HazardTracker, check_mods

_F32 = np.float32


@attrs.frozen
class BwdProblem:
    """What one CTA sees: sequence lengths, its key block ``kb``, the mask's run-time arguments; for a
    plan built with mods its batch ``b``, the first query head ``h0`` of its kv head's group (work item
    ``(h, qb)`` is query head ``h0 + h``) and the mods' values (score, mask; ``{}`` for none)."""

    seq_q: int
    seq_k: int
    kb: int
    mask_offset: int = 0
    window_left: int = -1
    window_right: int = -1
    b: int = 0
    h0: int = 0
    mod_values: tuple = attrs.field(default=({}, {}), eq=False)

    @property
    def mask_args(self) -> tuple[int, int, int]:
        return self.mask_offset, self.window_left, self.window_right


@attrs.frozen
class BwdHeadData:
    """One query head's inputs to the CTA, 16-bit patterns ``[seq_q, d]`` (q, do) and fp32 ``[seq_q]``
    (the forward's lse and the preprocess's D)."""

    q: np.ndarray
    do: np.ndarray
    lse: np.ndarray
    delta: np.ndarray


def trace_backward(plan: BackwardPlan) -> dict[str, CopyTrace]:
    """Traces of every shared-memory copy of the plan, keyed by copy name."""
    return {copy.name: trace_copy(plan, kind, copy) for kind, copy in plan.copies()}


def backward_scores(plan, prob: BwdProblem, s: np.ndarray, queries: np.ndarray, keys: np.ndarray, head: int, masked: bool,
                    scale: float) -> np.ndarray:
    """The scores P^T is recomputed from (fp32, -inf where not kept), as the emitters' RecomputeP leaves
    them before ``bwd_prob``: ``s`` raw S^T accumulator values, ``queries`` / ``keys`` their global indices
    (broadcast to ``s``), ``masked`` the item's ``masked`` flag (``ScoreMask.backward_masked_cpp``: the built-in
    rule's ``bwd_block_needs_mask``, or a block the block mask does not call full). Without mods the built-in
    rule and ``i < seq_q`` where ``masked``; with mods :meth:`ScoreMask.recompute_cpp`'s rule, whose numpy
    twin is the forward's :meth:`ScoreMask.apply`."""
    mask = plan.score_mask
    if mask.mods is None:
        if not masked:
            return s
        keep = plan.query_blocks.keep_array(queries, keys, prob.seq_q, prob.seq_k, *prob.mask_args)
        return np.where(keep, s, _F32(-np.inf)).astype(_F32)
    return mask.apply(s, queries, keys, masked, b=prob.b, h=head, seq_q=prob.seq_q, seq_k=prob.seq_k,
                      mask_args=prob.mask_args, mod_values=prob.mod_values, scale=scale)


def backward_dscores(plan, prob: BwdProblem, p: np.ndarray, dp: np.ndarray, d: np.ndarray, s: "np.ndarray | None", queries: np.ndarray,
                     keys: np.ndarray, head: int, scale: float) -> np.ndarray:
    """dS^T: :class:`ScoreGrad` of P^T, dP^T and each value's D, then the score_mod's chain rule
    (:meth:`ScoreMask.score_grad`, :meth:`ScoreMask.score_grad_cpp`'s twin) at the raw scores ``s`` where the
    derivative reads them (``s`` needed only then), else at score 0 as the emitted call passes."""
    ds = plan.score_grad.evaluate(p, dp, d)
    mask = plan.score_mask
    if mask.mods is None:
        return ds
    raw = s if mask.derivative_reads_score else np.zeros_like(ds)
    return mask.score_grad(ds, p, raw, queries, keys, b=prob.b, h=head, mod_values=prob.mod_values, scale=scale)


def scale_log2(plan, scale: float) -> np.float32:
    """The recompute's ``p.scale_log2``: ``scale * log2(e)``, or ``log2(e)`` with a score_mod (which saw the
    scale; ``KernelMods.fill_cpp(backward=True)``)."""
    return plan.recompute.scale_log2(1.0 if plan.score_mask.score_mod is not None else scale)


def operand_regs(load: OperandLoad, image: np.ndarray, trace: CopyTrace, warp: int) -> np.ndarray:
    """All fragments of an operand for one warp, ``[m or n x4 blocks, k16 steps, 32, 4, 2]``."""
    addr = fr.operand_addresses(trace)[warp]
    atom = load.copy.atom
    regs = hw.ldmatrix(image, addr, atom.num, atom.trans)
    return regs.swapaxes(0, 1) if load.copy.partition.loops[0].name == "kk" else regs


def warp_gemm(gemm: WarpGemm, b_regs: np.ndarray, a_regs: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """``acc [m_tiles, n_tiles, 32, 4] += A B`` over the k16 steps (A ``[m_tiles, k16, 32, 4, 2]``)."""
    nn_of, regs_of = fr.b_operand_pairs(gemm.n_tiles)
    for kq in range(gemm.k // 16):
        x4 = b_regs[nn_of, kq]
        b = np.take_along_axis(x4, regs_of[:, None, :, None], axis=2)
        acc = fr.mma_step(acc, a_regs[:, kq], b, gemm.mma.dtype)
    return acc


class _BwdCta:
    """Executes one CTA; ``dq_accum``: per query head of the group, the ``[seq_q, d]`` fp32 buffer;
    ``turns``: per query head of the group, the turn counter of each query block (deterministic)."""

    def __init__(self, plan: BackwardPlan, prob: BwdProblem, traces: dict, k: np.ndarray, v: np.ndarray,
                 heads: list[BwdHeadData], dq_accum: list[np.ndarray], scale: float, turns: list[np.ndarray] | None = None,
                 block_mask: "BackwardView | None" = None):
        cfg = self.cfg = plan.cfg
        self.plan, self.prob, self.tr, self.heads, self.dq_accum = plan, prob, traces, heads, dq_accum
        self.block_mask = block_mask  # the mask_mod's (flashgen.sim.block_mask.BackwardView), or None
        self.turns = turns if turns is not None else [np.zeros(-(-prob.seq_q // cfg.B_r), np.int64) for _ in heads]
        self.kv = {"K": k[prob.kb * cfg.B_c:(prob.kb + 1) * cfg.B_c], "V": v[prob.kb * cfg.B_c:(prob.kb + 1) * cfg.B_c]}
        qb = plan.query_blocks.block_range(prob.kb, prob.seq_q, prob.seq_k, *prob.mask_args)
        if block_mask is not None:
            qb = block_mask.clip(prob.kb, *qb, cfg.deterministic)
        self.work = [(h, qb[0] + q) for h, q in plan.items.order(max(0, qb[1] - qb[0]), len(heads), prob.kb)]  # the plan's walk
        # tracked per (row, column part), parts of ``width`` columns: K and V, over which the warps of a group stage
        # dK / dV side by side; with split_scores P^T and dS^T, whose query columns the warps of a group store
        self.parts = {"K": (cfg.d_split, cfg.d_cols_per_warp), "V": (cfg.d_split, cfg.d_cols_per_warp)}
        rows = {"K": cfg.B_c, "V": cfg.B_c, "dS": cfg.B_c}
        if cfg.split_scores:
            self.parts |= {n: (cfg.d_split, cfg.score_cols_per_warp) for n in ("P", "dS")}
            rows["P"] = cfg.B_c
        rows |= {self.tile(n, s): cfg.B_r for n in STREAMED + STATS for s in range(cfg.stages)}
        self.hz = HazardTracker({t: n * self.parts.get(t, (1, 0))[0] for t, n in rows.items()}, cfg.n_warps)
        self.image = np.zeros(plan.smem_layout["end"] // 2, np.uint16)
        self.stats = {self.tile(name, s): np.zeros(cfg.B_r, _F32) for name in STATS for s in range(cfg.stages)}
        self.staged: dict[int, tuple] = {}
        self.scale = _F32(scale)
        self.scale_log2 = scale_log2(plan, scale)
        W, mk = cfg.n_warps, cfg.key_rows_per_warp // 16
        nd, nq = plan.gemms["dV"].n_tiles, plan.gemms["S"].n_tiles
        self.dk = np.zeros((W, mk, nd, 32, 4), _F32)
        self.dv = np.zeros((W, mk, nd, 32, 4), _F32)
        self.s = np.zeros((W, mk, nq, 32, 4), _F32)  # S^T, then P^T (fp32)
        self.dp = np.zeros((W, mk, nq, 32, 4), _F32)  # dP^T, then dS^T
        self.dq = np.zeros((W, plan.gemms["dQ"].m_tiles, plan.gemms["dQ"].n_tiles, 32, 4), _F32)
        # per dQ value [warp, lane, value, mi, nt]: the (row, column) its add reaches through the buffer's fragment
        # order and the conversion's reads, and its own column (the kernel skips those past d_head)
        frag = plan.dq_fragments
        warp, lane, value, mi, nt = np.indices((W, 32, 4, frag.m_tiles, frag.n_tiles))
        self.dq_places = (*frag.element(frag.slot(warp, lane, mi, nt) + value), frag.coords()[1])
        self.where = ""

    def tile(self, name: str, j: int) -> str:
        """The hazard tracker's name of the stage of streamed tile (or statistic) ``name`` that work item
        ``j`` uses (K, V and dS have one)."""
        return f"{name}@{j % self.cfg.stages}" if self.cfg.stages > 1 and name in STREAMED + STATS else name

    def stage_image(self, name: str, j: int) -> np.ndarray:
        """The shared-memory image as seen from the stage of ``name`` that item ``j`` uses (a view)."""
        if name not in STREAMED:
            return self.image
        return self.image[(j % self.cfg.stages) * self.plan.stage_bytes[name] // 2:]

    # -- the walk
    def run(self) -> tuple[np.ndarray, np.ndarray]:
        """The CTA alone (its turns, if it waits for any, must have come already)."""
        return run_ctas([self])[0]

    def walk(self):
        """The CTA's steps; at each :class:`WaitOrder` it yields ``(turn counters, query block, rank)``
        and goes on once the counter has reached the rank. Returns dK and dV (the epilogue's)."""
        sched = self.plan.schedule
        n = len(self.work)
        for i, step in enumerate(sched.prologue):
            self.where = f"prologue step {i} ({step})"
            if runs(step.guard, 0, 0, n):
                self.step(step, 0)
        for j in range(n):
            for i, step in enumerate(sched.body):
                self.where = f"query block {self.work[j]} step {i} ({step})"
                if not runs(step.guard, j, 0, n):
                    continue
                if isinstance(step, WaitOrder):
                    h, qb = self.work[j]
                    yield self.turns[h], qb, self.plan.query_blocks.key_rank(qb, self.prob.kb, self.prob.seq_q, self.prob.seq_k,
                                                                              *self.prob.mask_args)
                self.step(step, j)
        return self.epilogue()

    def signal_order(self, step: SignalOrder, j: int) -> None:
        h, qb = self.work[j]
        self.turns[h][qb] += 1

    def step(self, step: Step, j: int) -> None:
        run = _STEPS.get(type(step))
        if run is None:
            self.hz.hazards.append(f"{self.where}: no simulation of step {type(step).__name__}")
        else:
            run(self, step, j)

    def rows(self, name: str, warp: int | None = None, axis: str = "rows", tile: str = "") -> np.ndarray:
        """The hazard tracker's units of ``tile`` that copy ``name`` touches (of one warp, or all):
        its rows (``axis``: the trace's rows or columns), for a tile of :attr:`parts` (row, column part) pairs."""
        t = self.tr[name]
        sel = (lambda a: a) if warp is None else (lambda a: a[warp])
        r, ok = sel(getattr(t, axis)), sel(t.in_tile)
        parts, width = self.parts.get(tile, (1, 0))
        if parts > 1:  # part h: the columns warp h of a group writes (the last: up to the tile's width)
            other = sel(t.cols if axis == "rows" else t.rows)
            r = r * parts + np.minimum(other // width, parts - 1)
        return np.unique(r[ok])

    def label(self, name: str, j: int) -> str:
        return name if name in ("K", "V") else f"{name}{self.work[j]}"

    # -- copies and the memory model
    def copy(self, step: Copy, j: int) -> None:
        name, cfg = step.arg, self.cfg
        if name not in ("K", "V"):
            j = step.block.index(j, 0, len(self.work)) if step.block is not None else j  # the item it loads
        tile = self.tile(name, j)
        if name in STATS:
            atom = self.plan.stats[name].atom
            ev = self.hz.write(tile, np.arange(cfg.B_r), CTA, atom.is_async, self.label(name, j), self.where)
            h, qb = self.work[j]
            src = getattr(self.heads[h], "lse" if name == "LSE" else "delta")[qb * cfg.B_r:(qb + 1) * cfg.B_r]
            self.staged[ev] = ("stats", tile, np.pad(src.astype(_F32), (0, cfg.B_r - src.shape[0])))
            if not atom.is_async:
                self.land(ev)
            return
        trace = self.tr[f"g2s_{name}"]
        ev = self.hz.write(tile, self.rows(trace.name, tile=name), CTA, trace.atom.is_async, self.label(name, j), self.where)
        if name in ("K", "V"):
            block = self.kv[name]
        else:
            h, qb = self.work[j]
            block = getattr(self.heads[h], name.lower())[qb * cfg.B_r:(qb + 1) * cfg.B_r]
        at, values = fr.g2s_payload(trace, block)
        offset = (j % cfg.stages) * self.plan.stage_bytes[name] // 2 if name in STREAMED else 0
        self.staged[ev] = ("image", at + offset, values)

    def wait(self, step: Wait, j: int) -> None:
        for ev in self.hz.wait(int(step.arg)):
            self.land(ev)

    def land(self, ev: int) -> None:
        kind, a, b = self.staged.pop(ev)
        if kind == "stats":
            self.stats[a][:] = b
        else:
            self.image[a] = b

    def read(self, tile: str, trace: str, warp: int, j: int, axis: str = "rows") -> None:
        self.hz.read(self.tile(tile, j), self.rows(trace, warp, axis, tile), warp,
                     self.label(tile, j) if tile not in _SCORE_TILES else f"{tile}{self.work[j]}", self.where)

    # -- GEMMs
    def gemm(self, step: Gemm, j: int) -> None:
        g = self.plan.gemms[step.arg]
        for w in range(self.cfg.n_warps):
            _GEMMS[step.arg](self, g, w, j)

    def _ab(self, g: WarpGemm, w: int, j: int, a_tile: str | None, b_tile: str) -> tuple:
        b_trace = g.b.copy.name
        self.read(b_tile, b_trace, w, j)
        b = operand_regs(g.b, self.stage_image(b_tile, j), self.tr[b_trace], w)
        if a_tile is None:
            return None, b
        self.read(a_tile, g.a.copy.name, w, j, "cols" if g.name == "dQ" else "rows")  # dQ reads dS^T transposed
        return operand_regs(g.a, self.stage_image(a_tile, j), self.tr[g.a.copy.name], w), b

    def gemm_scores(self, g: WarpGemm, w: int, j: int) -> None:
        """S^T = K Q^T or dP^T = V dO^T (a fresh accumulator)."""
        a, b = self._ab(g, w, j, "K" if g.name == "S" else "V", "Q" if g.name == "S" else "dO")
        out = self.s if g.name == "S" else self.dp
        out[w] = warp_gemm(g, b, a, np.zeros_like(out[w]))

    def gemm_kv(self, g: WarpGemm, w: int, j: int) -> None:
        """dV += P^T dO or dK += dS^T Q, A from the S^T / dP^T accumulator (16 bit), or where the plan
        loads it (``split_scores``) from the shared P^T / dS^T."""
        stored = "P" if g.name == "dV" else "dS"
        a, b = self._ab(g, w, j, None if g.a is None else stored, "dO" if g.name == "dV" else "Q")
        acc = self.dv if g.name == "dV" else self.dk
        if a is None:
            a = fr.pack_P((self.s if g.name == "dV" else self.dp)[w], self.cfg.dtype)
        acc[w] = warp_gemm(g, b, a, acc[w])

    def gemm_dq(self, g: WarpGemm, w: int, j: int) -> None:
        a, b = self._ab(g, w, j, "dS", "K")
        self.dq[w] = warp_gemm(g, b, a, np.zeros_like(self.dq[w]))

    # -- the backward's rules on the accumulators
    def _query_cols(self, w: int) -> np.ndarray:
        """The query block's rows that are warp ``w``'s S^T columns: the rows of its S GEMM's B operand."""
        g = self.plan.gemms["S"]
        return g.b.copy.partition.warp_offset(w)[0] + np.arange(8 * g.n_tiles)

    def _columns(self, w: int, stat: str, j: int) -> np.ndarray:
        """``stat`` of each accumulator value's column (query row), ``[mk, nq, 32, 4]``."""
        cols = self._query_cols(w)
        self.hz.read(self.tile(stat, j), cols, w, self.label(stat, j), self.where)
        at = fr.matrix_to_acc(np.broadcast_to(cols.astype(_F32), (self.cfg.key_rows_per_warp, cols.size)))
        return self.stats[self.tile(stat, j)][at.astype(np.int64)]

    def _indices(self, w: int, j: int) -> tuple[np.ndarray, np.ndarray]:
        """Global query row and key of each of warp ``w``'s S^T accumulator values ``[mk, nq, 32, 4]``."""
        cfg, (_, qb) = self.cfg, self.work[j]
        kr = cfg.key_rows_per_warp
        keys = self.prob.kb * cfg.B_c + self.plan.gemms["S"].a.copy.partition.warp_offset(w)[0] + np.arange(kr)
        queries = qb * cfg.B_r + self._query_cols(w)
        return (fr.matrix_to_acc(np.ascontiguousarray(np.broadcast_to(queries[None, :], (kr, queries.size)))),
                fr.matrix_to_acc(np.ascontiguousarray(np.broadcast_to(keys[:, None], (kr, queries.size)))))

    def recompute_p(self, step: Step, j: int) -> None:
        """P^T from S^T through the plan's score rule; dS^T too where the score_mod's derivative reads the score."""
        cfg, prob, plan = self.cfg, self.prob, self.plan
        h, qb = self.work[j]
        needs = plan.query_blocks.block_needs_mask(qb, prob.kb, prob.seq_q, prob.seq_k, *prob.mask_args)
        masked = self.block_mask.masked(h, prob.kb, qb, needs) if self.block_mask is not None else plan.score_mask.backward_masked(needs)
        for w in range(cfg.n_warps):
            raw, (queries, keys) = self.s[w].copy(), self._indices(w, j)
            s = backward_scores(plan, prob, raw, queries, keys, prob.h0 + h, masked, self.scale)
            self.s[w] = plan.recompute.evaluate(s, self.scale_log2, plan.recompute.lse_log2(self._columns(w, "LSE", j)))
            if plan.score_mask.derivative_reads_score:
                self.dp[w] = backward_dscores(plan, prob, self.s[w], self.dp[w], self._columns(w, "D", j), raw, queries, keys,
                                              prob.h0 + h, self.scale)

    def grad_scores(self, step: Step, j: int) -> None:
        if self.plan.score_mask.derivative_reads_score:
            return  # made with P^T
        h = self.work[j][0]
        for w in range(self.cfg.n_warps):
            queries, keys = self._indices(w, j)
            self.dp[w] = backward_dscores(self.plan, self.prob, self.s[w], self.dp[w], self._columns(w, "D", j), None,
                                          queries, keys, self.prob.h0 + h, self.scale)

    # -- stores
    def store_rf(self, step: StoreRF, j: int) -> None:
        """dS^T (the dP^T accumulator) or P^T (the S^T one) -> its shared tile, by every ``ds_store_every``-th warp."""
        name = step.arg
        tr, acc = self.tr[f"r2s_{name}"], self.dp if name == "dS" else self.s
        for w in range(0, self.cfg.n_warps, self.plan.ds_store_every):
            self.hz.write(name, self.rows(tr.name, w, tile=name), w, False, f"{name}{self.work[j]}", self.where)
            _r2s(self.image, tr, acc[w], w, self.cfg.dtype)

    def reduce_gm(self, step: ReduceGM, j: int) -> None:
        """Each warp's dQ tiles added at their slots of the query block's chunk (the plan's DqFragments), each slot's
        values landing where the conversion reads them back (rows below seq_q, columns below d_head)."""
        cfg = self.cfg
        h, qb = self.work[j]
        rows, at, cols = self.dq_places
        vals = self.dq.transpose(0, 3, 4, 1, 2)  # [warp, lane, value, mi, nt]
        grow = qb * cfg.B_r + rows
        ok = (grow < self.prob.seq_q) & (cols < cfg.d_head)  # the kernel skips the padding columns' adds
        np.add.at(self.dq_accum[h], (grow[ok], at[ok]), vals[ok])

    # -- epilogue
    def epilogue(self) -> tuple[np.ndarray, np.ndarray]:
        """dK times the scale; dK and dV -> sK / sV (each warp its own rows) -> global."""
        cfg = self.cfg
        rows = min(cfg.B_c, self.prob.seq_k - self.prob.kb * cfg.B_c)
        out = {}
        if not self.work:  # the last wait (no query block ran): K and V may be in flight
            self.wait(Wait("0"), 0)
        if not self.work or not self.plan.closing_barrier:
            self.where = "epilogue barrier"
            self.hz.barrier()
        self.dk = self.plan.score_grad.scaled(self.dk, self.scale)
        for name, acc, tile in (("dK", self.dk, "K"), ("dV", self.dv, "V")):
            out[name] = np.zeros((rows, cfg.d_head), np.uint16)
            for w in range(cfg.n_warps):
                self.where = f"epilogue warp {w} (r2s_{name})"
                self.hz.write(tile, self.rows(f"r2s_{name}", w, tile=tile), w, False, f"{name}(warp {w})", self.where)
                _r2s(self.image, self.tr[f"r2s_{name}"], acc[w], w, cfg.dtype)
                self.hz.syncwarp(w)
                self.where = f"epilogue warp {w} (s2g_{name})"
                self.hz.read(tile, self.rows(f"s2g_{name}", w, tile=tile), w, f"{name}(warp {w})", self.where)
                _s2g(self.image, self.tr[f"s2g_{name}"], out[name], w, cfg.d_head)
        self.hz.finish("end of kernel")
        return out["dK"], out["dV"]


def _r2s(image: np.ndarray, tr: CopyTrace, acc: np.ndarray, w: int, dtype) -> None:
    """``st.shared.b32 [addr(v=2h, mi, nt)], pack2(acc[mi][nt][2h], acc[mi][nt][2h+1])``."""
    v, names = tr.index[:, 0], tr.index_names
    mi, nt = tr.index[:, names.index("mi")], tr.index[:, names.index("nt")]
    lane = np.arange(32)[None, :]
    lo = acc[mi[:, None], nt[:, None], lane, v[:, None]]
    hi = acc[mi[:, None], nt[:, None], lane, v[:, None] + 1]
    regs = hw.pack2(lo, hi, dtype)
    dst = tr.base_bytes // 2 + tr.smem_elem[w, :, :, 0]
    image[dst] = regs[..., 0]
    image[dst + 1] = regs[..., 1]


def _s2g(image: np.ndarray, tr: CopyTrace, out: np.ndarray, w: int, d_head: int) -> None:
    """16-byte stores of rows below the key tail and columns below d_head."""
    e = np.arange(VEC_ELEMS)
    rows, cols = tr.rows[w, :, :, 0].ravel(), tr.cols[w, :, :, 0].ravel()
    src = tr.base_bytes // 2 + tr.smem_elem[w, :, :, 0].ravel()
    ok = (rows < out.shape[0]) & (cols < d_head)
    out[rows[ok][:, None], cols[ok][:, None] + e] = image[src[ok][:, None] + e]


#: shared tiles of one query block's scores (P^T, dS^T): labelled by work item
_SCORE_TILES = ("P", "dS")

#: step class -> how the backward CTA executes it
_STEPS = {
    Copy: _BwdCta.copy,
    Commit: lambda cta, step, j: cta.hz.commit(),
    Wait: _BwdCta.wait,
    Barrier: lambda cta, step, j: cta.hz.barrier(),
    Gemm: _BwdCta.gemm,
    RecomputeP: _BwdCta.recompute_p,
    GradScores: _BwdCta.grad_scores,
    StoreRF: _BwdCta.store_rf,
    ReduceGM: _BwdCta.reduce_gm,
    WaitOrder: lambda cta, step, j: cta.hz.barrier(),  # the turn came (walk); the barrier after the wait
    SignalOrder: _BwdCta.signal_order,
}


def run_ctas(ctas: "list[_BwdCta]") -> list[tuple[np.ndarray, np.ndarray]]:
    """Run CTAs that arrive in the given order, each until it waits for a turn that has not come; then
    the first in that order whose turn has come goes on. dK and dV of each; CTAs left waiting with no
    turn to come are a hazard of each (in the kernel they would hang)."""
    walks = [cta.walk() for cta in ctas]
    waiting: list = [None] * len(ctas)  # (counters, query block, rank) a CTA waits for; None: ready to start
    out: list = [None] * len(ctas)
    live = list(range(len(ctas)))
    while live:
        ready = [i for i in live if waiting[i] is None or waiting[i][0][waiting[i][1]] == waiting[i][2]]
        if not ready:
            for i in live:
                turns, qb, rank = waiting[i]
                ctas[i].hz.hazards.append(f"{ctas[i].where}: waits forever for turn {rank} of query block {qb} "
                                          f"(the counter stays at {turns[qb]})")
            return [o if o is not None else (None, None) for o in out]
        i = ready[0]
        try:
            waiting[i] = next(walks[i])
        except StopIteration as done:
            out[i] = done.value
            live.remove(i)
    return out

_GEMMS = {"S": _BwdCta.gemm_scores, "dP": _BwdCta.gemm_scores, "dV": _BwdCta.gemm_kv, "dK": _BwdCta.gemm_kv,
          "dQ": _BwdCta.gemm_dq}


# ---- a whole backward pass ---------------------------------------------------------------------------


@attrs.define
class BackwardResult:
    """dq, dk, dv as float64 values of the 16-bit outputs, the forward's o and lse used, and every
    CTA's hazards (empty = ok)."""

    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    hazards: list[str]

    @property
    def ok(self) -> bool:
        return not self.hazards


def _forward(cfg: BackwardConfig, q, k, v, scale: float, keep) -> tuple[np.ndarray, np.ndarray]:
    """The forward's outputs the backward reads: o rounded to the dtype, lse in fp32."""
    from flashgen.sim.grad_reference import head_gradients

    g = head_gradients(q, k, v, np.zeros_like(q), scale, keep)
    return hw.encode(g.o, cfg.dtype), g.lse.astype(_F32)


def _forward_mods(plan, prob: BwdProblem, q, k, v, head: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_forward` of a plan with mods: the scores through the forward's rule (:meth:`ScoreMask.apply` on
    fp32 products, every block masked), then a float64 softmax of them (times the scale without a score_mod,
    which sees it otherwise); lse in the modded scores' units."""
    from flashgen.sim.grad_reference import softmax

    rows, cols = np.arange(q.shape[0])[:, None], np.arange(k.shape[0])[None, :]
    mask = plan.score_mask
    s = mask.apply(q @ k.T, rows, cols, True, b=prob.b, h=head, seq_q=prob.seq_q, seq_k=prob.seq_k,
                   mask_args=prob.mask_args, mod_values=prob.mod_values, scale=scale)
    p, lse = softmax(s.astype(np.float64) * (1.0 if mask.score_mod is not None else scale))
    return hw.encode(p @ v, plan.cfg.dtype), lse.astype(_F32)


@attrs.frozen
class BwdPass:
    """One backward problem as every engine's CTAs see it: the inputs' 16-bit patterns (``bits``) and
    values (``val``) by name (q, k, v, do: ``(batch, seq, heads, d)``), the kept scores, the scale and
    the mask's run-time arguments. ``plan``: any backward plan (its cfg, row_dot, score_grad and
    score_mask); ``mod_values``: its mods' values (score, mask; ``{}`` for none)."""

    plan: object
    bits: dict
    val: dict
    keep: np.ndarray
    scale: float
    offset: int
    left: int
    right: int
    mod_values: tuple = ({}, {})

    @classmethod
    def of(cls, plan, q, k, v, do, causal: bool, window: "tuple[int, int] | None", align: str,
           softmax_scale: "float | None", mod_values: tuple = (None, None)) -> "BwdPass":
        """The inputs rounded to the plan's dtype; the call's mask must be the config's, the mods' values
        those the plan's mods need (:func:`flashgen.sim.cta.check_mods`)."""
        from flashgen.sim.grad_reference import keep_mask

        cfg = plan.cfg
        check_mods(plan.score_mask, mod_values, None)
        kind = "causal" if causal else "window" if window is not None else "none"
        if kind != cfg.mask:
            raise ValueError(f"the call's mask is {kind!r}, the config's {cfg.mask!r}")
        Sq, d, Sk = q.shape[1], q.shape[3], k.shape[1]
        scale = 1.0 / np.sqrt(d) if softmax_scale is None else float(softmax_scale)
        bits = {n: hw.encode(x, cfg.dtype) for n, x in (("q", q), ("k", k), ("v", v), ("do", do))}
        val = {n: hw.decode(x, cfg.dtype).astype(np.float64) for n, x in bits.items()}
        left, right = key_window(causal, window)
        offset = Sk - Sq if align == "bottom_right" else 0
        return cls(plan, bits, val, keep_mask(Sq, Sk, causal, window, align), scale, offset, left, right,
                   tuple({} if x is None else x for x in mod_values))

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.bits["q"].shape[2] // self.bits["k"].shape[2]

    def arrivals(self) -> dict[tuple[int, int], list[int]]:
        """Per (batch entry, kv head), its key blocks in the order the grid starts their CTAs (the plan's
        :class:`~flashgen.attention.backward_grid.BackwardGrid`); the pairs in the order of their first CTA.
        The CTAs of one pair share dQ's rows and turns; those of different pairs share nothing, so running
        pair by pair runs the grid's order."""
        B, Sk, Hk = self.bits["k"].shape[0], self.bits["k"].shape[1], self.bits["k"].shape[2]
        out: dict[tuple[int, int], list[int]] = {}
        for kb, hk, b in self.plan.grid.dispatch_order(-(-Sk // self.plan.cfg.B_c), Hk, B):
            out.setdefault((b, hk), []).append(kb)
        return out

    def problem(self, kb: int, b: int = 0, hk: int = 0) -> BwdProblem:
        """What the CTA of key block ``kb`` of batch ``b``'s kv head ``hk`` sees."""
        return BwdProblem(self.bits["q"].shape[1], self.bits["k"].shape[1], kb, self.offset, self.left, self.right,
                          b, hk * self.group, self.mod_values)

    def heads(self, b: int, hk: int) -> list[BwdHeadData]:
        """The query heads of kv head ``hk`` with the forward's lse and the preprocess's D."""
        cfg, val, out = self.plan.cfg, self.val, []
        prob = self.problem(0, b, hk)
        for h in range(hk * self.group, (hk + 1) * self.group):
            qkv = val["q"][b, :, h], val["k"][b, :, hk], val["v"][b, :, hk]
            o, lse = (_forward(cfg, *qkv, self.scale, self.keep) if self.plan.score_mask.mods is None else
                      _forward_mods(self.plan, prob, *qkv, h, self.scale))
            delta = self.plan.row_dot.evaluate(val["do"][b, :, h], hw.decode(o, cfg.dtype))
            out.append(BwdHeadData(self.bits["q"][b, :, h], self.bits["do"][b, :, h], lse, delta))
        return out

    def buffers(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Zeroed outputs: dQ's fp32 sums ``[batch, heads, seq_q, d]``, dK and dV (16-bit patterns, k's shape)."""
        B, Sq, H, d = self.bits["q"].shape
        return np.zeros((B, H, Sq, d), _F32), np.zeros(self.bits["k"].shape, np.uint16), np.zeros(self.bits["k"].shape, np.uint16)

    def put_block(self, out: np.ndarray, b: int, hk: int, kb: int, block: np.ndarray) -> None:
        """Key block ``kb``'s rows of dK or dV (``block``: those below seq_k) into ``out``."""
        B_c = self.plan.cfg.B_c
        out[b, kb * B_c:kb * B_c + block.shape[0], hk] = block

    def result(self, dq_acc: np.ndarray, dk: np.ndarray, dv: np.ndarray, hazards: list[str]) -> "BackwardResult":
        """dQ (``dq_acc``: fp32 ``[batch, heads, seq_q, d]``) times the scale, and dK, dV (16-bit patterns), as values."""
        dt = self.plan.cfg.dtype
        dq = hw.encode(self.plan.score_grad.scaled(dq_acc, self.scale), dt).transpose(0, 2, 1, 3)
        return BackwardResult(*(hw.decode(x, dt).astype(np.float64) for x in (dq, dk, dv)), hazards)


def simulate_backward(cfg_or_plan: "BackwardConfig | BackwardPlan", q: np.ndarray, k: np.ndarray, v: np.ndarray,
                      do: np.ndarray, *, causal: bool = False, window: "tuple[int, int] | None" = None,
                      align: str = "top_left", softmax_scale: float | None = None,
                      key_block_order: "list[int] | None" = None, mod_values: tuple = (None, None)) -> BackwardResult:
    """The backward of ``(batch, seq, heads, d_head)`` float inputs (rounded to the config's dtype
    first; k and v may have fewer heads): every CTA of the grid (batch, kv head, key block) with the
    preprocess before and the dQ conversion after. The config's mask must match ``causal`` / ``window``.
    A plan built with a score_mod / mask_mod: ``mod_values`` their values (score, mask:
    :meth:`~flashgen.mods.ModArgs.values`); the forward's o and lse are made through the same mods."""
    plan = cfg_or_plan if isinstance(cfg_or_plan, BackwardPlan) else make_backward_plan(cfg_or_plan)
    cfg = plan.cfg
    run = BwdPass.of(plan, q, k, v, do, causal, window, align, softmax_scale, mod_values)
    Sq, Sk = q.shape[1], k.shape[1]
    group = run.group
    n_kb = -(-Sk // cfg.B_c)
    if key_block_order is not None and sorted(key_block_order) != list(range(n_kb)):
        raise ValueError(f"key_block_order={list(key_block_order)}: expected an order of the {n_kb} key blocks 0..{n_kb - 1}")
    traces = trace_backward(plan)
    dq_acc, dk, dv = run.buffers()
    hazards: list[str] = []
    for (b, hk), arrived in run.arrivals().items():
        heads = run.heads(b, hk)
        turns = [np.zeros(-(-Sq // cfg.B_r), np.int64) for _ in range(group)]
        order = arrived if key_block_order is None else list(key_block_order)
        ctas = [_BwdCta(plan, run.problem(kb, b, hk), traces, run.bits["k"][b, :, hk], run.bits["v"][b, :, hk],
                        heads, [dq_acc[b, h] for h in range(hk * group, (hk + 1) * group)], run.scale, turns) for kb in order]
        for kb, cta, (dk_blk, dv_blk) in zip(order, ctas, run_ctas(ctas)):
            if dk_blk is not None:
                run.put_block(dk, b, hk, kb, dk_blk)
                run.put_block(dv, b, hk, kb, dv_blk)
            hazards += [f"CTA (batch {b}, kv head {hk}, key block {kb}): {x}" for x in cta.hz.hazards]
    return run.result(dq_acc, dk, dv, hazards)


def backward_coverage(plan: BackwardPlan, traces: dict[str, CopyTrace] | None = None) -> dict:
    """The forward's coverage checks (:mod:`flashgen.sim.copies`) on every backward copy: each g2s
    chunk written once; each warp's ldmatrix loads deliver exactly its operand tile (A: the warp's
    own key rows, or for dS its own query rows; B: the whole tile); each r2s writes every element of
    the warp's rows once, at its layout offset; each s2g reads the warp's rows once."""
    from flashgen.sim import copies as cp

    cfg = plan.cfg
    traces = trace_backward(plan) if traces is None else traces
    kr, qr, dw, sp = cfg.key_rows_per_warp, cfg.query_rows_per_warp, cfg.d_cols_per_warp, cfg.d_split
    # warp w = place h of group g: the group's rows, the place's columns (of d) -- from the config alone;
    # for dQ (dS, K^T) place w % qs of dQ's grid row w // qs (qs = d_split unless dq_split)
    group, place = [w // sp for w in range(cfg.n_warps)], [w % sp for w in range(cfg.n_warps)]
    qs, qw = cfg.dq_warp_cols, cfg.dq_cols_per_warp
    keys = [(g * kr, 0) for g in group]
    own_d = {n: [(0, h * dw) for h in place] for n in ("s2r_dOt", "s2r_Qt")}
    own_d["s2r_Kt"] = [(0, (w % qs) * qw) for w in range(cfg.n_warps)]
    own_a = {"s2r_K": (kr, keys), "s2r_V": (kr, keys), "s2r_dS": (qr, [(w // qs * qr, 0) for w in range(cfg.n_warps)]),
             "s2r_Pt": (kr, keys), "s2r_dSt": (kr, keys)}
    need_k = {"s2r_dS": cfg.B_c, "s2r_Pt": cfg.B_r, "s2r_dSt": cfg.B_r}
    nw = cfg.score_cols_per_warp  # split_scores: warp h's query columns of S^T and dP^T, rows of sQ / sdO
    if cfg.split_scores:
        own_a |= {n: (nw, [(h * nw, 0) for h in place]) for n in ("s2r_Q", "s2r_dO")}
    whole_d = sp == 1  # one warp per row: its dK / dV rows reach d_head, the padding columns included
    out = {}
    for kind, copy in plan.copies():
        tr = traces[copy.name]
        if kind == "g2s":
            out[copy.name] = cp.check_g2s(tr)
        elif kind == "s2r":
            need = need_k.get(copy.name, (qw if copy.name == "s2r_Kt" else dw) if copy.name in own_d else cfg.d_mma)
            rows, origins = own_a.get(copy.name, (None, own_d.get(copy.name)))
            out[copy.name] = cp.check_ldmatrix(tr, rows, need, origins)
        elif copy.name in ("r2s_dS", "r2s_P"):
            first = [h * nw if cfg.split_scores else 0 for h in place]  # else the group's warps hold the same columns
            out[copy.name] = cp.check_r2s(tr, kr, nw, origins=[(g * kr, c) for g, c in zip(group, first)],
                                          owned_cols=nw if cfg.split_scores else None)
        elif kind == "r2s":
            out[copy.name] = cp.check_r2s(tr, kr, cfg.d_head if whole_d else dw, origins=[(g * kr, h * dw) for g, h in zip(group, place)],
                                          owned_cols=None if whole_d else dw)
        else:
            cols = cfg.d_smem if whole_d else dw
            out[copy.name] = cp.check_s2g(tr, kr, [(g * kr, h * cols) for g, h in zip(group, place)], cols)
    return out
