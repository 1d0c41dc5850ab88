"""Pipeline steps and their guards: what a plan's schedule is made of (both engines).

A schedule is a tuple of step objects, one class per operation. The emitters render a step with
the function their table keeps for its class, the simulators execute it with the method theirs
keeps, so an operation the other side does not know is a ``KeyError`` naming the class, not a
silently skipped string.

Fields of every step: ``arg`` (a tensor, GEMM name, wait count or variant), ``block`` (a
:class:`Block`: which key block it acts on, or None: the loop's ``j``), ``guard`` (a :class:`Guard`,
or None: every block) and ``why`` (a comment carried into the source). Blocks and guards evaluate in
Python (the simulators) and render their C++ (the emitters).
"""
from __future__ import annotations

import operator
from typing import ClassVar

import attrs

_CMP = {"==": operator.eq, "<": operator.lt, ">=": operator.ge}


@attrs.frozen
class Guard:
    """A condition on the key-block loop index ``j``: ``j + offset <cmp> bound``, ``bound`` the
    loop's first block (``"begin"``) or its end (``"end"``, one past the last block)."""

    offset: int
    cmp: str
    bound: str

    def __attrs_post_init__(self) -> None:
        if self.cmp not in _CMP or self.bound not in ("begin", "end"):
            raise ValueError(f"guard j + {self.offset} {self.cmp} {self.bound}: cmp one of {', '.join(_CMP)}, bound begin or end")

    def holds(self, j: int, j_begin: int, j_end: int) -> bool:
        return _CMP[self.cmp](j + self.offset, j_begin if self.bound == "begin" else j_end)

    def to_cpp(self, begin: str = "j_begin", end: str = "j_end", j: str = "j", next: str = "") -> str:
        """The condition in C++ with the loop bounds named ``begin`` and ``end`` (and the block ``j``:
        ``j_begin`` before the loop); ``next``: the block the loop walks after ``j`` where that is not
        ``j + 1`` (a walk that skips blocks: ``j + 1`` reads as the walk's next block)."""
        lhs = f"{j} + {self.offset}" if self.offset else j
        if next and self.offset:
            lhs = _walk_step(self.offset, next, f"guard j + {self.offset} {self.cmp} {self.bound}")
        return f"{lhs} {self.cmp} {begin if self.bound == 'begin' else end}"



#: the first block of the loop; a next block exists; the last block
FIRST_BLOCK = Guard(0, "==", "begin")
HAS_NEXT = Guard(1, "<", "end")
LAST_BLOCK = Guard(1, ">=", "end")


@attrs.frozen
class Block:
    """A key block relative to the loop ``[j_begin, j_end)``: ``base`` ``"j"`` (the loop's block),
    ``"begin"`` or ``"end"``, plus ``offset`` (``end - 1``: the last block)."""

    base: str
    offset: int = 0

    def __attrs_post_init__(self) -> None:
        if self.base not in ("j", "begin", "end"):
            raise ValueError(f"block {self.base} + {self.offset}: base j, begin or end")

    def index(self, j: int, j_begin: int, j_end: int) -> int:
        return {"j": j, "begin": j_begin, "end": j_end}[self.base] + self.offset

    def to_cpp(self, j: str = "j", begin: str = "j_begin", end: str = "j_end", next: str = "") -> str:
        """The block in C++; ``next`` as :meth:`Guard.to_cpp`'s (only block ``j + 1`` reads it)."""
        name = {"j": j, "begin": begin, "end": end}[self.base]
        if next and self.base == "j" and self.offset:
            return _walk_step(self.offset, next, f"block {self}")
        return f"({name} {'+' if self.offset > 0 else '-'} {abs(self.offset)})" if self.offset else name

    def __str__(self) -> str:  # the listing's short names: j, j+1, j-1, j_begin, last
        if (self.base, self.offset) == ("end", -1):
            return "last"
        name = "j_begin" if self.base == "begin" else "j" if self.base == "j" else "j_end"
        return name + (f"{self.offset:+d}" if self.offset else "")


def _walk_step(offset: int, next: str, what: str) -> str:
    """``next`` for a step of +1 along a walk that skips blocks; no other step can be named there."""
    if offset != 1:
        raise ValueError(f"{what}: a walk that skips blocks names only its next block (j + 1), not j {offset:+d}")
    return next


#: the loop's block, the next and the previous one, the first and the last block of the loop
J, NEXT, PREV, BEGIN, LAST = Block("j"), Block("j", 1), Block("j", -1), Block("begin"), Block("end", -1)


