"""How producers and consumers share staged buffers: the pipeline's stages, barriers and phases.

Two forms, one per way the hardware orders asynchronous copies:

* :class:`MbarrierRing` (wgmma engine): ``stages`` slots that a producer fills (TMA) and consumers
  drain in order, each slot with a "full" mbarrier (its fill's transaction bytes landed) and an
  "empty" one (every consumer warp released it). Uses are counted across the CTA's tiles: use
  ``it`` sits in slot ``it % stages`` and is that slot's ``it / stages``-th use, so it completes
  that phase of the slot's barriers. An mbarrier wait names a phase by its parity: a consumer waits
  on "full" for parity ``(it / stages) & 1``, the producer on "empty" for the other parity (the
  previous use's release; a fresh barrier counts the phase before its first as complete, so the
  first round of fills passes at once). The K/V ring advances by a tile's key blocks, Q's
  one-slot ring by one per tile with key blocks.
* :class:`CpAsyncGroups` (mma_sync engine): ``cp.async`` copies join the open group,
  ``commit_group`` closes it, groups complete in commit order, so ``wait_group N`` completes all
  but the ``N`` newest. The count a use must wait with is the number of groups committed after
  the one holding its data (:meth:`CpAsyncGroups.wait_count`); :meth:`CpAsyncGroups.resolve`
  gives each wait of a schedule, which names the copies it needs, its count.

The ring renders its rule as C++ expressions (``*_cpp``) for the emitted producer and consumers and
evaluates it in Python (the same names without ``_cpp``) for the wgmma simulator; :class:`GroupQueue`
evaluates the group rule for the CTA simulator. Tests compile the expressions for the host and
compare them with the methods (tests/attention/test_pipeline.py).
"""
from __future__ import annotations

from typing import Hashable, Iterable

import attrs

from ..dsl.steps import Commit, Copy, Step, Wait


