"""The pipeline rule (flashgen.attention.pipeline): the K/V ring's and Q slot's stages, phases and running
counts agree between the C++ the kernels inline and the Python the simulator runs, they keep the
mbarrier protocol, and the simulators catch a wrong rule."""
from __future__ import annotations

import shutil
import subprocess

import attrs
import numpy as np
import pytest

from flashgen.attention.pipeline import CpAsyncGroups, GroupQueue, MbarrierRing
from flashgen.dsl.config import KernelConfig, default_configs, kernel_progression
from flashgen.dsl.hopper_plan import make_hopper_plan
from flashgen.dsl.plan import make_plan, make_schedule
from flashgen.dsl.steps import BEGIN, HAS_NEXT, J, NEXT, Commit, Copy, Wait
from flashgen.sim import cta, hopper

W = KernelConfig.wgmma

#: the plans' rings for every stage count the config takes, and Q's slot
RINGS = {f"kv{st}": make_hopper_plan(W("fp16", d_head=64, B_c=64, stages=st)).kv_ring for st in range(1, 5)}
RINGS["q"] = make_hopper_plan(W("fp16", d_head=64, B_c=64, persistent=True)).q_ring

#: CTA walks: each a list of tiles' key-block ranges (empty tiles and unequal tiles included)
WALKS = [[(0, 1)], [(0, 7)], [(2, 5), (0, 3)], [(0, 4)] * 5, [(3, 3), (0, 2), (1, 1), (0, 9)], [(0, 1)] * 11,
         [(0, 3), (0, 5), (2, 4), (0, 1), (0, 6), (1, 8)]]


def _python_walk(ring: MbarrierRing, tiles) -> list[list[int]]:
    """Per use, as the emitted loops visit them: use, stage, phase, the producer's empty parity and (use
    >= 1) the previous use's stage and phase computed from this one; the count after each tile."""
    out, used = [], 0
    for jb, je in tiles:
        if jb >= je:
            continue
        for j in [jb] if ring.per_tile else range(jb, je):
            it = ring.use(used, j, jb)
            row = [it, ring.stage(it), ring.phase(it), ring.empty_phase(it)]
            out.append(row + ([ring.prev_stage(it), ring.prev_phase(it)] if it >= 1 else []))
        used = ring.after_tile(used, jb, je)
        out.append([used])
    return out


def _cpp_walk(ring: MbarrierRing, tiles) -> str:
    """The same walk in C++ built from the ring's expressions, the counters as the emitted kernel keeps them."""
    body = ["    uint32_t used = 0;"]
    for jb, je in tiles:
        body += [f"    {{ const int j_begin = {jb}, j_end = {je};",
                 "      if (j_begin < j_end) {",
                 f"        for (int j = j_begin; j < {'j_begin + 1' if ring.per_tile else 'j_end'}; ++j) {{",
                 f"          const uint32_t it = {ring.use_cpp('used')}, st = {ring.stage_cpp('it')}, ph = {ring.phase_cpp('it')};",
                 f"          printf(\"%u %u %u %u\", it, st, ph, {ring.empty_phase_cpp('ph')});",
                 f"          if (it >= 1) printf(\" %u %u\", {ring.prev_stage_cpp('it')}, {ring.prev_phase_cpp('it')});",
                 "          printf(\"\\n\");",
                 "        }",
                 f"        {ring.after_tile_cpp('used')}",
                 "        printf(\"%u\\n\", used);",
                 "      } }"]
    return "\n".join(body)


needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to run the rendered C++ rule")


