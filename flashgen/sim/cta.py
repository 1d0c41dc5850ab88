"""One CTA's forward pass, step by step through ``plan.schedule``, with async-hazard tracking.

:func:`simulate_cta` executes the prologue, then the body for each KV block ``j`` in
``[j_begin, n_blocks)`` (the plan's ``ScoreMask`` decides the range; every step's
guard is evaluated), then the emitted epilogue (the final wait when no block ran,
O /= l, log-sum-exp, r2s, ``__syncwarp``, s2g), on a flat shared-memory image:
copies through the plan's copy traces (rows past the sequence end and columns past
d_head zero-filled, as the predicated copies do), GEMMs through
:mod:`flashgen.sim.fragments`, the score rule (:meth:`ScoreMask.apply`: built-in mask, the user's
score_mod / mask_mod, the block mask's masked path and key-block clip) and online softmax as
the plan's :class:`~flashgen.attention.softmax.OnlineSoftmax` and
:class:`~flashgen.attention.epilogue.Epilogue` evaluate them (the rules the emitter renders:
fp32, per lane, with the plan's shuffle-xor row reductions).

The walk also tracks the memory model (:class:`HazardTracker`), per shared tile and
row:

* each ``cp.async`` copy joins the current uncommitted group; ``commit`` closes the
  group; ``wait N`` completes every committed group but the newest ``N``; data lands
  in the image only when its group completes (so a missing wait also gives wrong
  numbers); synchronous copies complete at once;
* ``barrier`` publishes every completed write to all warps and ends the "read since
  the last barrier" window; ``__syncwarp`` publishes a warp's own writes to itself;
* reading a tile (gemm, load_rf, s2g) whose latest write has not completed, or has
  not been published to the reader, is a hazard; so is reading the wrong KV block
  or rows nobody wrote;
* overwriting rows another warp has read since the last barrier (write after read),
  or rows with a copy still in flight (write after write), is a hazard;
* register dataflow: gemm S needs resident Q fragments if the plan keeps Q in
  registers; softmax needs this block's S; gemm O needs this block's P; every block
  must be computed exactly once; no copy may be in flight when the kernel exits.

Numerics (fp32 throughout, like the kernel): ``fmaf`` with one rounding
(:func:`hardware.fma32`); ``ex2.approx.ftz``, ``expf`` and ``logf`` modelled as the
correctly rounded results (the GPU's are within 2 ulp); the emitted rules spell their
fused multiply-adds as ``fmaf``, so no result depends on nvcc's contraction.
"""
from __future__ import annotations

from typing import Callable

import attrs
import numpy as np

from flashgen.attention.epilogue import epilogue
from flashgen.attention.pipeline import CpAsyncGroups
from flashgen.attention.softmax import online_softmax, scale_row
from flashgen.dsl.config import LOG2E, KernelConfig
from flashgen.dsl.plan import KernelPlan, make_plan
from flashgen.dsl.steps import Barrier, Commit, Copy, Gemm, LoadRF, Softmax, Step, Wait, runs
from flashgen.sim import block_mask as bm
from flashgen.sim import fragments as fr
from flashgen.sim import hardware as hw
from flashgen.sim.copies import CopyTrace, VEC_ELEMS, trace_plan

# ---- the hazard tracker -----------------------------------------------------------------------------

CTA = -1  # writer id of a CTA-wide copy


@attrs.define
class _Write:
    id: int
    tile: str
    label: str  # what the rows hold: "Q", "K[2]", "O(warp 1)"
    writer: int  # CTA or a warp
    is_async: bool
    where: str
    committed: bool = False
    completed: bool = False
    published: bool = False
    self_visible: bool = False  # a warp's own write after __syncwarp


