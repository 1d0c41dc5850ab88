"""One CTA of the wgmma backward plan (:mod:`flashgen.dsl.hopper_backward_plan`) on the CPU.

Driven only by the plan's objects: tile offsets, stages and layouts, the TMA loads, the ring and its
barrier counts, each GEMM's descriptors (read back through the ISA address models
``descriptor_addresses`` / ``descriptor_addresses_mn``; consumer ``w`` adds ``row_block_offset * w``),
``a_from_acc``, ``dq_stage`` (where each consumer's dQ lies), the score mask and the rule objects, and the
consumers' ``schedule``.

What is modelled
----------------
* **Producer**: a sequential program (K and V once on ``kv_full``; then per work item Q with its
  lse and dO with its D into the ring's stage of that use), each fill waiting for the stage's empty
  barrier (the plan's arrive counts) and completing a phase of its full barrier. Tiles go through
  :func:`~flashgen.sim.hopper.tma_fill` (the 128B-swizzle byte rule), the statistics as fp32 bytes.
  It runs as far ahead as the ring allows after every consumer step. Where the plan has it add dQ
  (``DqStage.by_producer``) its program also holds each item's bulk reductions of the consumers' regions, once
  the item's stages came back, and they free the regions (``dq_empty``) for the consumers' next stores.
* **Consumers**: each walks ``schedule`` once per work item (query head x query block), after the
  wait for K and V that precedes the loop. They run one at a time as far as each can (a step that
  must wait blocks it), so one may run a whole block ahead of another.
* **wgmma groups**: each ``gemm`` step is one committed group; ``wgmma_wait N`` retires all but the
  ``N`` newest, and a group *executes when it retires* (the latest moment the hardware may read its
  operands), so a missing wait or an early release gives wrong numbers, not only a hazard line.
  A k16 step is ``fp32(C + A B^T)`` with float64 products (:func:`~flashgen.sim.hopper.wgmma_k16`).
* **dS^T**: ``store_rf dS`` writes buffer ``item % buffers`` as the plan's ``ds_store`` says
  (:func:`~flashgen.sim.hopper_backward_smem.ds_store_targets`): pairs of adjacent accumulator values as one 32-bit store at
  ``layout(64 w + row, col)`` (the second half at the next element, as ``st.shared.b32`` does), or, for a
  [query][key] tile, ``stmatrix.x4.trans`` (:func:`~flashgen.sim.hardware.stmatrix_offsets`); the
  ``handoff`` is a named barrier over the consumers.
* **Epilogue**: once every consumer's walk ended (the barrier over the consumers: their dQ GEMMs read all of
  sK), each stages dK times the scale and dV over its own rows of sK and sV in the tiles' layouts (value pairs
  as ``st.shared.b32``), which the TMA stores of its boxes (``plan.stores``) read back into the outputs.
* **Happens-before**: vector clocks over the consumers and the producer, joined at the mbarriers
  (release -> fill -> wait) and the handoff barrier, decide whether one consumer's access is ordered
  after another's, whatever order this run happened to take.

Hazards (strings; empty = clean)
--------------------------------
* a step touching accumulator or fragment registers that an in-flight wgmma group writes (or
  writing registers it reads); groups in flight at exit;
* a GEMM reading a ring stage without its ``wait_full`` or after its ``release``, or executing on
  a stage that holds another item; a release while a group still reads the stage; a double release;
* a dQ GEMM reading a consumer's dS^T rows not yet stored or not ordered after the store (the
  handoff); a ``store_rf dS`` overwriting rows of a buffer that some consumer's dQ GEMM has not read,
  or read without that read being ordered before the store; stores outside the dS buffer;
* the producer's dQ reductions reading a region that holds another item's dQ, or not ordered after the store;
  an item whose dQ it never reduced;
* dataflow: P, dS, their fragments, dV, dK, dQ computed from another item's values; each GEMM
  not exactly once per item; a deadlock (a wait that never passes); dK or dV staged in a layout whose adjacent
  columns are not adjacent elements (what a 32-bit store of a value pair needs).
"""
from __future__ import annotations

import functools
from typing import Callable

import attrs
import numpy as np

from flashgen.dsl.atoms.hopper import SmemDescriptor, descriptor_addresses, descriptor_addresses_mn
from flashgen.dsl.config import WARPGROUP as WG
from flashgen.dsl.hopper_backward_plan import HopperBackwardPlan
from flashgen.dsl.steps import (ConvertP, Gemm, GradScores, Handoff, RecomputeP, ReduceGM, Release, SignalOrder, StoreRF, WaitFull,
                                WaitOrder, WgmmaWait, runs)
