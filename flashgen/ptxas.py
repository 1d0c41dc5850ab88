"""ptxas's report of a compiled kernel (``-Xptxas -v``): registers, spills, stack, shared memory, barriers and
serialized wgmma per entry function. ``flashgen check`` prints it; a build records it with the kernel, so a
caller can tell a kernel that compiled into local memory or serialized wgmma from a clean one."""
from __future__ import annotations

import re
from typing import Sequence

import attrs



@attrs.frozen
class PtxasStats:
    """ptxas's report for one entry function."""

    function: str
    registers: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    stack_frame: int  # bytes
    static_smem: int  # bytes
    barriers: int = 0
    #: ptxas's remark that it serialized the wgmma.mma_async (each waits for the previous one): C7512 for want of
    #: registers, C7514 for other instructions touching an in-flight accumulator, or any other reason it gives
    serialized: bool = False

    @property
    def clean(self) -> bool:
        """No spills and no stack frame (no local memory)."""
        return self.spill_stores == 0 and self.spill_loads == 0 and self.stack_frame == 0

    def problems(self) -> list[str]:
        """What costs this entry speed, in words: local memory (spills, a stack frame) and serialized wgmma."""
        out = [] if self.clean else [f"{self.function}: {self.spill_stores} bytes of spill stores, {self.spill_loads} of "
                                     f"spill loads, {self.stack_frame} of stack frame"]
        return out + ([f"{self.function}: wgmma serialized"] if self.serialized else [])


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_BARRIERS = re.compile(r"used (\d+) barriers")
_SERIALIZED = re.compile(r"\(C75\d\d\).*wgmma\S* instructions are serialized.* (?:for|in) the function '([^']+)'")


def parse_ptxas(log: str) -> list[PtxasStats]:
    """Entry functions of a ``ptxas -v`` log (order of appearance).

    ptxas prints, per entry: ``Compiling entry function 'F'``, ``Function properties
    for F`` followed by ``N bytes stack frame, N bytes spill stores, N bytes spill
    loads``, and ``Used N registers, [used N barriers,] [N bytes smem,] ...``; before the entry, sm_90a's
    ``(C75xx) ... wgmma.mma_async instructions are serialized due to <reason> for (or in) the function 'F'``.
    Properties of non-entry (device) functions are ignored.
    """
    serialized = set(_SERIALIZED.findall(log))
    entries: dict[str, dict] = {}
    current_entry: str | None = None
    props_for: str | None = None
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            current_entry = m.group(1)
            entries[current_entry] = {"frame": (0, 0, 0), "regs": None, "smem": 0, "barriers": 0}
            props_for = None
            continue
        m = _PROPS.search(line)
        if m:
            props_for = m.group(1)
            continue
        m = _FRAME.search(line)
        if m and props_for is not None and props_for in entries:
            entries[props_for]["frame"] = tuple(int(x) for x in m.groups())
            continue
        m = _USED.search(line)
        if m and current_entry is not None:
            e = entries[current_entry]
            e["regs"] = int(m.group(1))
            s = _SMEM.search(line)
            e["smem"] = int(s.group(1)) if s else 0
            b = _BARRIERS.search(line)
            e["barriers"] = int(b.group(1)) if b else 0
    out = []
    for name, e in entries.items():
        if e["regs"] is None:
            continue
        stack, st, ld = e["frame"]
        out.append(PtxasStats(name, e["regs"], st, ld, stack, e["smem"], e["barriers"], name in serialized))
    return out


def combined(entries: Sequence[PtxasStats]) -> PtxasStats:
    """The report of a translation unit of several entry functions (a backward file has three): the
    most registers, stack frame, static shared memory and barriers of any, the spills of all, serialized
    wgmma where any has them."""
    if len(entries) == 1:
        return entries[0]
    return PtxasStats(
        "+".join(e.function for e in entries), max(e.registers for e in entries), sum(e.spill_stores for e in entries),
        sum(e.spill_loads for e in entries), max(e.stack_frame for e in entries), max(e.static_smem for e in entries),
        max(e.barriers for e in entries), any(e.serialized for e in entries),
    )
