"""Keep only the PTX helpers a kernel calls: emitted files carry no dead code for readers to skip.

The builders render helpers in families (all mbarrier ops, all vector moves, ...). A family is
cut into *groups*: a comment opens a group and covers the helper definitions up to the next
comment, so a comment is dropped only with every helper it describes. A group stays when one of
its helpers is named in the kernel outside the helpers, or in a group that stays (``mbar_wait``
keeps ``mbar_try_wait``).
"""
from __future__ import annotations

import re
from typing import Sequence

import attrs

_DEF = re.compile(r"^__device__ __forceinline__ [^(]*?\b(\w+)\(")


@attrs.frozen
class HelperGroup:
    names: tuple[str, ...]  # the helpers it defines
    text: str


def groups(family: str) -> list[HelperGroup]:
    """Cut one builder's text into comment-led groups of definitions."""
    out: list[HelperGroup] = []
    lines: list[str] = []
    names: list[str] = []
    in_def = False

    def close() -> None:
        if lines:
            if not names:
                raise ValueError(f"helper text with no definition: {lines[0]!r}")
            out.append(HelperGroup(tuple(names), "\n".join(lines)))
        lines.clear()
        names.clear()

    for line in family.strip("\n").split("\n"):
        if in_def:
            lines.append(line)
            in_def = line != "}"  # a definition ends at a closing brace in column 0
            continue
        if line.startswith("//") and names:  # a new comment after definitions: a new group
            close()
        if not line.strip():
            continue
        m = _DEF.match(line)
        if m:
            names.append(m.group(1))
            in_def = not line.rstrip().endswith("}")
        lines.append(line)
    if in_def:
        raise ValueError(f"unterminated helper definition in group {names}")
    close()
    return out


def _names_in(text: str) -> set[str]:
    return set(re.findall(r"\w+", text))


def keep_used(families: Sequence[str], kernel: str) -> str:
    """The helper text for ``kernel`` (the source without its helpers): the families in order,
    each reduced to the groups reachable from the kernel; a blank line between families."""
    cut = [groups(f) for f in families]
    referenced = _names_in(kernel)
    kept: set[int] = set()
    changed = True
    while changed:  # a fixed point: helpers calling helpers
        changed = False
        for g in (g for fam in cut for g in fam):
            if id(g) not in kept and referenced & set(g.names):
                kept.add(id(g))
                referenced |= _names_in(g.text)
                changed = True
    parts = ["\n".join(g.text for g in fam if id(g) in kept) for fam in cut]
    return "\n\n".join(p for p in parts if p)


# Emitters render their template with this in place of the helpers, then call `insert_used`.
HELPERS_MARK = "/* @ptx_helpers@ */"


def insert_used(source: str, families: Sequence[str]) -> str:
    """``source`` with its HELPERS_MARK replaced by the helpers it uses."""
    if source.count(HELPERS_MARK) != 1:
        raise ValueError("the kernel source must hold the helpers mark exactly once")
    return source.replace(HELPERS_MARK, keep_used(families, source.replace(HELPERS_MARK, "")))