from flashgen.sim import hardware as hw
from flashgen.sim.backward_cta import BwdHeadData, BwdProblem, backward_dscores, backward_scores, scale_log2
from flashgen.sim.block_mask import BackwardView
from flashgen.sim.hopper import a_table, c_table, phase_passed, read16, tma_fill, tma_read, walk_consumers, wgmma_k16
from flashgen.sim.layout_eval import tile_table
from flashgen.sim.hopper_backward_smem import ds_store_targets

_F32 = np.float32
#: registers a GEMM's group reads and writes (accumulators S, dP, dV, dK, dQ; A fragments P, dS)
_GEMM_REGS = {"S": ((), ("S",)), "dP": ((), ("dP",)), "dV": (("P",), ("dV",)), "dK": (("dS",), ("dK",)), "dQ": ((), ("dQ",))}
#: the ring tensors a GEMM reads (dQ reads K and the dS^T buffer, checked apart)
_GEMM_RING = {"S": ("Q",), "dP": ("dO",), "dV": ("dO",), "dK": ("Q",), "dQ": ()}
#: accumulator -> the fragments ``convert_P`` makes of it (``arg`` P: S^T's, dS: dP^T's)
_FRAG_OF = {"P": "S", "dS": "dP"}


def _producer_ops(items: int, stages: int, reduces_dq: bool) -> list:
    """The producer's program: K and V, then Q (+ lse) and dO (+ D) of each item; where it adds dQ (``reduces_dq``),
    after item ``j``'s fills the reductions of item ``j - stages`` (whose stages those fills waited for), and the last
    items' after the loop."""
    ops = [("KV", None)]
    for j in range(items):
        ops += [("Q", j), ("dO", j)] + ([("dQ", j - stages)] if reduces_dq and j >= stages else [])
    return ops + ([("dQ", j) for j in range(max(0, items - stages), items)] if reduces_dq else [])


@functools.lru_cache(maxsize=None)
def _addresses(desc: SmemDescriptor, n: int, mn: bool, dtype) -> np.ndarray:
    """Byte addresses ``[n, 16]`` of one k16 slice of a descriptor (MN- or K-major)."""
    return (descriptor_addresses_mn if mn else descriptor_addresses)(desc, n, 16, dtype)


@attrs.define
class _Group:
    """One committed wgmma group: the registers it reads and writes, the ring items it reads, and how to
    execute it at retirement."""

    what: str
    gemm: str
    item: int
    reads: frozenset
    writes: frozenset
    run: Callable[[str], None]  # executes it (the argument: where, for messages)


class _Consumer:
    """One consumer warpgroup: its flattened steps, registers, in-flight groups and vector clock."""

    def __init__(self, w: int, steps: list, plan: HopperBackwardPlan, clocks: int):
        g = plan.gemms
        self.w, self.steps, self.pc = w, steps, 0
        self.groups: list[_Group] = []
        self.acc = {n: np.zeros((WG, g[n].atom.c_regs), _F32) for n in ("S", "dP", "dV", "dK", "dQ")}
        self.frag = {n: np.zeros((WG, len(plan.a_from_acc), 4, 2), np.uint16) for n in ("P", "dS")}
        #: register -> (what it holds, item): the dataflow checks
        self.holds: dict = {}
        self.full_seen: set = set()
        self.released: set = set()
        self.vc = np.zeros(clocks, np.int64)
        self.handoff_gen: int | None = None  # the handoff generation it arrived in, until it passes

    @property
    def done(self) -> bool:
        return self.pc >= len(self.steps)

    def tick(self) -> int:
        self.vc[self.w] += 1
        return int(self.vc[self.w])


