"""One CTA of the Hopper (wgmma engine) plan on the CPU: TMA fills, wgmma, online softmax, hazards.

Driven only by :func:`flashgen.dsl.hopper_plan.make_hopper_plan`'s objects: tile offsets and
stage sizes, the descriptors' per-step offsets (read back through the ISA address models
``descriptor_addresses`` / ``descriptor_addresses_mn``), the accumulator and A-register maps,
``p_from_s``, ``o_stage``, the barrier arrive counts, ``row_reduce_lanes``, ``score_mask`` and
the consumer steps. Nothing here re-derives the plan's index math: where the plan is wrong the
numbers or the hazard list say so.

What is modelled
----------------
* **TMA** (:func:`tma_fill`): written from the 128B-swizzle byte rule, not from the tile
  layouts, so tests can compare the two. Rows past the sequence end are zero-filled.
* **Producer**: a sequential program (Q once, then for each key block ``K_j`` and ``V_j``),
  each load waiting for its ring stage to be released by every consumer warp (the plan's
  ``*_empty`` arrive counts). It runs as far ahead as the ring allows after every consumer
  step, so a stage released too early really is overwritten.
* **Consumers**: each walks prologue / body per block / epilogue; round-robin one step at a
  time, a step that must wait (``wait_full`` before the data landed, ``turn`` before the
  other warpgroup's ``pass``) blocks. Pingpong follows the emitted rule: consumer 1 gives
  consumer 0 one initial pass, and consumer 0 takes the one pass left over before exit.
  Steps with a ``guard`` (``release Q`` in the last block of a persistent plan) run where it holds.
* **Persistent plans** are walked for one tile: the ``release Q`` point is checked (after the
  last S GEMM retired, once per consumer), the next tile's reuse of Q and of the O staging
  is left to the GPU tests.
* **wgmma groups**: each ``gemm`` step is one committed group; ``wgmma_wait N`` retires all
  but the ``N`` newest. A group *executes when it retires*, reading shared memory and
  registers then (the latest moment the hardware may read them), so a missing wait or an
  early release also gives wrong numbers, not only a hazard line.
* **Numerics** (fp32 like the kernel): each k16 wgmma is ``fp32(C + A B^T)`` with the
  16-term products summed in float64; softmax with ``ex2`` of ``fma(s, scale*log2e, -m)``;
  ``lse = fma(max, scale, log l)``; P and O rounded to the 16-bit dtype (``cvt.rn``).

Hazards (strings in ``report.hazards``; empty = clean)
------------------------------------------------------
* a step touching S/O/P registers an in-flight group writes (or writing registers it reads);
* ``release`` of a K/V block an in-flight group still reads; double or missing releases;
* a gemm reading a stage without its ``wait_full``, or a stage holding another block;
* dataflow: softmax without this block's S, gemm O without this block's P, O accumulated or
  rescaled at the wrong max, each block's S / softmax / PV not exactly once;
* pingpong named barriers: over-arrival, unbalanced turns and passes at exit, deadlock;
* output staging over another warpgroup's Q/O rows, the K/V ring or the mbarriers; wgmma groups
  in flight at exit.
"""
from __future__ import annotations

import functools
from typing import Callable

import attrs
import numpy as np

from flashgen.dsl.atoms.hopper import WGMMA_64xNx16, descriptor_addresses, descriptor_addresses_mn
from flashgen.dsl.hopper_plan import HopperPlan, SmemTile, TmaTile, make_hopper_plan
from flashgen.dsl.plan import Step
from flashgen.sim import hardware as hw
from flashgen.sim.cta import eval_guard
from flashgen.sim.layout_eval import offsets

LOG2E = 1.4426950408889634  # the emitter's literal
SWIZZLE_SPAN = 128  # bytes of one 128B-swizzle row: 64 16-bit columns per TMA box
WARPS_PER_WG = 4
WG = 128

# ---------------------------------------------------------------------- TMA