@attrs.frozen
class MbarrierRing:
    """A ring of ``stages`` slots (``name`` for messages); ``per_tile``: one use per tile (Q's slot), else one
    per key block of a tile (the K/V ring)."""

    name: str
    stages: int
    per_tile: bool = False
    #: the kernel's C++ constant equal to ``stages`` ("": the number itself)
    stages_name: str = ""

    def __attrs_post_init__(self) -> None:
        if self.stages < 1:
            raise ValueError(f"ring {self.name}: stages must be at least 1, got {self.stages}")

    # ---- the rule in Python (the simulator's and the tests') ----------------------------------

    def stage(self, it: int) -> int:
        """The slot of use ``it``."""
        return it % self.stages

    def phase(self, it: int) -> int:
        """The parity a consumer waits for on the "full" barrier of use ``it``'s slot."""
        return (it // self.stages) & 1

    def empty_phase(self, it: int) -> int:
        """The parity the producer waits for on the "empty" barrier before fill ``it``: the release of
        the slot's previous use (parity 1 passes on a fresh barrier: the first ``stages`` fills)."""
        return self.phase(it) ^ 1

    def prev_stage(self, it: int) -> int:
        """The slot of use ``it - 1`` (``it`` >= 1), without going below zero in unsigned arithmetic."""
        return (it + self.stages - 1) % self.stages

    def prev_phase(self, it: int) -> int:
        """The full barrier's parity of use ``it - 1`` (``it`` >= 1), as :meth:`prev_stage`."""
        return ((it + self.stages - 1) // self.stages - 1) & 1

    def use(self, used: int, j: int, j_begin: int) -> int:
        """The use of key block ``j`` of a tile whose blocks start at ``j_begin``, ``used`` uses before it."""
        return used if self.per_tile else used + j - j_begin

    def after_tile(self, used: int, j_begin: int, j_end: int) -> int:
        """The uses counted once a tile with key blocks ``[j_begin, j_end)`` (not empty) is done."""
        return used + (1 if self.per_tile else j_end - j_begin)

    def walk(self, tiles: Iterable[tuple[int, int]]) -> list[tuple[int, int, int]]:
        """(use, stage, phase) of every use of a CTA walking ``tiles`` (key-block ranges) in order; tiles
        without key blocks use nothing (the emitted producer and consumers skip them)."""
        out, used = [], 0
        for jb, je in tiles:
            if jb >= je:
                continue
            for j in ([jb] if self.per_tile else range(jb, je)):
                it = self.use(used, j, jb)
                out.append((it, self.stage(it), self.phase(it)))
            used = self.after_tile(used, jb, je)
        return out

    # ---- the rule in C++ ----------------------------------------------------------------------
    # Expressions, not functions: the kernels inline them where they are used. (Helper functions give
    # the same values, but nvcc's front end then orders the PTX differently and ptxas allocates the
    # wgmma consumers' registers differently: spills in kernels that have none.)

    @property
    def _n(self) -> str:
        return self.stages_name or f"{self.stages}u"

    def stage_cpp(self, it: str) -> str:
        """:meth:`stage` of the C++ use ``it``."""
        return f"{it} % {self._n}"

    def phase_cpp(self, it: str) -> str:
        """:meth:`phase` of the C++ use ``it``."""
        return f"{it} & 1u" if self.stages == 1 else f"({it} / {self._n}) & 1u"

    def empty_phase_cpp(self, phase: str) -> str:
        """:meth:`empty_phase` from the C++ ``phase`` of the same use (a variable or :meth:`phase_cpp`)."""
        return f"{phase} ^ 1u" if phase.isidentifier() else f"({phase}) ^ 1u"

    def prev_stage_cpp(self, it: str) -> str:
        """:meth:`prev_stage` of the C++ use ``it``."""
        return f"({it} + {self._n} - 1) % {self._n}"

    def prev_phase_cpp(self, it: str) -> str:
        """:meth:`prev_phase` of the C++ use ``it``."""
        return f"(({it} + {self._n} - 1) / {self._n} - 1) & 1u"

    def use_cpp(self, used: str, j: str = "j", j_begin: str = "j_begin") -> str:
        """:meth:`use` of C++ ``used`` (a ``uint32_t``), key block ``j`` and the tile's ``j_begin``; ``j_begin``
        "": ``j`` is the block's position in the tile's walk (a walk that skips blocks counts them)."""
        if self.per_tile:
            return used
        return f"{used} + uint32_t({j} - {j_begin})" if j_begin else f"{used} + uint32_t({j})"

    def after_tile_cpp(self, used: str, j_begin: str = "j_begin", j_end: str = "j_end") -> str:
        """The statement advancing the C++ counter ``used`` past a tile (:meth:`after_tile`); ``j_begin`` "":
        ``j_end`` is the count of the tile's blocks walked."""
        if self.per_tile:
            return f"++{used};"
        return f"{used} += uint32_t({j_end} - {j_begin});" if j_begin else f"{used} += uint32_t({j_end});"


@attrs.frozen
class CpAsyncGroups:
    """The cp.async group rule: groups complete in commit order; ``wait_group N`` completes all committed
    groups but the ``N`` newest."""

    def wait_count(self, committed_since: int) -> int:
        """``N`` of the wait before a use whose data's group has ``committed_since`` groups committed after
        it (in the block where the wait runs): the largest count that still completes the data."""
        if committed_since < 0:
            raise ValueError(f"a use's group cannot have {committed_since} groups after it")
        return committed_since

    def resolve(self, prologue: tuple[Step, ...], body: tuple[Step, ...], max_blocks: int = 4) -> tuple[tuple, tuple]:
        """The schedule with each ``Wait`` that names what it ``needs`` given its count: walked over loops
        of 1 to ``max_blocks`` key blocks, :meth:`wait_count` of the newest needed copy still in flight
        (0 when all landed). A wait whose count would differ between the blocks it runs in is an error:
        the schedule must split it by guards."""
        counts: dict[tuple[str, int], int] = {}
        for n in range(1, max_blocks + 1):
            queue = GroupQueue()
            for j, part, steps in [(0, "prologue", prologue)] + [(j, "body", body) for j in range(n)]:
                for i, step in enumerate(steps):
                    if step.guard is None or step.guard.holds(j, 0, n):
                        self._walk_step(queue, step, (part, i), j, n, counts)
        return tuple(self._with_count(s, ("prologue", i), counts) for i, s in enumerate(prologue)), \
            tuple(self._with_count(s, ("body", i), counts) for i, s in enumerate(body))

    def _walk_step(self, queue: "GroupQueue", step: Step, at: tuple[str, int], j: int, n: int, counts: dict) -> None:
        """One step of :meth:`resolve`'s walk (block ``j`` of ``[0, n)``), recording a wait's count at ``at``."""
        if isinstance(step, Copy):
            queue.add((step.arg, None if step.block is None else step.block.index(j, 0, n)))
        elif isinstance(step, Commit):
            queue.commit()
        elif isinstance(step, Wait):
            if step.needs:
                needed = [(t, None if b is None else b.index(j, 0, n)) for t, b in step.needs]
                count = self.wait_count(min((queue.newer_than(c) for c in needed if queue.pending(c)), default=0))
                if counts.setdefault(at, count) != count:
                    raise ValueError(f"{at[0]} step {at[1]} ({step}): wait_group {counts[at]} in one block, {count} in "
                                     f"another (block {j} of {n}); split it by guards")
            else:
                count = int(step.arg)
            queue.wait(count)

    @staticmethod
    def _with_count(step: Step, at: tuple[str, int], counts: dict) -> Step:
        if not isinstance(step, Wait) or not step.needs:
            return step
        if at not in counts:
            raise ValueError(f"{at[0]} step {at[1]} ({step}) never runs: no count for it")
        return attrs.evolve(step, arg=str(counts[at]))

    def queue(self) -> "GroupQueue":
        """An empty queue of groups, evaluating the rule (the simulator's)."""
        return GroupQueue()


@attrs.define
class GroupQueue:
    """Copies in flight under :class:`CpAsyncGroups`: the open group and the committed ones, oldest first."""

    open: list = attrs.field(factory=list)
    committed: list = attrs.field(factory=list)

    def add(self, copy: Hashable) -> None:
        """A copy joins the open group."""
        self.open.append(copy)

    def commit(self) -> None:
        """``commit_group``: the open group is closed (an empty group is a group too)."""
        self.committed.append(self.open)
        self.open = []

    def wait(self, n: int) -> list:
        """``wait_group n``: the copies completed now (every committed group but the ``n`` newest)."""
        done = self.committed[: max(0, len(self.committed) - n)]
        self.committed = self.committed[len(done):]
        return [c for group in done for c in group]

    def pending(self, copy: Hashable) -> bool:
        """Whether ``copy`` is in flight (in the open group or a committed one)."""
        return copy in self.open or any(copy in group for group in self.committed)

    def newer_than(self, copy: Hashable) -> int:
        """Groups committed after the one holding ``copy`` (``wait_group`` of that many completes it)."""
        for i, group in enumerate(self.committed):
            if copy in group:
                return len(self.committed) - 1 - i
        raise KeyError(f"{copy!r} is in no committed group")