class HopperBwdCta:
    """One CTA: key block ``prob.kb`` of one kv head; ``heads``: the group's query heads (16-bit q, do);
    ``stats``: per head the preprocess's padded ``(lse * log2e, D)``; ``dq_accum``: per head the fp32
    ``[seq_q, d]`` buffer the consumers add into."""

    def __init__(self, plan: HopperBackwardPlan, prob: BwdProblem, k: np.ndarray, v: np.ndarray, heads: list[BwdHeadData],
                 stats: list[tuple[np.ndarray, np.ndarray]], dq_accum: list[np.ndarray], scale: float,
                 block_mask: "BackwardView | None" = None):
        cfg = self.cfg = plan.cfg
        self.plan, self.prob, self.heads, self.stats, self.dq_accum = plan, prob, heads, stats, dq_accum
        self.block_mask = block_mask  # the mask_mod's (flashgen.sim.block_mask.BackwardView), or None
        self.kv = {"K": k[prob.kb * cfg.B_c:(prob.kb + 1) * cfg.B_c], "V": v[prob.kb * cfg.B_c:(prob.kb + 1) * cfg.B_c]}
        qb = plan.query_blocks.block_range(prob.kb, prob.seq_q, prob.seq_k, *prob.mask_args)
        if block_mask is not None:
            qb = block_mask.clip(prob.kb, *qb, cfg.deterministic)
        self.work = [(h, qb[0] + q) for h, q in plan.items.order(max(0, qb[1] - qb[0]), len(heads), prob.kb)]
        self.scale = _F32(scale)
        self.scale_log2 = scale_log2(plan, scale)
        self.smem = np.zeros(plan.smem_bytes, np.uint8)
        self.hazards: list[str] = []
        n = cfg.consumers
        self.maps = {name: c_table(g.atom) for name, g in plan.gemms.items()}
        self.a_map = a_table(plan.gemms["dV"].atom)
        self.ds_targets = [ds_store_targets(plan, w) for w in range(cfg.consumers)]
        self.buffers = plan.tiles["dS"].stages
        # the producer: K and V, then Q (+ lse) and dO (+ D) of each item; ring state per (tensor, stage)
        self.prod_ops = _producer_ops(len(self.work), plan.ring.stages, plan.dq_stage.by_producer)
        self.prod_pc, self.prod_vc = 0, np.zeros(n + 1, np.int64)
        self.full_phases: dict = {}
        self.empty_phases: dict = {}
        self.empty_arrivals: dict = {}
        # vector clocks: of each stage's last fill, of its last completed empty phase, joined over the releases so far
        self.fill_vc: dict = {}
        self.empty_vc: dict = {}
        self.empty_joined: dict = {}
        self.stage_item: dict = {"Q": [None] * plan.ring.stages, "dO": [None] * plan.ring.stages}
        # dS^T buffers: the item whose rows each consumer last stored there, the stores' and dQ reads' clocks
        self.ds_owner = [[None] * n for _ in range(self.buffers)]
        self.ds_stored: dict = {}  # (consumer, item) -> its clock at the store
        self.ds_read: dict = {}  # (consumer, item) -> its clock when its dQ GEMM retired
        self.handoff = {"gen": 0, "arrived": 0, "vc": np.zeros(n + 1, np.int64), "released": []}
        # the producer's dQ adds (DqStage.by_producer): the item each consumer's region holds, the stores' clocks,
        # the producer's clock after each item's reductions (the dq_empty barrier's phases)
        self.dq_region: list = [None] * n
        self.dq_stored: dict = {}  # (consumer, item) -> its clock at the store
        self.dq_freed: list = []
        self.dq_slots = plan.dq_stage.slot(*np.indices(self.maps["dQ"].rows.shape))  # each dQ value's slot of a region
        self.counts: dict = {}
        rows = max(0, min(cfg.B_c, prob.seq_k - prob.kb * cfg.B_c))
        self.dk = np.zeros((rows, cfg.d_head), np.uint16)
        self.dv = np.zeros((rows, cfg.d_head), np.uint16)
        steps = [("start", WaitFull("KV", why="K and V landed (before the loop)"), None)]
        for j in range(len(self.work)):
            steps += [(f"item {self.work[j]} step {i} ({s})", s, j) for i, s in enumerate(plan.schedule)
                      if runs(s.guard, j, 0, len(self.work))]
        self.consumers = [_Consumer(w, list(steps), plan, n + 1) for w in range(n)]

    def flag(self, where: str, msg: str) -> None:
        text = f"{where}: {msg}"
        if text not in self.hazards:
            self.hazards.append(text)

    # -- the walk
    def run(self) -> tuple[np.ndarray, np.ndarray]:
        """Every consumer to the end (each as far as it can before the next goes); dK and dV of the block."""
        walk_consumers(self.consumers, self.step, self.produce, self.flag, greedy=True)
        for c in self.consumers:
            self.finish(c)
        if self.plan.dq_stage.by_producer and len(self.dq_freed) != len(self.work):
            self.flag("end of producer", f"the dQ of {len(self.dq_freed)} of {len(self.work)} item(s) reduced")
        for c in self.consumers:  # after every consumer's walk: the epilogue's barrier over the consumers
            self.store_grads(c)
        return self.dk, self.dv

    def step(self, c: _Consumer) -> bool:
        """Execute ``c``'s next step; False when it has to wait."""
        where, s, j = c.steps[c.pc]
        run = _STEPS.get(type(s))
        if run is None:
            self.flag(where, f"no simulation of consumer step {type(s).__name__}")
        elif run(self, c, s, j, where) is False:
            return False
        c.tick()
        c.pc += 1
        return True

    # -- the producer
    def produce(self) -> None:
        """Issue fills in program order while each one's stage is free (the empty barrier's phase passed)."""
        plan, cfg, ring = self.plan, self.cfg, self.plan.ring
        while self.prod_pc < len(self.prod_ops):
            t, j = self.prod_ops[self.prod_pc]
            if t == "dQ":
                key = ("Q", ring.stage(j))  # item j's stages came back (the use j + STAGES's empty phase)
                if not phase_passed(self.empty_phases, key, ring.empty_phase(j + ring.stages)):
                    return
                self.prod_vc = np.maximum(self.prod_vc, self.empty_vc.get(key, 0))
                self.reduce_regions(j)
                self.prod_vc[-1] += 1
                self.dq_freed.append(self.prod_vc.copy())
                self.prod_pc += 1
                continue
            if t == "KV":
                for name in ("K", "V"):
                    tma_fill(self.smem, plan.loads[name], plan.tiles[name].offset, self.kv[name])
                key = ("KV", 0)
            else:
                st = ring.stage(j)
                key = (t, st)
                if not phase_passed(self.empty_phases, key, ring.empty_phase(j)):
                    return
                self.prod_vc = np.maximum(self.prod_vc, self.empty_vc.get(key, 0))
                h, qb = self.work[j]
                rows = getattr(self.heads[h], t.lower())[qb * cfg.B_r:(qb + 1) * cfg.B_r]
                tma_fill(self.smem, plan.loads[t], plan.tiles[t].stage_offset(st), rows)
                stat, values = ("LSE", self.stats[h][0]) if t == "Q" else ("D", self.stats[h][1])
                off, _, size = plan.stats[stat]
                self.smem[off + st * size:off + (st + 1) * size] = values[qb * cfg.B_r:(qb + 1) * cfg.B_r].astype("<f4").view(np.uint8)
                self.stage_item[t][st] = j
            self.prod_vc[-1] += 1
            self.fill_vc[key] = self.prod_vc.copy()
            self.full_phases[key] = self.full_phases.get(key, 0) + 1
            self.prod_pc += 1

    # -- barriers
    def wait_full(self, c: _Consumer, s: WaitFull, j: "int | None", where: str) -> bool:
        """False while the full barrier's phase of this use has not completed; a wait passing on a stage
        that holds another item is a hazard."""
        ring = self.plan.ring
        key, parity = (("KV", 0), 0) if s.arg == "KV" else ((s.arg, ring.stage(j)), ring.phase(j))
        if not phase_passed(self.full_phases, key, parity):
            return False
        if s.arg != "KV" and self.stage_item[s.arg][key[1]] != j:
            self.flag(where, f"consumer {c.w}: the wait for {s.arg} of item {j} on stage {key[1]}, parity {parity}, passes "
                             f"while the stage holds item {self.stage_item[s.arg][key[1]]}")
        c.vc = np.maximum(c.vc, self.fill_vc[key])
        c.full_seen.add((s.arg, j if s.arg != "KV" else None))
        return True

    def release(self, c: _Consumer, s: Release, j: int, where: str) -> None:
        """The plan's arrivals per release on the stage's empty barrier; its count's last arrival completes the phase."""
        t, st = s.arg, self.plan.ring.stage(j)
        for g in c.groups:
            if t in _GEMM_RING[g.gemm] and g.item == j:
                self.flag(where, f"consumer {c.w} releases {t} of item {j} while wgmma group {g.what} still reads it")
        if (t, j) not in c.full_seen:
            self.flag(where, f"consumer {c.w} releases {t} of item {j} it never waited for")
        if (t, j) in c.released:
            self.flag(where, f"consumer {c.w} releases {t} of item {j} twice")
        c.released.add((t, j))
        need = self.plan.barriers[f"{t.lower()}_empty"][0].arrive_count
        key = (t, st)
        self.empty_arrivals[key] = self.empty_arrivals.get(key, 0) + self.plan.release_arrivals
        self.empty_joined[key] = np.maximum(self.empty_joined.get(key, 0), c.vc)
        if self.empty_arrivals[key] >= need:
            self.empty_arrivals[key] = 0
            self.empty_phases[key] = self.empty_phases.get(key, 0) + 1
            self.empty_vc[key] = self.empty_joined.pop(key)

    def handoff_step(self, c: _Consumer, s: Handoff, j: int, where: str) -> bool:
        """The named barrier over the consumers: arrive once, pass when every consumer arrived."""
        bar = self.handoff
        if c.handoff_gen is None:
            c.handoff_gen = bar["gen"]
            bar["vc"] = np.maximum(bar["vc"], c.vc)
            bar["arrived"] += 1
            if bar["arrived"] == self.cfg.consumers:
                bar["released"].append(bar["vc"])
                bar["gen"] += 1
                bar["arrived"], bar["vc"] = 0, np.zeros_like(c.vc)
        if bar["gen"] <= c.handoff_gen:
            return False
        c.vc = np.maximum(c.vc, bar["released"][c.handoff_gen])
        c.handoff_gen = None
        return True

    # -- registers
    def touch(self, c: _Consumer, reads: tuple, writes: tuple, where: str) -> None:
        """A step reading ``reads`` and writing ``writes`` (register names) against the groups in flight."""
        for g in c.groups:
            hit = g.writes & set(reads + writes)
            if hit:
                self.flag(where, f"consumer {c.w} touches {', '.join(sorted(hit))} while wgmma group {g.what} writing it is in flight")
            hit = g.reads & set(writes)
            if hit:
                self.flag(where, f"consumer {c.w} overwrites {', '.join(sorted(hit))} while wgmma group {g.what} reading it is in flight")

    def expect(self, c: _Consumer, reg: str, what: str, j: int, where: str) -> None:
        """Dataflow: register ``reg`` must hold ``what`` of item ``j``."""
        if c.holds.get(reg) != (what, j):
            self.flag(where, f"consumer {c.w}: {reg} holds {c.holds.get(reg)}, expected {what} of item {j}")

    def count(self, c: _Consumer, what: str, j: int) -> None:
        self.counts[(c.w, what, j)] = self.counts.get((c.w, what, j), 0) + 1

    # -- GEMMs
    def issue(self, c: _Consumer, name: str, j: int, where: str) -> None:
        """Commit a wgmma group of GEMM ``name`` for item ``j``: its operands' barriers checked now, its
        math at retirement."""
        reads, writes = _GEMM_REGS[name]
        self.touch(c, reads, (), where)
        for t in _GEMM_RING[name]:
            if (t, j) not in c.full_seen:
                self.flag(where, f"consumer {c.w}: gemm {name} reads {t} of item {j} without its wait_full")
            if (t, j) in c.released:
                self.flag(where, f"consumer {c.w}: gemm {name} reads {t} of item {j} after releasing it")
        if name in ("S", "dP", "dQ") and ("KV", None) not in c.full_seen:
            self.flag(where, f"consumer {c.w}: gemm {name} reads K/V without waiting for kv_full")
        if name == "dQ":
            self.check_ds_ready(c, j, where)
        c.groups.append(_Group(f"{name}[item {j}]", name, j, frozenset(reads), frozenset(writes),
                               functools.partial(self.exec_gemm, c, name, j)))

    def wgmma_wait(self, c: _Consumer, keep: int, where: str) -> None:
        while len(c.groups) > keep:
            self.retire(c, where)

    def retire(self, c: _Consumer, where: str) -> None:
        g = c.groups.pop(0)
        g.run(f"{where} (retiring {g.what})")
        if g.gemm == "dQ":
            self.ds_read[(c.w, g.item)] = int(c.vc[c.w])

    def check_ds_ready(self, c: _Consumer, j: int, where: str) -> None:
        """Every consumer's dS^T rows of item ``j`` stored, and each store ordered before this read."""
        for o in range(self.cfg.consumers):
            at = self.ds_stored.get((o, j))
            if at is None:
                self.flag(where, f"consumer {c.w}: gemm dQ of item {j} reads consumer {o}'s dS^T rows before they are stored")
            elif o != c.w and c.vc[o] < at:
                self.flag(where, f"consumer {c.w}: gemm dQ of item {j} reads consumer {o}'s dS^T rows with no barrier "
                                 f"ordering it after their store")

    def read_operand(self, desc, base: int, step: int, w: int, n: int, mn: bool) -> np.ndarray:
        """float64 ``[n, 16]`` of one k16 slice of a shared-memory operand (consumer ``w``'s part)."""
        return read16(self.smem, _addresses(desc.descriptor(base, step, w), n, mn, self.cfg.dtype), self.cfg.dtype)

    def a_from_fragments(self, frag: np.ndarray, step: int) -> np.ndarray:
        """The 64x16 A tile of k16 step ``step`` from 16-bit fragments ``[thread, step, reg, half]`` (the A map)."""
        a = np.zeros((64, 16))
        a[self.a_map.rows, self.a_map.cols] = hw.decode(frag[:, step].reshape(WG, 8), self.cfg.dtype)
        return a

    def exec_gemm(self, c: _Consumer, name: str, j: int, where: str) -> None:
        """GEMM ``name`` of item ``j`` as it reads shared memory and the registers now."""
        plan, g, ring = self.plan, self.plan.gemms[name], self.plan.ring
        st = ring.stage(j)
        for t in _GEMM_RING[name]:
            if self.stage_item[t][st] != j:
                self.flag(where, f"consumer {c.w}: gemm {name} of item {j} executes on stage {st} of {t}, "
                                 f"which holds item {self.stage_item[t][st]}")
        tiles = plan.tiles
        ds, k = tiles["dS"].stage_offset(j % self.buffers), tiles["K"].offset
        a_base = {"S": tiles["K"].offset, "dP": tiles["V"].offset, "dQ": k if plan.dq_stage.transposed else ds}.get(name)
        b_base = {"S": tiles["Q"].stage_offset(st), "dP": tiles["dO"].stage_offset(st), "dV": tiles["dO"].stage_offset(st),
                  "dK": tiles["Q"].stage_offset(st), "dQ": ds if plan.dq_stage.transposed else k}[name]
        if name == "dQ":
            self.check_ds_owners(c, j, where)
        fresh = name in ("S", "dP", "dQ")
        acc = np.zeros(c.acc[name].shape) if fresh else c.acc[name].astype(np.float64)
        frag = {"dV": "P", "dK": "dS"}.get(name)
        if frag is not None:
            self.expect(c, frag, frag, j, where)
        for s in range(g.k_steps):
            a = (self.a_from_fragments(c.frag[frag], s) if frag is not None
                 else self.read_operand(g.a, a_base, s, c.w, 64, g.trans_a))
            b = self.read_operand(g.b, b_base, s, c.w, g.atom.N, g.trans_b)
            acc = wgmma_k16(acc, a, b, self.maps[name])
        c.acc[name] = acc.astype(_F32)
        c.holds[name] = (name, j)
        self.count(c, name, j)

    def check_ds_owners(self, c: _Consumer, j: int, where: str) -> None:
        """At the dQ GEMM's execution: every consumer's rows of the buffer hold item ``j``."""
        b = j % self.buffers
        for o, held in enumerate(self.ds_owner[b]):
            if held != j:
                self.flag(where, f"consumer {c.w}: gemm dQ of item {j} executes on dS^T buffer {b} whose consumer {o} "
                                 f"rows hold item {held}")

    # -- the rules on the accumulators
    def column_stat(self, c: _Consumer, stat: str, j: int, where: str) -> np.ndarray:
        """``stat`` (LSE: lse * log2e; D) of each S^T accumulator value's column (query row), from its ring stage."""
        t = "Q" if stat == "LSE" else "dO"
        off, _, size = self.plan.stats[stat]
        st = self.plan.ring.stage(j)
        if (t, j) not in c.full_seen or (t, j) in c.released:
            self.flag(where, f"consumer {c.w} reads {stat} of item {j} outside its {t} stage's wait_full .. release")
        elif self.stage_item[t][st] != j:
            self.flag(where, f"consumer {c.w} reads {stat} of item {j} from stage {st}, which holds item {self.stage_item[t][st]}")
        values = self.smem[off + st * size:off + (st + 1) * size].view("<f4")
        return values[self.maps["S"].cols].astype(_F32)

    def indices(self, c: _Consumer, j: int) -> tuple[np.ndarray, np.ndarray]:
        """Global query row and key of each of ``c``'s S^T accumulator values ``[thread, reg]``."""
        cs, qb = self.maps["S"], self.work[j][1]
        return qb * self.cfg.B_r + cs.cols, self.prob.kb * self.cfg.B_c + 64 * c.w + cs.rows

    def recompute_p(self, c: _Consumer, j: int, where: str) -> None:
        """P^T from S^T through the plan's score rule (the score mask where the block needs it), then the
        Recompute rule; where the plan makes dS^T in the same pass (its ``fused`` score order), dS^T too (dP^T must be ready)."""
        prob, plan = self.prob, self.plan
        fused = plan.grad_with_p
        self.touch(c, ("S", "dP") if fused else ("S",), ("S", "dP") if fused else ("S",), where)
        self.expect(c, "S", "S", j, where)
        h, qb = self.work[j]
        raw, (queries, keys) = c.acc["S"], self.indices(c, j)
        needs = plan.query_blocks.block_needs_mask(qb, prob.kb, prob.seq_q, prob.seq_k, *prob.mask_args)
        masked = self.block_mask.masked(h, prob.kb, qb, needs) if self.block_mask is not None else plan.score_mask.backward_masked(needs)
        s = backward_scores(plan, prob, raw, queries, keys, prob.h0 + h, masked, self.scale)
        c.acc["S"] = plan.recompute.evaluate(s, self.scale_log2, self.column_stat(c, "LSE", j, where))
        c.holds["S"] = ("P", j)
        if fused:
            self.make_ds(c, j, raw, where)

    def make_ds(self, c: _Consumer, j: int, raw: "np.ndarray | None", where: str) -> None:
        """dS^T = P^T (dP^T - D) (times the score_mod's derivative) in dP^T's registers."""
        self.expect(c, "dP", "dP", j, where)
        queries, keys = self.indices(c, j)
        c.acc["dP"] = backward_dscores(self.plan, self.prob, c.acc["S"], c.acc["dP"], self.column_stat(c, "D", j, where), raw,
                                       queries, keys, self.prob.h0 + self.work[j][0], self.scale)
        c.holds["dP"] = ("dS", j)

    def grad_scores(self, c: _Consumer, j: int, where: str) -> None:
        """dS^T, unless the RecomputeP step made it (the ``fused`` order)."""
        if self.plan.grad_with_p:
            self.expect(c, "dP", "dS", j, where)
            return
        self.touch(c, ("S", "dP"), ("dP",), where)
        self.expect(c, "S", "P", j, where)
        self.make_ds(c, j, None, where)

    def convert(self, c: _Consumer, frag: str, j: int, where: str) -> None:
        """A fragments of dV (``P``) or dK (``dS``): register ``r`` of step ``t`` packs the accumulator values
        ``a_from_acc[t][r]``."""
        src = _FRAG_OF[frag]
        self.touch(c, (src,), (frag,), where)
        self.expect(c, src, frag, j, where)
        c.frag[frag] = hw.encode(c.acc[src][:, np.array(self.plan.a_from_acc, dtype=np.int64)], self.cfg.dtype)
        c.holds[frag] = (frag, j)

    def store_ds(self, c: _Consumer, j: int, where: str) -> None:
        """dS^T -> buffer ``j % buffers``: value pairs ``(i, i + 1)``, ``i`` even, as one 32-bit store at
        ``layout(64 w + row(i), col(i))``."""
        self.touch(c, ("dP",), (), where)
        self.expect(c, "dP", "dS", j, where)
        b, tile = j % self.buffers, self.plan.tiles["dS"]
        self.check_ds_overwrite(c, b, j, where)
        acc = c.acc["dP"]
        dst = tile.stage_offset(b) // 2 + self.ds_targets[c.w]
        lo, hi = tile.stage_offset(b) // 2, tile.stage_offset(b + 1) // 2
        if dst.min() < lo or dst.max() >= hi:
            self.flag(where, f"consumer {c.w}: dS^T stores fall outside buffer {b} (elements {lo}..{hi - 1})")
            dst = np.clip(dst, lo, hi - 1)
        self.smem.view("<u2")[dst] = hw.encode(acc, self.cfg.dtype)
        self.ds_owner[b][c.w] = j
        self.ds_stored[(c.w, j)] = int(c.vc[c.w])

    def check_ds_overwrite(self, c: _Consumer, b: int, j: int, where: str) -> None:
        """The rows ``c`` overwrites in buffer ``b`` were read by every consumer's dQ GEMM, each read ordered
        before this store."""
        prev = self.ds_owner[b][c.w]
        if prev is None:
            return
        for o in range(self.cfg.consumers):
            at = self.ds_read.get((o, prev))
            if at is None:
                self.flag(where, f"consumer {c.w} overwrites its dS^T rows of item {prev} in buffer {b} (item {j}) "
                                 f"before consumer {o}'s gemm dQ read them")
            elif c.vc[o] < at:
                self.flag(where, f"consumer {c.w} overwrites its dS^T rows of item {prev} in buffer {b} (item {j}) "
                                 f"while consumer {o}'s gemm dQ may still read them (no barrier orders the read first)")

    def reduce_dq(self, c: _Consumer, j: int, where: str) -> "bool | None":
        """Consumer ``w``'s dQ (rows from ``row0(w)``, columns from ``col0(w)`` of the query block: the plan's
        DqStage) added into the fp32 buffer (rows below seq_q); where the plan stages it (ordered adds), through the
        consumer's region of shared memory (value ``v`` of thread ``t`` at its DqStage slot), read back by the bulk
        reduction in the chunk's fragment order. Where the producer adds it (``by_producer``) the consumer only stores
        its region, once ``dq_empty`` says the producer's reductions of the last item read it (False until then)."""
        st = self.plan.dq_stage
        if st.by_producer and j > 0 and len(self.dq_freed) < j:
            return False
        self.touch(c, ("dQ",), (), where)
        self.expect(c, "dQ", "dQ", j, where)
        self.count(c, "reduce", j)
        values = c.acc["dQ"]
        if st.in_smem:
            self.region(c.w)[self.dq_slots] = values
        if st.by_producer:
            if j > 0:
                c.vc = np.maximum(c.vc, self.dq_freed[j - 1])
            self.dq_region[c.w] = j
            self.dq_stored[(c.w, j)] = c.vc.copy()
            return None
        if st.in_smem:
            values = self.region(c.w)[self.dq_slots]
        self.add_dq(c.w, j, values)
        return None

    def region(self, w: int) -> np.ndarray:
        """Consumer ``w``'s dQ region of shared memory, as fp32."""
        st = self.plan.dq_stage
        start = st.offset + w * st.region_bytes
        return self.smem[start:start + st.region_bytes].view("<f4")

    def add_dq(self, w: int, j: int, values: np.ndarray) -> None:
        """Consumer ``w``'s dQ tile of item ``j`` (values in accumulator order) into the fp32 buffer, rows below seq_q."""
        h, qb = self.work[j]
        cq = self.maps["dQ"]
        q, cols = self.plan.dq_stage.element(w, cq.rows, cq.cols)
        rows = qb * self.cfg.B_r + q
        ok = rows < self.prob.seq_q
        np.add.at(self.dq_accum[h], (rows[ok], cols[ok]), values[ok])

    def reduce_regions(self, j: int) -> None:
        """The producer's bulk reductions of item ``j``: every consumer's region, which must hold that item's dQ
        stored before the release the producer waited for."""
        where = f"producer, dQ of item {j}"
        for w in range(self.cfg.consumers):
            if self.dq_region[w] != j:
                self.flag(where, f"consumer {w}'s region holds item {self.dq_region[w]}'s dQ, not item {j}'s")
            elif self.dq_stored[(w, j)][w] > self.prod_vc[w]:
                self.flag(where, f"the reduction is not ordered after consumer {w}'s store of the region")
            self.add_dq(w, j, self.region(w)[self.dq_slots])

    # -- the end
    def finish(self, c: _Consumer) -> None:
        """Groups left in flight; each GEMM once per item; every item's dQ reduced where the producer adds it."""
        where = f"end of consumer {c.w}"
        if c.groups:
            self.flag(where, f"{len(c.groups)} wgmma group(s) still in flight ({', '.join(g.what for g in c.groups)}) at exit")
            while c.groups:
                self.retire(c, where)
        for j in range(len(self.work)):
            for what in ("S", "dP", "dV", "dK", "dQ", "reduce"):
                n = self.counts.get((c.w, what, j), 0)
                if n != 1:
                    self.flag(where, f"consumer {c.w}: {what} ran {n} time(s) for item {j} (expected once)")

    def store_grads(self, c: _Consumer) -> None:
        """dK (times the scale) and dV staged over consumer ``c``'s rows of sK and sV in the tiles' layouts
        (``st.shared.b32`` of value pairs ``i, i + 1``), then read back by the TMA stores of its boxes
        (``plan.stores``); rows past seq_k are not written."""
        where, kr, img = f"epilogue of consumer {c.w}", 64 * c.w, self.smem.view("<u2")
        for name, out, acc in (("dK", self.dk, self.plan.score_grad.scaled(c.acc["dK"], self.scale)), ("dV", self.dv, c.acc["dV"])):
            store, m = self.plan.stores[name], self.maps[name]
            tile = store.tile
            stage = tile.offset // 2 + tile_table(tile)  # [row, col] -> 16-bit element of the image
            ev = np.arange(0, m.rows.shape[1], 2)
            dst = stage[kr + m.rows[:, ev], m.cols[:, ev]]
            if not np.array_equal(stage[kr + m.rows[:, ev], m.cols[:, ev] + 1], dst + 1):
                self.flag(where, f"{name}: a 32-bit store of columns (c, c + 1) does not write them side by side in {tile.name}'s layout")
                continue
            vals = hw.encode(acc, self.cfg.dtype)
            img[dst], img[dst + 1] = vals[:, ev], vals[:, ev + 1]
            staged = tma_read(self.smem, store, tile.offset, (kr, kr + 64))
            rows = np.arange(kr, min(kr + 64, out.shape[0]))
            out[rows] = staged[rows]


#: consumer step class -> how a consumer executes it (False: it has to wait)
_STEPS = {
    WaitFull: HopperBwdCta.wait_full,
    Release: HopperBwdCta.release,
    Handoff: HopperBwdCta.handoff_step,
    Gemm: lambda cta, c, s, j, where: cta.issue(c, s.arg, j, where),
    WgmmaWait: lambda cta, c, s, j, where: cta.wgmma_wait(c, int(s.arg), where),
    RecomputeP: lambda cta, c, s, j, where: cta.recompute_p(c, j, where),
    GradScores: lambda cta, c, s, j, where: cta.grad_scores(c, j, where),
    ConvertP: lambda cta, c, s, j, where: cta.convert(c, s.arg, j, where),
    StoreRF: lambda cta, c, s, j, where: cta.store_ds(c, j, where),
    ReduceGM: lambda cta, c, s, j, where: cta.reduce_dq(c, j, where),
    # the ordered adds' turns order the fp32 sums across CTAs; one CTA's values do not depend on them
    WaitOrder: lambda cta, c, s, j, where: None,
    SignalOrder: lambda cta, c, s, j, where: None,
}