class HazardTracker:
    """Shared-memory visibility and ordering, per tile and row, while walking a schedule.

    ``tiles``: tile name -> number of rows. Every problem found is appended to
    ``hazards`` as a readable string (the walk goes on).
    """

    def __init__(self, tiles: dict[str, int], n_warps: int) -> None:
        self.n_warps = n_warps
        self.latest = {t: np.full(n, -1, dtype=np.int64) for t, n in tiles.items()}
        self.reads = {t: np.zeros((n_warps, n), dtype=bool) for t, n in tiles.items()}
        self.events: list[_Write] = []
        self.groups = CpAsyncGroups().queue()  # the async writes' ids, grouped as committed
        self.hazards: list[str] = []

    # -- writes
    def write(self, tile: str, rows: np.ndarray, writer: int, is_async: bool, label: str, where: str) -> int:
        mask = self._mask(tile, rows)
        readers = self.reads[tile][:, mask].any(axis=1)
        if writer != CTA:
            readers[writer] = False
        if readers.any():
            who = ", ".join(str(w) for w in np.flatnonzero(readers))
            self.hazards.append(
                f"{where}: write-after-read: overwrites s{tile} rows that warp(s) {who} read since the last barrier"
            )
        for e in self._events_at(tile, mask):
            if not e.completed:
                self.hazards.append(
                    f"{where}: write-after-write: overwrites s{tile} rows while {e.label} ({e.where}) is still in flight"
                )
        ev = _Write(len(self.events), tile, label, writer, is_async, where, completed=not is_async)
        self.events.append(ev)
        if is_async:
            self.groups.add(ev.id)
        self.latest[tile][mask] = ev.id
        return ev.id

    def commit(self) -> None:
        for i in self.groups.open:
            self.events[i].committed = True
        self.groups.commit()

    def wait(self, n: int) -> list[int]:
        """``cp.async.wait_group n``: ids of the writes completed now."""
        done = self.groups.wait(n)
        for i in done:
            self.events[i].completed = True
        return done

    def barrier(self) -> None:
        for e in self.events:
            if e.completed:
                e.published = True
        for r in self.reads.values():
            r[:] = False

    def syncwarp(self, warp: int) -> None:
        for e in self.events:
            if e.writer == warp and e.completed:
                e.self_visible = True

    # -- reads
    def read(self, tile: str, rows: np.ndarray, warp: int, expect: str | None, where: str) -> None:
        mask = self._mask(tile, rows)
        ids = self.latest[tile][mask]
        if (ids < 0).any():
            self.hazards.append(f"{where}: warp {warp} reads s{tile} rows never written")
        for e in self._events_at(tile, mask):
            if not e.completed:
                why = "not committed" if not e.committed else "no wait_group has completed it"
                self.hazards.append(f"{where}: warp {warp} reads s{tile} while {e.label} ({e.where}) is in flight ({why})")
            elif not (e.published or (e.writer == warp and e.self_visible)):
                self.hazards.append(f"{where}: warp {warp} reads s{tile}: {e.label} ({e.where}) has completed but no barrier made it visible")
            if expect is not None and e.label != expect:
                self.hazards.append(f"{where}: warp {warp} reads s{tile} holding {e.label}, expected {expect}")
        self.reads[tile][warp, mask] = True

    def finish(self, where: str) -> None:
        pending = [e for e in self.events if not e.completed]
        if pending:
            names = ", ".join(f"{e.label} ({e.where})" for e in pending[:3])
            self.hazards.append(f"{where}: the kernel exits with {len(pending)} copy(ies) in flight: {names}")

    # -- helpers
    def _mask(self, tile: str, rows: np.ndarray) -> np.ndarray:
        mask = np.zeros(self.latest[tile].shape[0], dtype=bool)
        mask[np.asarray(rows, dtype=np.int64).ravel()] = True
        return mask

    def _events_at(self, tile: str, mask: np.ndarray) -> list[_Write]:
        ids = np.unique(self.latest[tile][mask])
        return [self.events[i] for i in ids if i >= 0]


# ---- the walk ---------------------------------------------------------------------------------------


@attrs.frozen
class Problem:
    """The run-time arguments one CTA sees: sequence lengths, its first query row, the mask's; the
    batch ``b`` and query head ``h`` its score_mod / mask_mod see, their values ``mod_values`` (score
    and mask :meth:`~flashgen.mods.ModArgs.values`, None for a mod the plan lacks) and the tile's row
    of the mask_mod's block mask (:mod:`flashgen.sim.block_mask`; None: every block partial)."""

    seq_q: int
    seq_k: int
    q_row0: int = 0
    mask_offset: int = 0
    window_left: int = -1
    window_right: int = -1
    b: int = 0
    h: int = 0
    mod_values: tuple = attrs.field(default=(None, None), eq=False)
    block_row: "np.ndarray | None" = attrs.field(default=None, eq=False)

    @property
    def mask_args(self) -> tuple[int, int, int]:
        return self.mask_offset, self.window_left, self.window_right


def _score_mask(plan: KernelPlan):
    return getattr(plan, "score_mask", None)