def runs(guard: "Guard | None", j: int, j_begin: int, j_end: int) -> bool:
    """Whether a step with ``guard`` runs in block ``j`` of the loop ``[j_begin, j_end)``."""
    return guard is None or guard.holds(j, j_begin, j_end)


@attrs.frozen
class Step:
    """The fields every step has; subclasses name the operation (``op``, for listings)."""

    op: ClassVar[str] = ""
    arg: str = ""
    block: "Block | None" = None
    guard: "Guard | None" = None
    why: str = ""

    def __str__(self) -> str:
        return self.op + (f" {self.arg}" if self.arg else "") + (f" {self.block}" if self.block else "")


# ---- mma.sync: cp.async groups and CTA barriers around warp-level MMAs ------------------------


class Copy(Step):
    """Global -> shared copy of tensor ``arg``'s block ``block`` (cp.async or synchronous 16 B)."""

    op = "copy"


class Commit(Step):
    """``cp.async.commit_group``: the copies issued since the last commit form one group."""

    op = "commit"


@attrs.frozen
class Wait(Step):
    """``cp.async.wait_group arg``: all but the ``arg`` newest groups have landed. ``needs``: the copies
    (tensor, :class:`Block` or None for Q) the steps after it read, from which the plan derives ``arg``
    (:meth:`flashgen.attention.pipeline.CpAsyncGroups.resolve`)."""

    op = "wait"
    needs: tuple = ()


class Barrier(Step):
    """``__syncthreads()``."""

    op = "barrier"


class LoadRF(Step):
    """Tensor ``arg`` shared -> registers, kept resident (Q fragments for the whole CTA)."""

    op = "load_rf"


# ---- both engines ------------------------------------------------------------------------------


class Gemm(Step):
    """GEMM ``arg`` (``S`` = Q K^T or ``O`` += P V) on block ``block``."""

    op = "gemm"


class Softmax(Step):
    """Online softmax of S (wgmma: ``arg`` ``first`` for the first block, ``stats`` for the others)."""

    op = "softmax"


# ---- the backward (flashgen.attention.backward's rules on the accumulators) ---------------------


class RecomputeP(Step):
    """P^T from the S^T accumulator and the query block's lse (the score mask where the block needs it)."""

    op = "recompute_P"


class GradScores(Step):
    """dS^T = P^T * (dP^T - D) in the dP^T accumulator."""

    op = "grad_scores"


class StoreRF(Step):
    """Accumulator ``arg`` -> shared memory, 16 bit (dS^T for the dQ GEMM's other warps; with the backward's
    ``split_scores`` also P^T, each warp's query columns, for the dV and dK GEMMs of the group)."""

    op = "store_rf"


class Handoff(Step):
    """Accumulator ``arg`` stored to shared memory by every consumer warpgroup: an async-proxy fence and a
    named barrier over the consumers before any of them reads it with wgmma (the backward's dS^T)."""

    op = "handoff"


class ReduceGM(Step):
    """Accumulator ``arg`` added into its fp32 global buffer (``red.global.add.f32``; dQ)."""

    op = "reduce_gm"


class WaitOrder(Step):
    """Ordered (deterministic) reduction of ``arg``: wait until the CTAs before this one in the fixed
    order of the block's contributors have made their adds, then a CTA barrier."""

    op = "wait_order"


class SignalOrder(Step):
    """Ordered reduction of ``arg``: after a barrier behind the CTA's adds, pass the turn to the next
    contributor (a release, so that it sees those adds)."""

    op = "signal_order"


# ---- wgmma: mbarrier ring, async wgmma groups, pingpong turns ----------------------------------


class WaitFull(Step):
    """Wait for tensor ``arg``'s ``full`` mbarrier: its TMA load of block ``block`` landed."""

    op = "wait_full"


class Release(Step):
    """Arrive on tensor ``arg``'s ``empty`` mbarrier (one arrival per warp): its stage is free."""

    op = "release"


class WgmmaWait(Step):
    """``wgmma.wait_group arg``: all but the ``arg`` newest wgmma groups retired."""

    op = "wgmma_wait"


class RescaleO(Step):
    """O *= exp2(old max - new max)."""

    op = "rescale_O"


class ConvertP(Step):
    """P (S after the softmax) -> 16-bit A fragments of P V."""

    op = "convert_P"


class Turn(Step):
    """Pingpong: wait for this consumer's turn to issue GEMMs."""

    op = "turn"


class Pass(Step):
    """Pingpong: hand the tensor cores to the next consumer."""

    op = "pass"


class FinishRows(Step):
    """A tile's row sums reduced, 1/l and the LSE written; the statistics start over."""

    op = "finish_rows"


class StoreO(Step):
    """A tile's O / l staged in shared memory and stored."""

    op = "store_O"