@needs_gxx
@pytest.mark.parametrize("name", sorted(RINGS))
def test_rendered_rule_agrees_with_python(tmp_path, name):
    """For every walk (tiles per CTA, key blocks per tile, empty tiles): the C++ expressions give the same
    uses, stages, phases, empty parities, previous stages and phases and running counts as the methods."""
    ring = RINGS[name]
    stages = f"constexpr uint32_t {ring.stages_name} = {ring.stages};\n" if ring.stages_name else ""
    mains = "\n".join(f"static void walk{i}() {{\n{_cpp_walk(ring, w)}\n}}" for i, w in enumerate(WALKS))
    calls = "".join(f"    walk{i}(); printf(\"--\\n\");\n" for i in range(len(WALKS)))
    src = tmp_path / "ring.cpp"
    src.write_text(f"#include <stdint.h>\n#include <stdio.h>\n{stages}{mains}\nint main() {{\n{calls}}}\n")
    exe = tmp_path / "ring"
    subprocess.run(["g++", "-std=c++17", "-Wall", "-Werror", "-o", str(exe), str(src)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    got = [[[int(x) for x in line.split()] for line in part.strip().splitlines()] for part in out.split("--\n")[:-1]]
    assert got == [_python_walk(ring, w) for w in WALKS]


@pytest.mark.parametrize("name", sorted(RINGS))
def test_the_rule_keeps_the_mbarrier_protocol(name):
    """Walking uses in order against a model of the barriers (a parity wait passes once that phase
    completed; a fresh barrier counts the phase before its first as complete): the producer's wait
    before fill ``it`` passes exactly when the slot's previous use was released, the consumer's wait
    for use ``it`` exactly when fill ``it`` landed; previous-use rules equal the rule one use back."""
    ring = RINGS[name]
    full, empty = np.zeros(ring.stages, int), np.zeros(ring.stages, int)
    passes = lambda phases, st, parity: (phases[st] & 1) != parity  # noqa: E731
    for it in range(6 * ring.stages + 3):
        st = ring.stage(it)
        if it >= ring.stages:  # the previous use of this slot not yet released: the producer must wait
            assert not passes(empty, st, ring.empty_phase(it))
            empty[st] += 1  # ... its release
        assert passes(empty, st, ring.empty_phase(it))
        assert not passes(full, st, ring.phase(it))  # not landed yet: the consumer must wait
        full[st] += 1
        assert passes(full, st, ring.phase(it))
        if it >= 1:
            assert (ring.prev_stage(it), ring.prev_phase(it)) == (ring.stage(it - 1), ring.phase(it - 1))
    assert [u for u, _, _ in ring.walk([(0, 3), (1, 1), (2, 4)])] == list(range(2 if ring.per_tile else 5))


class _PhaseOff(MbarrierRing):
    def phase(self, it):
        return super().phase(it) ^ 1


class _EmptyPhaseOff(MbarrierRing):
    def empty_phase(self, it):
        return super().phase(it)


class _StageOff(MbarrierRing):
    def stage(self, it):
        return (it + 1) % self.stages if it >= self.stages else super().stage(it)


class _PrevPhaseOff(MbarrierRing):
    def prev_phase(self, it):
        return super().prev_phase(it) ^ 1


class _PrevStageOff(MbarrierRing):
    def prev_stage(self, it):
        return it % self.stages


def _wrong(ring: MbarrierRing, cls) -> MbarrierRing:
    return cls(**attrs.asdict(ring))


PP_INTRA = W("fp16", d_head=64, B_c=64, stages=2)  # pingpong + intra overlap: V waited for as block j - 1
PERSISTENT = PP_INTRA.replace(persistent=True)


@pytest.mark.parametrize("field, cls, cfg", [
    ("kv_ring", _PhaseOff, PP_INTRA), ("kv_ring", _PhaseOff, W("bf16", d_head=64, B_c=64, stages=3, intra_overlap=False)),
    ("kv_ring", _EmptyPhaseOff, PP_INTRA), ("kv_ring", _StageOff, PP_INTRA), ("kv_ring", _StageOff, W("fp16", d_head=64, B_c=64, stages=3)),
    ("kv_ring", _PrevPhaseOff, PP_INTRA), ("kv_ring", _PrevStageOff, PP_INTRA),
    ("q_ring", _PhaseOff, PERSISTENT), ("q_ring", _EmptyPhaseOff, PERSISTENT),
], ids=lambda x: x.__name__ if isinstance(x, type) else str(x))
def test_the_wgmma_simulator_catches_a_wrong_ring(field, cls, cfg):
    """A plan whose ring rule is off (a phase, the producer's empty parity, a stage, the previous block's
    stage or phase) deadlocks or reads a slot holding other data: the simulator reports it; the right rule
    is clean on the same walk."""
    plan = make_hopper_plan(cfg)
    tiles = 3 if cfg.persistent else 1
    assert hopper.check_schedule(plan, n_blocks=7, tiles=tiles) == []
    bad = attrs.evolve(plan, **{field: _wrong(getattr(plan, field), cls)})
    hazards = hopper.check_schedule(bad, n_blocks=7, tiles=tiles)
    assert any("deadlock" in h or "holds" in h for h in hazards), hazards[:3]


def test_group_queue_completes_groups_in_commit_order():
    """``wait_group N`` completes every committed group but the N newest; ``newer_than`` is the largest N
    that completes a copy (the count CpAsyncGroups.wait_count gives a use)."""
    q = GroupQueue()
    for group in (["Q", "K0"], [], ["V0"], ["K1"]):
        for copy in group:
            q.add(copy)
        q.commit()
    q.add("V1")  # open: no wait completes it
    assert [q.newer_than(c) for c in ("K0", "V0", "K1")] == [3, 1, 0]
    assert q.wait(CpAsyncGroups().wait_count(q.newer_than("V0"))) == ["Q", "K0", "V0"]
    assert q.wait(0) == ["K1"] and q.open == ["V1"]
    with pytest.raises(KeyError):
        q.newer_than("V1")


# ---- cp.async groups (mma_sync) ------------------------------------------------------------------

ASYNC_CFGS = [c for c in dict.fromkeys(default_configs() + kernel_progression()) if c.async_copy]


def _needed_land(cfg, groups: CpAsyncGroups, n: int) -> list[str]:
    """Walk the schedule ``groups`` derives over ``n`` blocks with a GroupQueue: at each wait, whether the
    copies it needs land with its count, and whether a count one less would already leave one in flight."""
    sched = make_schedule(cfg, groups)
    queue, problems = GroupQueue(), []
    for j, steps in [(0, sched.prologue)] + [(j, sched.body) for j in range(n)]:
        for s in steps:
            if s.guard is not None and not s.guard.holds(j, 0, n):
                continue
            if isinstance(s, Copy):
                queue.add((s.arg, None if s.block is None else s.block.index(j, 0, n)))
            elif isinstance(s, Commit):
                queue.commit()
            elif isinstance(s, Wait):
                needed = [(t, None if b is None else b.index(j, 0, n)) for t, b in s.needs]
                if int(s.arg) > 0 and not any(queue.pending(c) and queue.newer_than(c) == int(s.arg) for c in needed):
                    problems.append(f"block {j}: {s} waits for more groups than it needs")
                queue.wait(int(s.arg))
                problems += [f"block {j}: {c} in flight after {s}" for c in needed if queue.pending(c)]
    return problems


@pytest.mark.parametrize("cfg", ASYNC_CFGS, ids=str)
def test_derived_waits_land_what_each_use_reads_and_no_more(cfg):
    """The wait counts of the mma_sync schedules, derived from the commits: after each wait the copies it
    names have landed, and one group fewer in flight would not have been needed."""
    for n in range(1, 6):
        assert _needed_land(cfg, CpAsyncGroups(), n) == []


class _WaitsTooFew(CpAsyncGroups):
    def wait_count(self, committed_since):
        return super().wait_count(committed_since) + 1


@pytest.mark.parametrize("cfg", [next(c for c in ASYNC_CFGS if c.eager_load_blocks == eager) for eager in (True, False)], ids=str)
def test_the_cta_simulator_catches_a_wrong_group_rule(cfg):
    """A group rule that leaves one group too many in flight: the CTA simulator sees a read of data in
    flight (the right rule walks clean)."""
    plan = make_plan(cfg)
    assert cta.check_schedule(plan, 3) == []
    bad = attrs.evolve(plan, schedule=make_schedule(cfg, _WaitsTooFew()))
    assert any("in flight" in h for h in cta.check_schedule(bad, 3))


def test_a_wait_whose_count_depends_on_the_block_is_refused():
    """One unguarded wait for V_j where the next K block's commit follows it in all but the last block."""
    body = (Copy("V", J), Commit(), Copy("K", NEXT, guard=HAS_NEXT), Commit(guard=HAS_NEXT), Wait(needs=(("V", J),)))
    with pytest.raises(ValueError, match="split it by guards"):
        CpAsyncGroups().resolve((Copy("K", BEGIN), Commit()), body)
