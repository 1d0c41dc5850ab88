"""What a mod captures: the Python numbers and tensors its code reads from its closure and globals.

A captured value has a :class:`Source` (a closure cell or a global name) that is read again on every
call (:meth:`Source.read`), so a traced mod always runs with the captured values of the moment
while its kernel, which receives them as arguments, stays the same. Numbers are swapped for
proxies before the trace (:func:`substitute`); tensors stay real and are named by identity when an
operation meets one (:meth:`Captures.name_of`).

The functions a mod calls through its captures (a helper it reads from its globals, or the parts of a
composed mask such as FlexAttention's ``and_masks(causal, document)``: functions, or a tuple of them, in a
cell or a global) capture values too: theirs are sources with a :attr:`Source.path`, the hops
from the mod to that function. The functions and tuples on the way are compiled in (a new one retraces).
"""
from __future__ import annotations

import types
from typing import Callable

import attrs


#: One hop from a function to a function it calls through a capture: ``(kind, key, item)``, the capture's kind
#: ("cell" or "global") and key, and ``item`` its index where it holds a tuple of functions (else None).
Hop = tuple

#: How deep captures are followed into the functions a mod calls (a helper of a helper of a composed mask).
MAX_DEPTH = 4


def _read(fn: Callable, kind: str, key):
    return fn.__closure__[key].cell_contents if kind == "cell" else fn.__globals__[key]


def _hop(fn: Callable, hop: Hop) -> Callable:
    kind, key, item = hop
    value = _read(fn, kind, key)
    return value if item is None else value[item]


def follow(fn: Callable, path: tuple) -> Callable:
    """The function ``path`` (hops) leads to from ``fn``."""
    for hop in path:
        fn = _hop(fn, hop)
    return fn


@attrs.frozen
class Source:
    """Where a captured value lives: ``kind`` "cell" (index into the closure) or "global", of the function
    ``path`` leads to from the mod (``()``: the mod itself)."""

    kind: str
    key: object
    name: str  # the variable's name in that function's code (qualified by the hops: "masks[1].doc")
    path: tuple = ()

    def read(self, fn: Callable):
        return _read(follow(fn, self.path), self.kind, self.key)

    def holder(self, fn: Callable) -> Callable:
        """The function whose cell or global holds the value."""
        return follow(fn, self.path)


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
        return cls(fn, _sources(fn, (), "", {id(fn)}))

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
        """A copy of the function whose listed sources read ``replace[source]`` instead (the functions on their
        paths copied too, and the tuples holding them)."""
        return _substituted(self.fn, replace, ())


def _functions_in(value) -> list:
    """``(item, function)`` of a captured value that is a plain function (item None) or a tuple of them (a tuple:
    compiled in, so a new one retraces; a list could change in place unseen)."""
    if isinstance(value, types.FunctionType):
        return [(None, value)]
    if isinstance(value, tuple) and value and all(isinstance(v, types.FunctionType) for v in value):
        return list(enumerate(value))
    return []


def _sources(fn: Callable, path: tuple, prefix: str, seen: set) -> list:
    """The sources of ``fn`` (reached by ``path``; names qualified by ``prefix``), closure cells first, then those
    of the functions it calls through them, up to :data:`MAX_DEPTH` hops (``seen``: the functions on the path, so
    that a function calling itself is not followed again; one reached twice has its sources on both paths)."""
    code, own = fn.__code__, []
    for i, name in enumerate(code.co_freevars):
        try:
            fn.__closure__[i].cell_contents
        except ValueError:  # an empty cell: a variable assigned after the function was made
            continue
        own.append(Source("cell", i, prefix + name, path))
    own += [Source("global", n, prefix + n, path) for n in _code_names(code) if n in fn.__globals__]
    out = list(own)
    if len(path) < MAX_DEPTH:
        for s in own:
            for item, inner in _functions_in(_read(fn, s.kind, s.key)):
                if id(inner) in seen:
                    continue
                label = s.name[len(prefix):] + ("" if item is None else f"[{item}]")
                out += _sources(inner, path + ((s.kind, s.key, item),), f"{prefix}{label}.", seen | {id(inner)})
    return out


def _substituted(fn: Callable, replace: dict, path: tuple) -> Callable:
    """``fn`` (at ``path``) copied with its own replaced sources and the copies of the functions it reaches."""
    inner: dict = {}  # (kind, key) -> {item: the copied function}
    for s in replace:
        if len(s.path) > len(path) and s.path[:len(path)] == path:
            kind, key, item = hop = s.path[len(path)]
            copies = inner.setdefault((kind, key), {})
            if item not in copies:
                copies[item] = _substituted(_hop(fn, hop), replace, path + (hop,))
    own = {(s.kind, s.key): v for s, v in replace.items() if s.path == path}

    def value(kind: str, key, old):
        if (kind, key) in own:
            return own[(kind, key)]
        copies = inner.get((kind, key))
        if copies is None:
            return old
        if None in copies:
            return copies[None]
        return tuple(copies.get(i, v) for i, v in enumerate(old))

    cells = fn.__closure__
    if cells is not None:
        cells = tuple(c if ("cell", i) not in own and ("cell", i) not in inner else types.CellType(value("cell", i, c.cell_contents))
                      for i, c in enumerate(cells))
    glob = fn.__globals__
    changed = [k for kind, k in list(own) + list(inner) if kind == "global"]
    if changed:
        glob = dict(glob)
        glob.update({k: value("global", k, glob[k]) for k in changed})
    new = types.FunctionType(fn.__code__, glob, fn.__name__, fn.__defaults__, cells)
    new.__kwdefaults__ = fn.__kwdefaults__
    return new
