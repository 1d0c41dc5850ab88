"""What a mod captures: the Python numbers and tensors its code reads from its closure and globals.

A captured value has a :class:`Source` (a closure cell or a global name) that is read again on every
call (:meth:`Source.read`), so a traced mod always runs with the captured values of the moment
while its kernel, which receives them as arguments, stays the same. Numbers are swapped for
proxies before the trace (:func:`substitute`); tensors stay real and are named by identity when an
operation meets one (:meth:`Captures.name_of`).
"""
from __future__ import annotations

import types
from typing import Callable

import attrs


@attrs.frozen
class Source:
    """Where a captured value lives: ``kind`` "cell" (index into the closure) or "global"."""

    kind: str
    key: object
    name: str  # the variable's name in the function's code

    def read(self, fn: Callable):
        if self.kind == "cell":
            return fn.__closure__[self.key].cell_contents
        return fn.__globals__[self.key]


def _code_names(code: types.CodeType) -> list:
    """Global names read by ``code`` and the functions defined inside it, in order, once each."""
    names = list(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names.extend(_code_names(c))
    return list(dict.fromkeys(names))


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@attrs.define
class Captures:
    """The captured variables of a plain Python function, closure cells first."""

    fn: Callable
    sources: list

    @classmethod
    def of(cls, fn: Callable) -> "Captures":
        code, sources = fn.__code__, []
        for i, name in enumerate(code.co_freevars):
            try:
                fn.__closure__[i].cell_contents
            except ValueError:  # an empty cell: a variable assigned after the function was made
                continue
            sources.append(Source("cell", i, name))
        sources += [Source("global", n, n) for n in _code_names(code) if n in fn.__globals__]
        return cls(fn, sources)

    def numbers(self) -> list:
        """Sources holding Python ints/floats (bools are flags: they stay Python values)."""
        return [s for s in self.sources if is_number(s.read(self.fn))]

    def name_of(self, value) -> "Source | None":
        """The source holding exactly this object (a captured tensor met during the trace)."""
        for s in self.sources:
            if s.read(self.fn) is value:
                return s
        return None

    def substitute(self, replace: dict) -> Callable:
        """A copy of the function whose listed sources read ``replace[source]`` instead."""
        fn = self.fn
        cells = fn.__closure__
        if cells is not None:
            cells = tuple(types.CellType(replace[s]) if (s := Source("cell", i, n)) in replace else c
                          for i, (n, c) in enumerate(zip(fn.__code__.co_freevars, cells)))
        glob = fn.__globals__
        if any(s.kind == "global" for s in replace):
            glob = dict(glob)
            glob.update({s.key: v for s, v in replace.items() if s.kind == "global"})
        new = types.FunctionType(fn.__code__, glob, fn.__name__, fn.__defaults__, cells)
        new.__kwdefaults__ = fn.__kwdefaults__
        return new
