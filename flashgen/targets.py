"""The GPU targets flashgen compiles for, and their facts, in one table.

A :class:`Target` is what the rest of the code asks instead of comparing compute capabilities:
its nvcc ``-gencode`` flag and names, its shared-memory and register limits, and the PTX
instruction families it has. An engine names the instruction families it needs
(:attr:`flashgen.engines.Engine.instructions`); it runs on every target that has them all.

Numbers are from the CUDA C++ Programming Guide, "Compute Capabilities" (technical
specifications per compute capability). ``wgmma`` and ``setmaxnreg`` are *arch-specific*
features of sm_90a: code using them runs on compute capability 9.0 only, so no other target
lists them.
"""
from __future__ import annotations

import attrs

#: PTX instruction families of the Ampere generation (sm_80 and every later capability runs them).
AMPERE = frozenset({"mma.sync", "ldmatrix", "cp.async"})
#: sm_90a adds the Hopper families (TMA is ``cp.async.bulk.tensor``; wgmma and setmaxnreg need the ``a`` target).
HOPPER = AMPERE | {"tma", "mbarrier", "wgmma", "setmaxnreg"}


@attrs.frozen
class Target:
    """One compile target: ``sm_80``, ``sm_90a``, ... (``capability`` plus an arch-specific suffix)."""

    capability: tuple[int, int]
    suffix: str  # "a": arch-specific features (the kernel runs on exactly this capability)
    smem_per_block: int  # opt-in dynamic shared memory of one block, bytes
    smem_per_sm: int
    regs_per_sm: int  # 32-bit registers
    instructions: frozenset

    @property
    def name(self) -> str:
        """The name nvcc and ``--arch`` use: ``sm_80``, ``sm_90a``."""
        major, minor = self.capability
        return f"sm_{major}{minor}{self.suffix}"

    @property
    def arch(self) -> str:
        """The short form the build cache records: ``8.0``, ``9.0a``."""
        major, minor = self.capability
        return f"{major}.{minor}{self.suffix}"

    @property
    def gencode(self) -> str:
        """nvcc's flag that compiles for this target (and only it)."""
        major, minor = self.capability
        return f"-gencode=arch=compute_{major}{minor}{self.suffix},code={self.name}"

    @property
    def described(self) -> str:
        """``compute capability 9.0 (sm_90a)``, for messages and manifests."""
        major, minor = self.capability
        return f"compute capability {major}.{minor} ({self.name})"

    def has(self, instructions) -> bool:
        """Whether every instruction family of ``instructions`` runs on this target."""
        return frozenset(instructions) <= self.instructions


_KIB = 1024
#: Every target flashgen builds for, by name (the ``--arch`` choices of build and check).
TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target((8, 0), "", 163 * _KIB, 164 * _KIB, 65536, AMPERE),
        Target((8, 6), "", 99 * _KIB, 100 * _KIB, 65536, AMPERE),
        Target((8, 7), "", 163 * _KIB, 164 * _KIB, 65536, AMPERE),
        Target((8, 9), "", 99 * _KIB, 100 * _KIB, 65536, AMPERE),
        Target((9, 0), "a", 227 * _KIB, 228 * _KIB, 65536, HOPPER),
    )
}
#: What ``flashgen check`` compiles for by default: one target per engine generation.
CHECK_DEFAULT = ("sm_80", "sm_90a")


class UnknownTarget(ValueError):
    """A target name that is not in :data:`TARGETS`."""


def named(name: str) -> Target:
    """The target called ``name`` (``sm_80``, ``sm_90a``); UnknownTarget names the choices."""
    try:
        return TARGETS[name]
    except KeyError:
        raise UnknownTarget(f"unknown arch {name!r}; supported: {', '.join(TARGETS)}") from None


def of_capability(capability: tuple[int, int]) -> Target:
    """The target a GPU of ``capability`` compiles for: the table's entry, or for a capability the
    table lacks (a newer GPU) a plain target of that capability with the Ampere instruction families,
    which every later GPU runs (arch-specific features never carry over)."""
    capability = (int(capability[0]), int(capability[1]))
    for t in TARGETS.values():
        if t.capability == capability:
            return t
    instructions = AMPERE if capability >= (8, 0) else frozenset()
    base = TARGETS["sm_80"]
    return Target(capability, "", base.smem_per_block, base.smem_per_sm, base.regs_per_sm, instructions)