def kv_range(plan: KernelPlan, prob: Problem) -> tuple[int, int]:
    """``[j_begin, n_blocks)``: the key blocks the CTA visits (the plan's ScoreMask decides, clipped to
    the block mask's row as the emitted ``block_mask_clip``)."""
    mask = _score_mask(plan)
    if mask is None:
        return 0, -(-prob.seq_k // plan.cfg.B_c)
    return bm.clip(prob.block_row, *mask.block_range(prob.q_row0, prob.seq_q, prob.seq_k, *prob.mask_args))


@attrs.define
class CtaResult:
    """``o``: ``[rows, d_head]`` output (uint16 patterns; None when no data was given),
    ``lse``: ``[rows]`` fp32 log-sum-exp (natural log, -inf for a row with no kept score);
    ``hazards``: problems found while walking the schedule (empty = ok); the visited
    key blocks ``[j_begin, n_blocks)``."""

    o: np.ndarray | None
    lse: np.ndarray | None
    hazards: list[str]
    j_begin: int
    n_blocks: int
    #: the key blocks whose S GEMM ran, in order: the blocks walked
    visited: list = attrs.Factory(list)

    @property
    def ok(self) -> bool:
        return not self.hazards


class _Cta:
    """Executes one CTA. With ``data`` None only the schedule and dataflow are checked."""

    def __init__(self, plan: KernelPlan, prob: Problem, traces: dict[str, CopyTrace], data: dict | None, scale: float,
                 blocks: tuple[int, int] | None = None):
        self.plan, self.cfg, self.prob, self.tr = plan, plan.cfg, prob, traces
        cfg = plan.cfg
        self.j_begin, self.n_blocks = kv_range(plan, prob) if blocks is None else blocks
        # the blocks walked (the block mask's empty ones skipped); steps, guards and blocks are evaluated at
        # a block's position in this list, so "block j + 1" is the walk's next block
        self.walk = bm.walk(prob.block_row, self.j_begin, self.n_blocks)
        self.pos = 0
        self.visited: list[int] = []
        self.hz = HazardTracker({"Q": cfg.B_r, "K": cfg.B_c, "V": cfg.B_c}, cfg.n_warps)
        self.data = data
        self._row_cache: dict = {}
        self.where = ""
        self.q_res_loaded = np.zeros(cfg.n_warps, dtype=bool)
        self.s_block: list = [None] * cfg.n_warps
        self.p_block: list = [None] * cfg.n_warps
        n = max(self.n_blocks, 0)
        self.done = {"S": np.zeros(n, int), "softmax": np.zeros(n, int), "O": np.zeros(n, int)}
        if data is not None:
            W, mt = cfg.n_warps, cfg.m_tiles_per_warp
            self.image = fr.cta_smem_image(plan)
            self.staged: dict[int, tuple[np.ndarray, np.ndarray]] = {}
            self.addr = {op: fr.operand_addresses(traces[f"s2r_{op}"]) for op in "QKV"}
            self.q_res: list = [None] * W
            self.s_acc = np.zeros((W, mt, plan.gemm_S.n_tiles, 32, 4), np.float32)
            self.p_frag = np.zeros((W, mt, plan.gemm_S.n_tiles // 2, 32, 4, 2), np.uint16)
            self.o_acc = np.zeros((W, mt, plan.gemm_O.n_tiles, 32, 4), np.float32)
            self.row_max = np.full((W, mt, 2, 32), -np.inf, np.float32)
            self.row_sum = np.zeros((W, mt, 2, 32), np.float32)
            # with a score_mod the softmax takes the modded scores at scale 1 (the mod saw softmax_scale), except
            # where it adds a bias (the accumulator holds the bias over the scale: ScoreMask.forward_softmax_scale)
            self.mod_scale = np.float32(scale)
            mask = _score_mask(plan)
            self.scale = np.float32(mask.forward_softmax_scale(scale) if mask is not None else scale)
            self.scale_log2 = np.float32(self.scale * np.float32(LOG2E))
            self.softmax_rule, self.epilogue_rule = online_softmax(plan), epilogue(plan)
            rows = max(0, min(cfg.B_r, prob.seq_q - prob.q_row0))
            self.out = np.zeros((rows, cfg.d_head), np.uint16)
            self.lse = np.full(rows, np.nan, np.float32)

    # -- helpers
    def _rows(self, name: str, warp: int | None = None) -> np.ndarray:
        """Tile rows a copy touches (all warps, or one warp's)."""
        key = (name, warp)
        if key not in self._row_cache:
            t = self.tr[name]
            r = t.rows if warp is None else t.rows[warp]
            ok = t.in_tile if warp is None else t.in_tile[warp]
            self._row_cache[key] = np.unique(r[ok])
        return self._row_cache[key]

    def _flag(self, msg: str) -> None:
        self.hz.hazards.append(f"{self.where}: {msg}")

    # -- steps
    def run(self) -> None:
        sched = self.plan.schedule
        n = len(self.walk)
        for i, step in enumerate(sched.prologue):
            self.where = f"prologue step {i} ({_step_text(step)})"
            if runs(step.guard, 0, 0, n):
                self.step(step, self.j_begin, in_body=False)
        for self.pos, j in enumerate(self.walk):
            for i, step in enumerate(sched.body):
                self.where = f"block j={j} step {i} ({_step_text(step)})"
                if runs(step.guard, self.pos, 0, n):
                    self.step(step, j, in_body=True)
        self.where = "end of the KV loop"
        walked = set(self.walk)
        for name, count in self.done.items():
            bad = [b for b in range(len(count)) if count[b] != (b in walked)]
            if bad:
                what = name if name == "softmax" else f"gemm {name}"
                self._flag(f"{what} ran {count[bad[0]]} time(s) for block {bad[0]} (expected once per block walked)")
        self.epilogue()
        self.hz.finish("end of kernel")

    def step(self, step: Step, j: int, in_body: bool) -> None:
        run = _STEPS.get(type(step))
        if run is None:
            self._flag(f"no simulation of step {type(step).__name__}")
        else:
            run(self, step, j, in_body)

    def wait(self, step: Wait, j: int, in_body: bool) -> None:
        for i in self.hz.wait(int(step.arg)):
            self.land(i)

    def copy(self, step: Step, j: int, in_body: bool) -> None:
        op = step.arg
        if op not in ("Q", "K", "V"):
            self._flag(f"copy of unknown tile {op!r}")
            return
        trace = self.tr[f"g2s_{op}"]
        cfg = self.cfg
        if op == "Q":
            label = "Q"
        else:
            u = step.block.index(self.pos, 0, len(self.walk))  # a position in the walk
            if not 0 <= u < len(self.walk):
                self._flag(f"copies {op} block {step.block} at position {u}, outside the {len(self.walk)} block(s) walked")
                return
            b = self.walk[u]
            label = f"{op}[{b}]"
        ev = self.hz.write(op, self._rows(trace.name), CTA, trace.atom.is_async, label, self.where)
        if self.data is not None:
            g = self.data[op]
            block = g if op == "Q" else g[b * cfg.B_c : (b + 1) * cfg.B_c]
            self.staged[ev] = fr.g2s_payload(trace, block)
            if not trace.atom.is_async:
                self.land(ev)

    def land(self, ev: int) -> None:
        if self.data is not None and ev in self.staged:
            dst, val = self.staged.pop(ev)
            self.image[dst] = val

    def load_rf(self, step: Step) -> None:
        if step.arg != "Q":
            self._flag(f"load_rf of {step.arg!r}: only Q fragments are resident")
            return
        if not self.plan.s2r["Q"].resident:
            self._flag("load_rf Q, but the plan does not keep Q resident")
        for w in range(self.cfg.n_warps):
            self.hz.read("Q", self._rows("s2r_Q", w), w, "Q", self.where)
            self.q_res_loaded[w] = True
            if self.data is not None:
                self.q_res[w] = fr.load_resident_Q(self.plan, self.image, self.addr["Q"], w)

    def gemm_S(self, j: int) -> None:
        q = self.plan.s2r["Q"]
        self.done["S"][j] += 1
        self.visited.append(j)
        for w in range(self.cfg.n_warps):
            if q.resident:
                if not self.q_res_loaded[w]:
                    self._flag(f"warp {w}: gemm S uses resident Q fragments that were never loaded (load_rf Q missing)")
            else:
                self.hz.read("Q", self._rows("s2r_Q", w), w, "Q", self.where)
            self.hz.read("K", self._rows("s2r_K", w), w, f"K[{j}]", self.where)
            self.s_block[w] = j
            if self.data is not None and (self.q_res[w] is not None or not q.resident):
                self.s_acc[w] = fr.warp_gemm_S(self.plan, self.image, self.addr["Q"], self.addr["K"], w, self.q_res[w])

    def softmax(self, j: int) -> None:
        self.done["softmax"][j] += 1
        for w in range(self.cfg.n_warps):
            if self.s_block[w] != j:
                self._flag(f"warp {w}: softmax of block {j} before gemm S of that block")
            self.p_block[w] = j
        if self.data is not None:
            self._mask_scores(j)
            self._softmax_math(j)

    def gemm_O(self, j: int) -> None:
        self.done["O"][j] += 1
        for w in range(self.cfg.n_warps):
            if self.p_block[w] != j:
                self._flag(f"warp {w}: gemm O of block {j} without this block's P (softmax missing or late)")
            self.hz.read("V", self._rows("s2r_V", w), w, f"V[{j}]", self.where)
            if self.data is not None:
                self.o_acc[w] = fr.warp_gemm_O(self.plan, self.image, self.addr["V"], w, self.p_frag[w], self.o_acc[w])

    # -- math
    def _mask_scores(self, j: int) -> None:
        """The plan's score rule (:meth:`ScoreMask.apply`): the mask in blocks on the masked path
        (:meth:`ScoreMask.masked_path`, as emitted), a score_mod in every block.

        Which (row, column) an accumulator value holds is the PTX C fragment map.
        """
        mask, prob, cfg = _score_mask(self.plan), self.prob, self.cfg
        if mask is None:
            return
        masked = mask.masked_path(j, prob.q_row0, prob.seq_q, prob.seq_k, *prob.mask_args, row=prob.block_row)
        if not masked and mask.score_mod is None:
            return
        rows, cols = self._acc_indices()
        self.s_acc = mask.apply(self.s_acc, rows, j * cfg.B_c + cols, masked, b=prob.b, h=prob.h, seq_q=prob.seq_q,
                                seq_k=prob.seq_k, mask_args=prob.mask_args, mod_values=prob.mod_values, scale=self.mod_scale,
                                forward=True)

    def _acc_indices(self) -> tuple[np.ndarray, np.ndarray]:
        """Global row and in-block column of every S accumulator value ``[W, mt, tiles, 32, 4]``."""
        if "acc" not in self._row_cache:
            cfg, rpw = self.cfg, self.cfg.rows_per_warp
            rows = np.broadcast_to(self.prob.q_row0 + np.arange(cfg.B_r)[:, None], (cfg.B_r, cfg.B_c))
            cols = np.broadcast_to(np.arange(cfg.B_c)[None, :], (cfg.B_r, cfg.B_c))
            self._row_cache["acc"] = tuple(np.stack([fr.matrix_to_acc(np.ascontiguousarray(m[w * rpw: (w + 1) * rpw]))
                                                     for w in range(cfg.n_warps)]) for m in (rows, cols))
        return self._row_cache["acc"]

    def _softmax_math(self, j: int) -> None:
        """The plan's online softmax (:mod:`flashgen.attention.softmax`) as the emitted ``_softmax`` calls
        it, vectorised over warps, m tiles and lanes; O rescaled except in the first block (exp2); the
        row sum always takes the factor (a fresh row's is 0 times 0)."""
        sm, f32 = self.softmax_rule, np.float32
        n_tiles = self.s_acc.shape[2]
        s = _flat(self.s_acc)  # [W, mt, 32, values]
        o = _flat(self.o_acc)
        k = self.scale_log2 if sm.exp2 else self.scale
        first = j == self.j_begin
        for h in range(2):
            self.row_max[:, :, h], neg_m, corr = sm.max_step(s, h, self.row_max[:, :, h], k)
            if not (first and sm.skip_first):
                o = scale_row(o, h, corr)
            s, self.row_sum[:, :, h] = sm.exp_step(s, h, self.row_sum[:, :, h], k, neg_m, corr, False)
        self.s_acc = _unflat(s, n_tiles).astype(f32)
        self.o_acc = _unflat(o, self.o_acc.shape[2]).astype(f32)
        for w in range(self.cfg.n_warps):
            self.p_frag[w] = fr.pack_P(self.s_acc[w], self.cfg.dtype)

    # -- epilogue
    def epilogue(self) -> None:
        """Final wait (no block ran), O /= l and lse, r2s into sO (= sQ), ``__syncwarp``, s2g."""
        if self.j_begin >= self.n_blocks:  # the emitted epilogue's guard: Q may still be in flight
            self.where = "epilogue (no key block ran)"
            if self.plan.g2s["Q"].atom.is_async:
                for i in self.hz.wait(0):
                    self.land(i)
            self.hz.barrier()
        if self.data is not None:
            self._normalize()
        r2s, s2g = self.tr["r2s_O"], self.tr["s2g_O"]
        for w in range(self.cfg.n_warps):
            self.where = f"epilogue warp {w} (r2s_O)"
            self.hz.write("Q", self._rows("r2s_O", w), w, False, f"O(warp {w})", self.where)
            if self.data is not None:
                self._r2s(r2s, w)
            self.hz.syncwarp(w)
            self.where = f"epilogue warp {w} (s2g_O)"
            self.hz.read("Q", self._rows("s2g_O", w), w, f"O(warp {w})", self.where)
            if self.data is not None:
                self._s2g(s2g, w)

    def _normalize(self) -> None:
        """The plan's epilogue math (:mod:`flashgen.attention.epilogue`): row sums over the lanes, O /= l,
        the LSE written by one lane per row group."""
        ep = self.epilogue_rule
        l = ep.row_sum(self.row_sum)  # [W, mt, 2, 32]
        o = _flat(self.o_acc)
        for h in range(2):
            o = ep.normalize(o, h, ep.inv(l[:, :, h]))
        self.o_acc = _unflat(o, self.o_acc.shape[2])
        lse = ep.lse(self.row_max, l, self.scale)
        lane = np.arange(32)
        writers = lane[(lane & sum(self.plan.row_reduce_lanes)) == 0]  # one lane per row group
        rpw = self.cfg.rows_per_warp
        for w in range(self.cfg.n_warps):
            for mi in range(self.cfg.m_tiles_per_warp):
                for h in range(2):
                    rows = w * rpw + 16 * mi + hw.C_ROW[writers, 2 * h]
                    ok = rows < self.lse.shape[0]
                    self.lse[rows[ok]] = lse[w, mi, h, writers[ok]]

    def _r2s(self, tr: CopyTrace, w: int) -> None:
        """``st.shared.b32 [addr(v=2h, mi, nt)], pack2(o[mi][nt][2h], o[mi][nt][2h+1])``."""
        v, names = tr.index[:, 0], tr.index_names
        mi = tr.index[:, names.index("mi")]
        nt = tr.index[:, names.index("nt")]
        acc = self.o_acc[w]  # [mt, nT, 32, 4]
        lane = np.arange(32)[None, :]
        lo = acc[mi[:, None], nt[:, None], lane, v[:, None]]  # [I, 32]
        hi = acc[mi[:, None], nt[:, None], lane, v[:, None] + 1]
        convert = self.epilogue_rule.convert
        regs = np.stack([convert(lo, self.cfg.dtype), convert(hi, self.cfg.dtype)], axis=-1)  # [I, 32, 2]: pack2
        dst = tr.base_bytes // 2 + tr.smem_elem[w, :, :, 0]
        self.image[dst] = regs[..., 0]
        self.image[dst + 1] = regs[..., 1]

    def _s2g(self, tr: CopyTrace, w: int) -> None:
        """16-byte stores of rows below the query tail and columns below d_head (as emitted)."""
        e = np.arange(VEC_ELEMS)
        rows = tr.rows[w, :, :, 0].ravel()
        cols = tr.cols[w, :, :, 0].ravel()
        src = tr.base_bytes // 2 + tr.smem_elem[w, :, :, 0].ravel()
        ok = (rows < self.out.shape[0]) & (cols < self.cfg.d_head)
        self.out[rows[ok][:, None], cols[ok][:, None] + e] = self.image[src[ok][:, None] + e]


#: step class -> how the CTA executes it (the plan's schedule is made of these; see flashgen.dsl.steps)
_STEPS = {
    Copy: _Cta.copy,
    Commit: lambda cta, step, j, in_body: cta.hz.commit(),
    Wait: _Cta.wait,
    Barrier: lambda cta, step, j, in_body: cta.hz.barrier(),
    LoadRF: lambda cta, step, j, in_body: cta.load_rf(step),
    Gemm: lambda cta, step, j, in_body: cta.gemm_S(j) if step.arg == "S" else cta.gemm_O(j),
    Softmax: lambda cta, step, j, in_body: cta.softmax(j),
}


def _flat(acc: np.ndarray) -> np.ndarray:
    """``[W, mt, tiles, 32, 4]`` accumulators as the softmax's fragments ``[W, mt, 32, 4 tiles]``
    (the emitted ``flat(acc[mi])``: value 4 nt + c of a lane)."""
    W, mt, n, lanes, c = acc.shape
    return acc.transpose(0, 1, 3, 2, 4).reshape(W, mt, lanes, n * c)


def _unflat(frag: np.ndarray, n_tiles: int) -> np.ndarray:
    """Inverse of :func:`_flat`."""
    W, mt, lanes, _ = frag.shape
    return frag.reshape(W, mt, lanes, n_tiles, 4).transpose(0, 1, 3, 2, 4).copy()


def _step_text(step: Step) -> str:
    text = step.op + (f" {step.arg}" if step.arg else "") + (f" block {step.block}" if step.block else "")
    return text + (f" if {step.guard.to_cpp(end='n_blocks')}" if step.guard else "")


def _plan_of(cfg_or_plan) -> KernelPlan:
    return cfg_or_plan if isinstance(cfg_or_plan, KernelPlan) else make_plan(cfg_or_plan)


def check_schedule(
    cfg_or_plan: "KernelConfig | KernelPlan", n_blocks: int = 3, traces: dict | None = None, j_begin: int = 0
) -> list[str]:
    """Hazards of walking the plan's schedule over key blocks ``[j_begin, n_blocks)`` (no data moved)."""
    plan = _plan_of(cfg_or_plan)
    prob = Problem(seq_q=plan.cfg.B_r, seq_k=n_blocks * plan.cfg.B_c)
    cta = _Cta(plan, prob, trace_plan(plan) if traces is None else traces, None, 1.0, blocks=(j_begin, n_blocks))
    cta.run()
    return cta.hz.hazards


def simulate_cta(
    cfg_or_plan: "KernelConfig | KernelPlan",
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    scale: float | None = None,
    traces: dict | None = None,
    *,
    q_row0: int = 0,
    seq_q: int | None = None,
    mask_offset: int = 0,
    window_left: int = -1,
    window_right: int = -1,
    b: int = 0,
    h: int = 0,
    mod_values: tuple = (None, None),
    block_mask: "np.ndarray | None" = None,
) -> CtaResult:
    """One CTA's forward pass; O ``[rows, d_head]`` as uint16 patterns of the config's dtype.

    ``q``: the CTA's query rows ``[rows <= B_r, d_head]`` (global rows ``q_row0 ...``);
    ``k``, ``v``: ``[seq_k, d_head]``, any ``seq_k >= 0``. uint16 patterns, or float arrays
    (rounded to the dtype first). ``seq_q`` (default ``q_row0 + rows``) and the mask
    arguments matter for masked configs only. ``scale`` defaults to 1/sqrt(d_head).
    A plan built with a score_mod / mask_mod: ``b``, ``h`` the CTA's batch and query head,
    ``mod_values`` the mods' values (score, mask: :meth:`~flashgen.mods.ModArgs.values`),
    ``block_mask`` the call's whole block mask (:func:`flashgen.sim.block_mask.block_mask`) or None.
    """
    plan = _plan_of(cfg_or_plan)
    cfg = plan.cfg
    data = {name: hw.operand_rows(name, x, cfg.dtype, cfg.d_head) for name, x in (("Q", q), ("K", k), ("V", v))}
    rows = data["Q"].shape[0]
    if not 0 < rows <= cfg.B_r:
        raise ValueError(f"Q: expected 1..{cfg.B_r} rows (one CTA), got {rows}")
    seq_k = data["K"].shape[0]
    if data["V"].shape != data["K"].shape:
        raise ValueError(f"K and V must have the same shape; got {data['K'].shape}, {data['V'].shape}")
    if _score_mask(plan) is None and (seq_k % cfg.B_c or rows != cfg.B_r):
        raise ValueError(f"this plan handles no tails: K/V rows must be a multiple of B_c={cfg.B_c} and Q must have {cfg.B_r} rows")
    if getattr(cfg, "mask", "none") != "none" and _score_mask(plan) is None:
        raise ValueError(f"mask {cfg.mask!r}: the plan has no ScoreMask to simulate")
    mask = _score_mask(plan)
    check_mods(mask, mod_values, block_mask)
    row = None if mask is None else bm.row(mask, block_mask, b, h, q_row0 // cfg.B_r)
    prob = Problem(q_row0 + rows if seq_q is None else seq_q, seq_k, q_row0, mask_offset, window_left, window_right,
                   b, h, tuple({} if x is None else x for x in mod_values), row)
    scale = 1.0 / np.sqrt(cfg.d_head) if scale is None else scale
    cta = _Cta(plan, prob, trace_plan(plan) if traces is None else traces, data, scale)
    cta.run()
    return CtaResult(cta.out, cta.lse, cta.hz.hazards, cta.j_begin, cta.n_blocks, cta.visited)


def check_mods(mask, mod_values: tuple, block_mask: "np.ndarray | None") -> None:
    """Clear errors for mod values or a block mask that do not fit the plan's mods."""
    mods = None if mask is None else mask.mods
    if len(mod_values) != 2:
        raise ValueError(f"mod_values: expected (score values, mask values), got {len(mod_values)} item(s)")
    for kind, mod, values in (("score", getattr(mods, "score", None), mod_values[0]),
                              ("mask", getattr(mods, "mask", None), mod_values[1])):
        if mod is None and values is not None:
            raise ValueError(f"{kind}_mod values given, but the plan is built without a {kind}_mod")
        if mod is not None and values is None and (mod.scalars or mod.tensors):
            raise ValueError(f"the plan's {mod.description} needs its values (mod_values)")
    if block_mask is not None and (mods is None or mods.mask is None):
        raise ValueError("block_mask given, but the plan is built without a mask_mod")


# ---- references --------------------------------------------------------------------------------------


def reference_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, keep: np.ndarray | None = None,
                        score: "Callable[[np.ndarray], np.ndarray] | None" = None) -> tuple[np.ndarray, np.ndarray]:
    """(O, lse): softmax(score(scale * q k^T)) v in float64 over the kept scores (inputs: float arrays).

    ``score``: a score_mod over the scaled scores ``[rows, seq_k]`` (float64 in, float64 out); a
    score it makes -inf counts as masked. A row with no kept score gives O = 0 and lse = -inf.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    s = scale * (q @ k.T)
    if score is not None:
        s = np.asarray(score(s), dtype=np.float64)
    if keep is not None:
        s = np.where(keep, s, -np.inf)
    m = s.max(axis=1, keepdims=True) if s.shape[1] else np.full((s.shape[0], 1), -np.inf)
    m_safe = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m_safe)
    l = p.sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        o = np.where(l > 0, (p @ v) / np.where(l > 0, l, 1), 0.0)
        lse = np.where(l[:, 0] > 0, m_safe[:, 0] + np.log(l[:, 0]), -np.inf)
    return o, lse


def reference_attention_lowp(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, dtype: object, keep: np.ndarray | None = None,
                             score: "Callable[[np.ndarray], np.ndarray] | None" = None) -> np.ndarray:
    """O in a plain mixed-precision pipeline: fp32 S (``score`` applied, rounded to fp32) and softmax,
    P rounded to ``dtype``, fp32 P V, output rounded to ``dtype`` (returned as float64 values)."""
    q, k, v = (np.asarray(x, dtype=np.float32) for x in (q, k, v))
    s = (q @ k.T) * np.float32(scale)
    if score is not None:
        s = np.asarray(score(s.astype(np.float64)), dtype=np.float32)
    if keep is not None:
        s = np.where(keep, s, np.float32(-np.inf))
    m = s.max(axis=1, keepdims=True) if s.shape[1] else np.full((s.shape[0], 1), -np.inf, np.float32)
    m = np.where(np.isfinite(m), m, 0).astype(np.float32)
    p = np.exp(s - m).astype(np.float32)
    l = p.sum(axis=1, keepdims=True, dtype=np.float32)
    p16 = hw.decode(hw.encode(p, dtype), dtype)
    with np.errstate(invalid="ignore", divide="ignore"):
        o = np.where(l > 0, (p16 @ v) / np.where(l > 0, l, 1), 0).astype(np.float32)
    return hw.decode(hw.encode(o, dtype), dtype).astype(np.float64)


#: Absolute slack of the CTA tolerance rule.
ABS_TOL = 1e-3


def compare_with_reference(
    cfg: KernelConfig,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    o: np.ndarray,
    scale: float | None = None,
    keep: np.ndarray | None = None,
    lse: np.ndarray | None = None,
    score: "Callable[[np.ndarray], np.ndarray] | None" = None,
) -> dict:
    """Compare a simulated O (and lse) with float64 attention of the same 16-bit inputs.

    Rule: ``max|O - O_f64| <= 2 * max|O_lowp - O_f64| + 1e-3``, where ``O_lowp`` is
    :func:`reference_attention_lowp` (the error any fp32-accumulate / 16-bit-P
    pipeline makes, output rounding included); ``lse`` (if given) within 1e-4
    relative + 1e-4 and -inf exactly where the reference is. ``keep``: ``[rows,
    seq_k]`` scores kept by a mask; ``score``: the score_mod as :func:`reference_attention`
    takes it (the lse is then of the modded scores, as the kernel's). Returns ``ok``, ``max_abs_err``, ``lowp_err``,
    ``bound``, ``abs_tol`` (and ``lse_err``).
    """
    scale = 1.0 / np.sqrt(cfg.d_head) if scale is None else scale
    qv, kv, vv = (hw.decode(x, cfg.dtype) for x in (q, k, v))
    ref, ref_lse = reference_attention(qv, kv, vv, scale, keep, score)
    lowp = reference_attention_lowp(qv, kv, vv, scale, cfg.dtype, keep, score)
    got = hw.decode(o, cfg.dtype).astype(np.float64)
    err = float(np.max(np.abs(got - ref), initial=0.0)) if np.all(np.isfinite(got)) else float("inf")
    lowp_err = float(np.max(np.abs(lowp - ref), initial=0.0))
    bound = 2 * lowp_err + ABS_TOL
    out = {"ok": err <= bound, "max_abs_err": err, "lowp_err": lowp_err, "bound": bound, "abs_tol": ABS_TOL}
    if lse is not None:
        lse = np.asarray(lse, dtype=np.float64)
        fin = np.isfinite(ref_lse)
        same_inf = np.array_equal(fin, np.isfinite(lse))
        lse_err = float(np.max(np.abs(lse[fin] - ref_lse[fin]) / (1 + np.abs(ref_lse[fin])), initial=0.0)) if same_inf else float("inf")
        out["lse_err"] = lse_err
        out["ok"] = out["ok"] and lse_err <= 1e-4
    return out
