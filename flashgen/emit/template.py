"""A tiny code template: ``$name`` / ``${name}`` substitution with indented block expansion.

A placeholder alone on its line is replaced by a block (a string with newlines or
a list of strings), every line re-indented to the placeholder's column; elsewhere
it is replaced inline. Unknown or unused names are errors, so templates stay honest.
"""
from __future__ import annotations

import re
from typing import Iterable, Union

Value = Union[str, int, Iterable[str]]
_NAME = re.compile(r"\$(?:\{(\w+)\}|(\w+))")
_BLOCK_LINE = re.compile(r"^(?P<indent>[ \t]*)\$(?:\{(?P<a>\w+)\}|(?P<b>\w+))[ \t]*$")


def _block_text(value: Value) -> list[str]:
    if isinstance(value, (str, int)):
        return str(value).split("\n")
    lines: list[str] = []
    for item in value:
        lines.extend(str(item).split("\n"))
    return lines


class CodeTemplate:
    def __init__(self, text: str) -> None:
        self.text = text
        self.names = {a or b for a, b in _NAME.findall(text)}

    def substitute(self, **env: Value) -> str:
        missing = self.names - env.keys()
        extra = env.keys() - self.names
        if missing or extra:
            raise KeyError(f"template names missing: {sorted(missing)}, unused: {sorted(extra)}")
        out: list[str] = []
        for line in self.text.split("\n"):
            m = _BLOCK_LINE.match(line)
            if m:
                indent = m.group("indent")
                for sub in _block_text(env[m.group("a") or m.group("b")]):
                    out.append(indent + sub if sub.strip() else "")
                continue

            def inline(mm: re.Match) -> str:
                value = env[mm.group(1) or mm.group(2)]
                if not isinstance(value, (str, int)):
                    raise TypeError(f"${mm.group(1) or mm.group(2)} is a block; put it alone on its line")
                return str(value)

            out.append(_NAME.sub(inline, line))
        return "\n".join(out)


def compose(parts: "list[tuple[str, CodeTemplate]]", env: "dict[str, Value]") -> str:
    """Render ``parts`` in order, each from ``env`` and the parts rendered before it (by name, so a
    part's ``$name`` line takes an earlier part as a block); the last part is the result. As strict as
    one template: a name no part uses, or one a part needs and nothing gives, is an error."""
    env = dict(env)
    used: set[str] = set()
    for name, template in parts:
        missing = template.names - env.keys()
        if missing:
            raise KeyError(f"template {name!r} names missing: {sorted(missing)}")
        used |= template.names
        env[name] = template.substitute(**{k: env[k] for k in template.names})
    unused = env.keys() - used - {parts[-1][0]}
    if unused:
        raise KeyError(f"template names unused: {sorted(unused)}")
    return env[parts[-1][0]]


#: A launcher's opt-in to ``smem`` bytes of dynamic shared memory for its ``kernel``, once per process.
SMEM_ATTRIBUTE = [
    "static bool attr_set = false;  // the attribute is per function; set it once",
    "if (!attr_set) {",
    "    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);",
    "    if (e != cudaSuccess) return (int)e;",
    "    attr_set = true;",
    "}",
]