def tma_byte_addresses(rows: int, cols: int, base_byte: int = 0, elem_bytes: int = 2) -> np.ndarray:
    """Absolute byte address TMA (128B swizzle) writes element ``(r, c)`` of a ``rows x cols`` tile to.

    Column block ``j = c // 64`` is one box of ``rows x 128`` bytes at ``base + j*rows*128``;
    inside it element ``(r, c)`` is at byte ``r*128 + 2*(c % 64)``; then the absolute address
    has its 16-byte granule XORed with its 128-byte line: ``a ^ (((a >> 7) & 7) << 4)``.
    """
    per_box = SWIZZLE_SPAN // elem_bytes
    r = np.arange(rows, dtype=np.int64)[:, None]
    c = np.arange(cols, dtype=np.int64)[None, :]
    addr = base_byte + (c // per_box) * rows * SWIZZLE_SPAN + r * SWIZZLE_SPAN + (c % per_box) * elem_bytes
    return addr ^ (((addr >> 7) & 7) << 4)


def tma_fill(smem: np.ndarray, tile: "TmaTile | SmemTile", base_byte: int, data: np.ndarray) -> None:
    """Place ``data`` (``[<= rows, <= cols]`` 16-bit patterns) into the uint8 image like a TMA load.

    Missing rows/columns (past the tensor's end) are zero-filled, as TMA's out-of-bounds fill.
    """
    if isinstance(tile, TmaTile):
        if tile.tma.box_cols * tile.tma.dtype.size != SWIZZLE_SPAN:
            raise ValueError(f"tma_fill models 128-byte-wide boxes; {tile.tile.name} has {tile.tma.box_cols}-column boxes")
        tile = tile.tile
    if smem.dtype != np.uint8 or smem.ndim != 1 or not smem.flags.c_contiguous or smem.size % 2:
        raise ValueError("smem must be a contiguous 1-D uint8 array of even length")
    if base_byte % 1024:
        raise ValueError(f"tma_fill: base {base_byte:#x} is not 1024-byte aligned (the 128B swizzle pattern)")
    data = np.asarray(data)
    if data.dtype == np.float16:
        data = data.view(np.uint16)
    if data.dtype != np.uint16 or data.ndim != 2 or data.shape[0] > tile.rows or data.shape[1] > tile.cols:
        raise ValueError(f"tma_fill: expected uint16 [<= {tile.rows}, <= {tile.cols}], got {data.dtype} {data.shape}")
    full = np.zeros((tile.rows, tile.cols), np.uint16)
    full[: data.shape[0], : data.shape[1]] = data
    addr = tma_byte_addresses(tile.rows, tile.cols, base_byte)
    if addr.max() + 2 > smem.size:
        raise ValueError(f"tma_fill: {tile.name} at {base_byte} does not fit the {smem.size}-byte image")
    smem.view("<u2")[addr // 2] = full


def _read16(smem: np.ndarray, addr: np.ndarray, dtype) -> np.ndarray:
    """float64 values of the 16-bit elements at byte addresses ``addr`` (NaN outside the image)."""
    idx = np.asarray(addr) // 2
    img = smem.view("<u2")
    inside = (idx >= 0) & (idx < img.size)
    out = hw.decode(img[np.where(inside, idx, 0)], dtype).astype(np.float64)
    return np.where(inside, out, np.nan)


# ---------------------------------------------------------------------- maps


@attrs.frozen
class _TV:
    """A TVMap evaluated: ``rows[t, v]``, ``cols[t, v]``."""

    rows: np.ndarray
    cols: np.ndarray


def _eval_tv(tv) -> _TV:
    n_t, n_v = tv.n_threads, tv.n_values
    rows = offsets(tv.row).reshape(n_v, n_t).T.copy()  # flat index = thread + n_t * value (colex)
    cols = offsets(tv.col).reshape(n_v, n_t).T.copy()
    return _TV(rows, cols)


@functools.lru_cache(maxsize=None)
def _c_map(atom: WGMMA_64xNx16) -> _TV:
    return _eval_tv(atom.c_map)


@functools.lru_cache(maxsize=None)
def _a_map(atom: WGMMA_64xNx16) -> _TV:
    return _eval_tv(atom.a_map)


def _row_slots(c: _TV) -> tuple[np.ndarray, np.ndarray]:
    """Per thread its distinct accumulator rows ``[128, 2]`` and each value's slot ``[128, n]``.

    The softmax keeps one max/sum per row a thread holds; an m64 accumulator gives each
    thread exactly two rows.
    """
    lo = c.rows.min(axis=1)
    hi = c.rows.max(axis=1)
    if not np.all((c.rows == lo[:, None]) | (c.rows == hi[:, None])) or np.any(lo == hi):
        raise ValueError("an accumulator map must give every thread exactly two rows")
    return np.stack([lo, hi], axis=1), (c.rows == hi[:, None]).astype(np.int64)


# ---------------------------------------------------------------------- report


@attrs.define
class HopperReport:
    """``hazards``: problems found (empty = clean); ``j_begin``/``j_end``: the key blocks
    visited; ``groups``: wgmma groups committed; ``pingpong``: per consumer counts of
    ``turn`` and ``pass`` issued, and ``absorbed``: the leftover pass consumer 0 takes before exit."""

    hazards: list[str]
    j_begin: int
    j_end: int
    groups: int = 0
    pingpong: dict = attrs.Factory(dict)

    @property
    def ok(self) -> bool:
        return not self.hazards


@attrs.define
class _Group:
    """One committed wgmma group: what it writes/reads and how to execute it at retirement."""

    what: str  # "S[j]" / "O[j]"
    writes: frozenset
    reads: frozenset
    smem: tuple  # (tensor, block, stage)
    run: Callable[[], None]


# ---------------------------------------------------------------------- the CTA


class _Consumer:
    """One consumer warpgroup: its flattened steps, registers and in-flight groups."""

    def __init__(self, w: int, steps: list, n_s: int, n_o: int, k_steps: int):
        self.w = w
        self.steps = steps  # [(where, Step, block)]
        self.pc = 0
        self.groups: list[_Group] = []
        self.s_acc = np.zeros((WG, n_s), np.float32)
        self.o_acc = np.zeros((WG, n_o), np.float32)
        self.p_frag = np.zeros((WG, k_steps, 4, 2), np.uint16)
        self.row_max = np.full((WG, 2), -np.inf, np.float32)
        self.row_sum = np.zeros((WG, 2), np.float32)
        self.corr = np.ones((WG, 2), np.float32)
        self.full_seen: set = set()
        self.released: set = set()
        # dataflow: S holds ("raw"|"P", block); P holds block; O scaled to a block's max
        self.s_state: tuple | None = None
        self.p_block: int | None = None
        self.o_scale: int | None = None
        self.max_block: int | None = None
        self.corr_from: int | None = None
        self.turns = self.passes = self.absorbed = 0

    @property
    def done(self) -> bool:
        return self.pc >= len(self.steps)


class _Cta:
    def __init__(self, plan: HopperPlan, q: np.ndarray, k: np.ndarray, v: np.ndarray, q_row0: int, seq_q: int,
                 seq_k: int, scale: float, mask_args: tuple[int, int, int]):
        self.plan, self.cfg = plan, plan.cfg
        cfg = plan.cfg
        self.dtype = cfg.dtype
        self.q, self.k, self.v = q, k, v
        self.q_row0, self.seq_q, self.seq_k, self.mask_args = q_row0, seq_q, seq_k, mask_args
        self.scale = np.float32(scale)
        self.scale_log2 = np.float32(self.scale * np.float32(LOG2E))
        self.jb, self.je = plan.score_mask.block_range(q_row0, seq_q, seq_k, *mask_args)
        self.hazards: list[str] = []
        self.smem = np.zeros(plan.smem_bytes, np.uint8)  # base 0 stands for the 1024-aligned dynamic base
        self.n_groups = 0
        self.counts: dict = {}  # (consumer, "S"|"softmax"|"O", block) -> times done
        # ring state
        self.stage_block = {"K": [None] * cfg.stages, "V": [None] * cfg.stages}
        self.loaded: set = set()
        self.arrivals: dict = {}
        self.prod_ops = [(t, j) for j in range(self.jb, self.je) for t in ("K", "V")]
        self.prod_pc = 0
        self.pending = [0] * cfg.consumers  # named-barrier arrivals waiting for each consumer's turn
        # maps
        self.cs, self.co = _c_map(plan.gemm_S.atom), _c_map(plan.gemm_O.atom)
        self.a = _a_map(plan.gemm_O.atom)
        self.s_rows, self.s_slot = _row_slots(self.cs)
        o_rows, _ = _row_slots(self.co)
        if not np.array_equal(o_rows, self.s_rows):
            self.hazards.append("the O accumulator rows of a thread differ from its S rows: "
                                "rescale and normalisation would use another row's max")
        self.o_slot = (self.co.rows == self.s_rows[:, 1:2]).astype(np.int64)
        cover = np.zeros((64, 16), np.int64)
        np.add.at(cover, (self.a.rows, self.a.cols), 1)
        if not np.all(cover == 1):
            self.hazards.append("the A-register map does not cover the 64x16 A tile exactly once")
        self.consumers = [self._consumer(w) for w in range(cfg.consumers)]

    # -- setup
    def _flat_steps(self) -> list:
        """(where, step, block) for prologue, body per block, epilogue; blocks resolved."""
        p = self.plan
        out = []
        if self.jb >= self.je:
            return out
        first_body = self.jb + 1 if p.prologue else self.jb
        for i, s in enumerate(p.prologue):
            if eval_guard(s.guard, self.jb, self.je, self.jb):
                out.append((f"prologue step {i} ({_text(s)}) j={self.jb}", s, self._block(s, self.jb)))
        for j in range(first_body, self.je):
            for i, s in enumerate(p.body):
                if eval_guard(s.guard, j, self.je, self.jb):
                    out.append((f"body j={j} step {i} ({_text(s)})", s, self._block(s, j)))
        for i, s in enumerate(p.epilogue):
            out.append((f"epilogue step {i} ({_text(s)})", s, self._block(s, self.je - 1)))
        return out

    def _block(self, s: Step, j: int) -> int:
        b = s.block.replace(" ", "")
        if b in ("", "j"):
            return j
        if b == "j-1":
            return j - 1
        if b == "last":
            return self.je - 1
        raise ValueError(f"step {s}: unknown block {s.block!r}")

    def _consumer(self, w: int) -> _Consumer:
        g = self.plan
        return _Consumer(w, self._flat_steps(), g.gemm_S.atom.c_regs, g.gemm_O.atom.c_regs, g.gemm_O.k_steps)

    def flag(self, where: str, msg: str) -> None:
        text = f"{where}: {msg}"
        if text not in self.hazards:
            self.hazards.append(text)

    # -- producer
    def produce(self) -> None:
        """Issue loads in program order while each one's ring stage is free."""
        cfg, plan = self.cfg, self.plan
        while self.prod_pc < len(self.prod_ops):
            t, j = self.prod_ops[self.prod_pc]
            it = j - self.jb
            st = it % cfg.stages
            if it >= cfg.stages:
                need = plan.barriers[f"{t.lower()}_empty"][0].arrive_count
                if self.arrivals.get((t, j - cfg.stages), 0) < need:
                    return
            tile = plan.loads[t]
            rows = getattr(self, t.lower())[j * cfg.B_c: (j + 1) * cfg.B_c]
            tma_fill(self.smem, tile, tile.tile.stage_offset(st), rows)
            self.stage_block[t][st] = j
            self.loaded.add((t, j))
            self.prod_pc += 1

    def _stage(self, j: int) -> int:
        return (j - self.jb) % self.cfg.stages

    # -- the walk
    def run(self) -> None:
        if self.jb < self.je:
            tma_fill(self.smem, self.plan.loads["Q"], self.plan.tiles["Q"].offset,
                     self.q[self.q_row0: min(self.q_row0 + self.cfg.B_r, self.seq_q)])
        if self.cfg.pingpong:
            if self.cfg.consumers != 2:
                self.flag("start", f"pingpong needs 2 consumer warpgroups, the plan has {self.cfg.consumers}")
            else:
                self.pending[0] += 1  # consumer 1 hands consumer 0 the first turn (before the tile loop)
        self.produce()
        while not all(c.done for c in self.consumers):
            progressed = False
            for c in self.consumers:
                if not c.done and self.step(c):
                    progressed = True
                    self.produce()
            if not progressed:
                blocked = "; ".join(f"consumer {c.w} at {c.steps[c.pc][0]}" for c in self.consumers if not c.done)
                self.flag("deadlock", f"no warpgroup can proceed ({blocked})")
                break
        for c in self.consumers:
            self.finish(c)
        self.final_checks()

    def step(self, c: _Consumer) -> bool:
        """Execute ``c``'s next step; False when it has to wait."""
        where, s, b = c.steps[c.pc]
        op = s.op
        if op == "wait_full":
            if not self.jb <= b < self.je:
                self.flag(where, f"waits for {s.arg}_{b}, outside the visited blocks [{self.jb}, {self.je})")
            elif (s.arg, b) not in self.loaded:
                return False
            c.full_seen.add((s.arg, b))
        elif op == "turn":
            if not self.cfg.pingpong:
                self.flag(where, "turn step in a plan without pingpong")
            elif self.pending[c.w] == 0:
                return False
            else:
                self.pending[c.w] -= 1
            c.turns += 1
        elif op == "pass":
            if not self.cfg.pingpong:
                self.flag(where, "pass step in a plan without pingpong")
            else:
                other = c.w ^ 1
                self.pending[other] += 1
                c.passes += 1
                if self.pending[other] > 1:
                    self.flag(where, f"consumer {c.w} arrives twice on consumer {other}'s turn barrier before it synced (over-arrival)")
        elif op == "gemm":
            self.issue(c, s.arg, b, where)
        elif op == "wgmma_wait":
            keep = int(s.arg)
            while len(c.groups) > keep:
                self.retire(c, where)
        elif op == "release":
            self.release(c, s.arg, b, where)
        elif op == "softmax":
            self.touch(c, {"S"}, {"S"}, where)
            self.softmax(c, b, s.arg == "first", where)
        elif op == "convert_P":
            self.touch(c, {"S"}, {"P"}, where)
            self.convert_p(c, where)
        elif op == "rescale_O":
            self.touch(c, {"O"}, {"O"}, where)
            self.rescale(c, where)
        else:
            self.flag(where, f"unknown consumer step {op!r}")
        c.pc += 1
        return True

    # -- hazards
    def touch(self, c: _Consumer, reads: set, writes: set, where: str) -> None:
        for g in c.groups:
            bad = ((reads | writes) & g.writes) | (writes & g.reads)
            if bad:
                self.flag(where, f"consumer {c.w} touches {'/'.join(sorted(bad))} registers while wgmma group {g.what} is in flight")

    def release(self, c: _Consumer, t: str, b: int, where: str) -> None:
        if f"{t.lower()}_empty" not in self.plan.barriers:
            self.flag(where, f"consumer {c.w} releases {t} but the plan has no {t.lower()}_empty barrier")
            return
        if t == "Q":  # Q has one slot, read by every S GEMM of the tile
            b = 0
            for g in c.groups:
                if g.what.startswith("S"):
                    self.flag(where, f"consumer {c.w} releases Q while wgmma group {g.what} still reads it")
        else:
            for g in c.groups:
                if g.smem[:2] == (t, b):
                    self.flag(where, f"consumer {c.w} releases {t}_{b} while wgmma group {g.what} still reads it")
            if (t, b) not in c.full_seen:
                self.flag(where, f"consumer {c.w} releases {t}_{b} it never waited for")
        if (t, b) in c.released:
            self.flag(where, f"consumer {c.w} releases {t}{'' if t == 'Q' else f'_{b}'} twice")
        c.released.add((t, b))
        need = self.plan.barriers[f"{t.lower()}_empty"][0].arrive_count
        n = self.arrivals.get((t, b), 0) + WARPS_PER_WG  # one arrival per warp
        if n > need:
            self.flag(where, f"{t.lower()}_empty of {t}_{b} gets {n} arrivals, more than its count {need}")
        self.arrivals[(t, b)] = n

    def _check_stage(self, c: _Consumer, t: str, b: int, where: str, when: str) -> None:
        st = self._stage(b)
        held = self.stage_block[t][st]
        if held != b:
            what = "nothing" if held is None else f"{t}_{held}"
            self.flag(where, f"consumer {c.w}: wgmma {when} stage {st} for {t}_{b} but it holds {what}")

    # -- GEMMs
    def issue(self, c: _Consumer, which: str, b: int, where: str) -> None:
        t = "K" if which == "S" else "V"
        if (t, b) not in c.full_seen:
            self.flag(where, f"consumer {c.w}: gemm {which} reads {t}_{b} without its wait_full")
        if (t, b) in c.released:
            self.flag(where, f"consumer {c.w}: gemm {which} reads {t}_{b} after releasing it")
        if which == "S" and ("Q", 0) in c.released:
            self.flag(where, f"consumer {c.w}: gemm S reads Q after releasing it (the producer may load the next tile's)")
        self._check_stage(c, t, b, where, "issued on")
        st = self._stage(b)
        if which == "S":
            g = _Group(f"S[{b}]", frozenset({"S"}), frozenset(), (t, b, st), lambda: self.exec_s(c, b, st, where))
        else:
            if c.p_block != b:
                self.flag(where, f"consumer {c.w}: gemm O of block {b} but the P registers hold block {c.p_block}")
            if c.o_scale is not None and c.o_scale != b:
                self.flag(where, f"consumer {c.w}: O (scaled to block {c.o_scale}'s max) += P_{b} (block {b}'s max): "
                                 "a rescale is missing")
            c.o_scale = b
            g = _Group(f"O[{b}]", frozenset({"O"}), frozenset({"P", "O"}), (t, b, st), lambda: self.exec_o(c, b, st, where))
        c.groups.append(g)
        self.n_groups += 1

    def retire(self, c: _Consumer, where: str) -> None:
        g = c.groups.pop(0)
        self._check_stage(c, g.smem[0], g.smem[1], f"{where} (retiring {g.what})", "executed on")
        g.run()

    def exec_s(self, c: _Consumer, b: int, st: int, where: str) -> None:
        """S = Q K_b^T: ``k_steps`` wgmma; step 0 has scale-d 0 (fresh accumulator)."""
        g, dt = self.plan.gemm_S, self.dtype
        q_base, k_base = self.plan.tiles["Q"].offset, self.plan.tiles["K"].stage_offset(st)
        acc = np.zeros(c.s_acc.shape, np.float64)
        for s in range(g.k_steps):
            a = _read16(self.smem, descriptor_addresses(g.a.descriptor(q_base, s, c.w), 64, 16, dt), dt)
            bm = _read16(self.smem, descriptor_addresses(g.b.descriptor(k_base, s), g.atom.N, 16, dt), dt)
            d = a @ bm.T
            acc = (acc + d[self.cs.rows, self.cs.cols]).astype(np.float32).astype(np.float64)
        c.s_acc = acc.astype(np.float32)
        c.s_state = ("raw", b)
        self.count(c, "S", b)

    def exec_o(self, c: _Consumer, b: int, st: int, where: str) -> None:
        """O += P V_b: A (64x16 per k16 step) from the P registers via the A map, B = V MN-major."""
        g, dt = self.plan.gemm_O, self.dtype
        v_base = self.plan.tiles["V"].stage_offset(st)
        acc = c.o_acc.astype(np.float64)
        for t in range(g.k_steps):
            a = np.zeros((64, 16))
            regs = c.p_frag[:, t]  # [thread, reg, half]
            a[self.a.rows, self.a.cols] = hw.decode(regs.reshape(WG, 8), dt)  # value v = 2*reg + half
            bm = _read16(self.smem, descriptor_addresses_mn(g.b.descriptor(v_base, t), g.atom.N, 16, dt), dt)
            d = a @ bm.T
            acc = (acc + d[self.co.rows, self.co.cols]).astype(np.float32).astype(np.float64)
        c.o_acc = acc.astype(np.float32)
        self.count(c, "O", b)

    def count(self, c: _Consumer, what: str, b: int) -> None:
        key = (c.w, what, b)
        self.counts[key] = self.counts.get(key, 0) + 1

    # -- softmax
    def _butterfly(self, x: np.ndarray, op) -> np.ndarray:
        """``x = op(x, shfl_xor(x, m))`` for the plan's lane masks (thread axis first)."""
        t = np.arange(WG)
        for m in self.plan.row_reduce_lanes:
            x = op(x, x[t ^ m]).astype(np.float32)
        return x

    def _check_rows_agree(self, x: np.ndarray, what: str, where: str) -> None:
        """After the butterfly every thread holding a row must have the same value."""
        for h in range(2):
            for r in np.unique(self.s_rows[:, h]):
                vals = x[self.s_rows == r]
                if not (np.all(vals == vals[0]) or np.all(np.isnan(vals))):
                    self.flag(where, f"row_reduce_lanes {self.plan.row_reduce_lanes} leave threads of row {r} with different {what}")
                    return

    def softmax(self, c: _Consumer, j: int, first: bool, where: str) -> None:
        f32 = np.float32
        if c.s_state != ("raw", j):
            self.flag(where, f"consumer {c.w}: softmax of block {j} but S holds {c.s_state}")
        self.count(c, "softmax", j)
        s = c.s_acc.copy()
        sm = self.plan.score_mask
        if sm.block_needs_mask(j, self.q_row0, self.seq_q, self.seq_k, *self.mask_args):
            rows = self.q_row0 + 64 * c.w + self.cs.rows
            cols = j * self.cfg.B_c + self.cs.cols
            keep = np.vectorize(lambda i, col: sm.keep(int(i), int(col), self.seq_k, *self.mask_args))(rows, cols)
            s = np.where(keep, s, f32(-np.inf)).astype(f32)
        mx = np.full((WG, 2), -np.inf, f32)
        for h in range(2):
            mx[:, h] = np.where(self.s_slot == h, s, f32(-np.inf)).max(axis=1)
        mx = self._butterfly(mx, np.maximum)
        self._check_rows_agree(mx, "row maxima", where)
        m_new = np.maximum(c.row_max, mx)
        neg_m = np.where(m_new == -np.inf, f32(0), -m_new * self.scale_log2).astype(f32)
        if first:
            c.row_sum[:] = 0
            c.corr_from = None
        else:
            with np.errstate(invalid="ignore"):
                c.corr = hw.ex2_approx_ftz(hw.fma32(c.row_max, self.scale_log2, neg_m))
            c.row_sum = (c.row_sum * c.corr).astype(f32)
            c.corr_from = c.max_block
        c.row_max = m_new.astype(f32)
        c.max_block = j
        p = hw.ex2_approx_ftz(hw.fma32(s, self.scale_log2, np.take_along_axis(neg_m, self.s_slot, axis=1)))
        for h in range(2):  # row_sum += p[i] + p[i+1] over the row's value pairs (zeros elsewhere: exact)
            vals = np.where(self.s_slot == h, p, f32(0))
            pairs = (vals[:, 0::2] + vals[:, 1::2]).astype(f32)
            acc = c.row_sum[:, h].copy()
            for k in range(pairs.shape[1]):
                acc = (acc + pairs[:, k]).astype(f32)
            c.row_sum[:, h] = acc
        c.s_acc = p.astype(f32)
        c.s_state = ("P", j)

    def convert_p(self, c: _Consumer, where: str) -> None:
        """``p_frag[t][r] = pack2(s_acc[lo], s_acc[hi])`` exactly as ``plan.p_from_s`` says."""
        if c.s_state is None or c.s_state[0] != "P":
            self.flag(where, f"consumer {c.w}: convert_P but S holds {c.s_state} (no softmax since the last S)")
        idx = np.array(self.plan.p_from_s, dtype=np.int64)  # [k_steps, 4, 2]
        c.p_frag = hw.encode(c.s_acc[:, idx], self.dtype)
        c.p_block = c.s_state[1] if c.s_state else None

    def rescale(self, c: _Consumer, where: str) -> None:
        if c.o_scale is not None and c.o_scale != c.corr_from:
            self.flag(where, f"consumer {c.w}: rescale_O applies the correction from block {c.corr_from}'s max "
                             f"to O scaled to block {c.o_scale}'s")
        c.o_acc = (c.o_acc * np.take_along_axis(c.corr, self.o_slot, axis=1)).astype(np.float32)
        c.o_scale = c.max_block

    # -- the end
    def finish(self, c: _Consumer) -> None:
        where = f"end of consumer {c.w}"
        if c.groups:
            names = ", ".join(g.what for g in c.groups)
            self.flag(where, f"{len(c.groups)} wgmma group(s) still in flight ({names}) when O is normalised")
            while c.groups:
                self.retire(c, where)
        if c.o_scale is not None and c.o_scale != c.max_block:
            self.flag(where, f"consumer {c.w}: O is scaled to block {c.o_scale}'s max, the statistics to block {c.max_block}'s")
        for j in range(self.jb, self.je):
            for what in ("S", "softmax", "O"):
                n = self.counts.get((c.w, what, j), 0)
                if n != 1:
                    name = what if what == "softmax" else f"gemm {what}"
                    self.flag(where, f"consumer {c.w}: {name} ran {n} time(s) for block {j} (expected once)")
            for t in ("K", "V"):
                if (t, j) not in c.released:
                    self.flag(where, f"consumer {c.w} never releases {t}_{j}")
        if "q_empty" in self.plan.barriers and self.je > self.jb and ("Q", 0) not in c.released:
            self.flag(where, f"consumer {c.w} never releases Q: a persistent producer waits forever for the next tile")

    def final_checks(self) -> None:
        if self.prod_pc < len(self.prod_ops):
            t, j = self.prod_ops[self.prod_pc]
            self.flag("producer", f"never issues {t}_{j}: its stage was not released by every consumer warp")
        if self.cfg.pingpong and self.cfg.consumers == 2:
            # before exit consumer 0 takes the pass consumer 1 gave last (or its initial one)
            if self.pending[0]:
                self.pending[0] -= 1
                self.consumers[0].absorbed += 1
            for w, n in enumerate(self.pending):
                if n:
                    self.flag("exit", f"consumer {w}'s turn barrier has {n} unmatched pass(es): turns and passes do not balance")

    # -- output
    def _foreign_elements(self, w: int, o_stage: np.ndarray) -> np.ndarray:
        """Mask over the image's 16-bit elements consumer ``w``'s epilogue must not write: the
        other consumers' Q rows and O staging rows, every K/V stage and the mbarriers (its own Q
        rows are free: its S GEMMs have all retired)."""
        cfg, plan = self.cfg, self.plan
        bad = np.zeros(self.smem.size // 2, bool)
        others = np.ones(cfg.B_r, bool)
        others[64 * w: 64 * (w + 1)] = False
        bad[tma_byte_addresses(cfg.B_r, cfg.d_head, plan.tiles["Q"].offset)[others] // 2] = True
        bad[o_stage[others]] = True
        for t in ("K", "V"):
            tile = plan.tiles[t]
            bad[tile.offset // 2: (tile.offset + tile.stages * tile.stage_bytes) // 2] = True
        for _, off, stages in plan.barriers.values():
            bad[off // 2: (off + 8 * stages) // 2] = True
        return bad

    def output(self) -> tuple[np.ndarray, np.ndarray]:
        """O /= l and lse per consumer, staged through ``plan.o_stage`` as the emitted epilogue does."""
        cfg, f32 = self.cfg, np.float32
        n_rows = max(0, min(cfg.B_r, self.seq_q - self.q_row0))
        o = np.zeros((n_rows, cfg.d_head), np.uint16)
        lse = np.full(n_rows, np.nan, np.float32)
        # element index of (CTA row, col) in the image; flat layout index = row + B_r * col (colex)
        o_stage = self.plan.tiles["O"].offset // 2 + offsets(self.plan.o_stage).reshape(cfg.d_head, cfg.B_r).T
        img = self.smem.view("<u2")
        lanes = np.arange(WG) % 32
        writer = (lanes & sum(self.plan.row_reduce_lanes)) == 0
        for c in self.consumers:
            where = f"epilogue of consumer {c.w}"
            l = self._butterfly(c.row_sum.copy(), np.add)
            self._check_rows_agree(l, "row sums", where)
            with np.errstate(divide="ignore"):
                inv = np.where(l > 0, f32(1) / l, f32(0)).astype(f32)
                logl = np.log(l.astype(np.float64)).astype(f32)
            val = (c.o_acc * np.take_along_axis(inv, self.o_slot, axis=1)).astype(f32)
            row_lse = np.where(l > 0, hw.fma32(c.row_max, self.scale, logl), f32(-np.inf))
            # st.shared.b32 of pack2(value i, value i+1), i even, at o_stage(c_map(thread, i))
            ev = np.arange(0, val.shape[1], 2)
            dst = o_stage[64 * c.w + self.co.rows[:, ev], self.co.cols[:, ev]]
            if dst.min() < 0 or dst.max() + 1 >= img.size:
                self.flag(where, f"consumer {c.w}: o_stage addresses fall outside the {self.smem.size}-byte shared memory")
                continue
            clash = self._foreign_elements(c.w, o_stage)[np.concatenate([dst.ravel(), dst.ravel() + 1])].sum()
            if clash:
                self.flag(where, f"consumer {c.w} stages O over {clash} element(s) another warpgroup or the "
                                 "producer may still use (other consumers' Q or O rows, the K/V ring, the mbarriers)")
            img[dst] = hw.encode(val[:, ev], self.dtype)
            img[dst + 1] = hw.encode(val[:, ev + 1], self.dtype)
            # 16-byte row reads: 8 consecutive elements from o_stage(64w + r, c) for c % 8 == 0
            r_all = np.arange(64)
            for c0 in range(0, cfg.d_head, 8):
                src = o_stage[64 * c.w + r_all, c0][:, None] + np.arange(8)
                keep = 64 * c.w + r_all < n_rows
                o[(64 * c.w + r_all)[keep], c0: c0 + 8] = img[src[keep]]
            for h in range(2):
                rr = 64 * c.w + self.s_rows[writer, h]
                ok = rr < n_rows
                lse[rr[ok]] = row_lse[writer, h][ok]
        return o, lse


def _text(s: Step) -> str:
    return s.op + (f" {s.arg}" if s.arg else "") + (f" {s.block}" if s.block else "")


# ---------------------------------------------------------------------- entry points


def simulate_cta(plan: "HopperPlan", q: np.ndarray, k: np.ndarray, v: np.ndarray, q_block: int = 0,
                 seq_q: int | None = None, seq_k: int | None = None, scale: float | None = None, *,
                 mask_offset: int = 0, window_left: int = -1, window_right: int = -1
                 ) -> tuple[np.ndarray, np.ndarray, HopperReport]:
    """One CTA (query rows ``q_block * B_r ...``) of the Hopper plan: ``(o, lse, report)``.

    ``q``: ``[seq_q, d]``, ``k``/``v``: ``[seq_k, d]``, 16-bit patterns (uint16) or floats
    (rounded to the dtype). ``o``: ``[rows, d]`` uint16 patterns of the CTA's rows below
    ``seq_q``; ``lse``: natural-log log-sum-exp (``-inf`` for a row with no kept score).
    ``scale`` defaults to ``1/sqrt(d)``.
    """
    if not isinstance(plan, HopperPlan):
        plan = make_hopper_plan(plan)
    cfg = plan.cfg
    arrs = []
    for name, x in (("q", q), ("k", k), ("v", v)):
        x = np.asarray(x)
        if x.dtype != np.uint16:
            x = hw.encode(x, cfg.dtype)
        if x.ndim != 2 or x.shape[1] != cfg.d_head:
            raise ValueError(f"{name}: expected [rows, {cfg.d_head}], got {x.shape}")
        arrs.append(x)
    q, k, v = arrs
    seq_q = q.shape[0] if seq_q is None else seq_q
    seq_k = k.shape[0] if seq_k is None else seq_k
    if q.shape[0] < seq_q or k.shape[0] < seq_k or v.shape != k.shape:
        raise ValueError(f"q/k/v shapes {q.shape}, {k.shape}, {v.shape} do not cover seq_q={seq_q}, seq_k={seq_k}")
    q_row0 = q_block * cfg.B_r
    if not 0 <= q_row0 < seq_q:
        raise ValueError(f"q_block {q_block} starts at row {q_row0}, outside seq_q={seq_q}")
    scale = 1.0 / np.sqrt(cfg.d_head) if scale is None else scale
    cta = _Cta(plan, q[:seq_q], k[:seq_k], v[:seq_k], q_row0, seq_q, seq_k, scale, (mask_offset, window_left, window_right))
    cta.run()
    o, lse = cta.output()
    pp = {c.w: {"turn": c.turns, "pass": c.passes, "absorbed": c.absorbed} for c in cta.consumers}
    return o, lse, HopperReport(cta.hazards, cta.jb, cta.je, cta.n_groups, pp)


def check_schedule(plan: "HopperPlan", n_blocks: int = 3, seed: int = 0) -> list[str]:
    """Hazards of one CTA walking ``n_blocks`` key blocks (random data, no mask)."""
    if not isinstance(plan, HopperPlan):
        plan = make_hopper_plan(plan)
    cfg = plan.cfg
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((cfg.B_r, cfg.d_head))
    kv = rng.standard_normal((n_blocks * cfg.B_c, cfg.d_head))
    return simulate_cta(plan, q, kv, kv)[2].hazards
