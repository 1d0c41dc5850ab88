"""The values of repeated calls with one (score_mod, mask_mod) pair of function objects, read fast.

:func:`flashgen.mods.prepare_mods` looks each function up in the trace cache and binds it through its
traces' sources (:meth:`TracedMod.bind`) on every call. A :class:`CallValues` is made once for a pair
whose KernelMods came from exactly those functions: it holds their closure cells and globals
dictionaries (a function's ``__closure__`` and ``__globals__`` cannot be replaced; its ``__code__``
can, and is compared on every call), and each call only reads the cells again:

* a number compiled in as a literal must still be equal and of the same type;
* a float scalar must be a ``float``, an int scalar an ``int`` within int32 (other values go through
  the same conversion as ``bind``);
* a captured tensor that is the same object as last time, of the same version, dtype and rank, and
  not requiring grad, is passed as last time (the same converted copy); any other goes through the
  checks and conversions of ``bind`` and :func:`stable_copy` again.

Whatever ``bind`` would refuse or call stale makes :meth:`CallValues.read` answer None, so the caller
takes the full path, which retraces or raises the error it always raised.

The launcher repeats these reads in C++ (:meth:`CallValues.attach`): its reader is built from this object's
places, literals and scalar kinds, and after each read here it gets the state the read left
(:meth:`CallValues.publish`). It serves a call only where every value is read the way :meth:`read` reads it and
matches that state (an exact ``float`` / ``int``, each captured tensor the same object and version as last read,
the block mask of the same mask values and sizes); any other call it leaves to this object.
"""
from __future__ import annotations

import struct
import types
import weakref
from typing import Any, Callable

from .copies import stable_copy
from .expr import FLOAT, INT, INT32_MAX, INT32_MIN
from .kernel_mods import KernelMods, _to_word
from .traced import StaleTrace, _scalar_value, _tensor_value

_F32 = struct.Struct("<f")
_I32 = struct.Struct("<i")


def _place(source, fn: Callable) -> tuple:
    """Where ``source``'s value of ``fn`` lives: ``(cell, None, None)`` or ``(None, globals, key)`` (of the function
    its path leads to: the functions on the way are compiled in, so the place stays while the trace holds)."""
    holder = source.holder(fn)
    if source.kind == "cell":
        return holder.__closure__[source.key], None, None
    return None, holder.__globals__, source.key


def _reader(place: tuple) -> Callable[[], Any]:
    """A function reading the value at ``place`` now (a cell's contents or a global)."""
    cell, table, key = place
    if cell is not None:
        return lambda: cell.cell_contents
    return lambda: table[key]


def _scalar_word(arg, value) -> int:
    """The launcher's word for scalar ``arg``'s ``value`` (the conversion of TracedMod.bind + KernelMods.pack)."""
    if not arg.from_tensor:
        kind = type(value)
        if kind is float and arg.dtype == FLOAT:
            return _I32.unpack(_F32.pack(value))[0]
        if kind is int and arg.dtype == INT and INT32_MIN <= value <= INT32_MAX:
            return value
    return _to_word(arg.dtype, _scalar_value(arg, value))


def _native_spec(mods: KernelMods, score_fn, mask_fn, statics: list, scalars: list, tensors: list,
                 mask_words: slice) -> "tuple | None":
    """The launcher reader's arguments after the kernel (``native.ModReader``), or None where it could not read
    a value the way :meth:`CallValues.read` does: a function that is not a plain one (its code read through
    ``__code__``), a globals mapping that is not a plain dict, a scalar that is a 0-d tensor or not a float / int."""
    for fn in (score_fn, mask_fn):
        if fn is not None and (type(fn) is not types.FunctionType or type(fn.__globals__) is not dict):
            return None
    if any(a.from_tensor or a.dtype not in (FLOAT, INT) for _, a in scalars):
        return None
    if any(table is not None and type(table) is not dict for (_, table, _), _ in (*statics, *scalars, *tensors)):
        return None  # a function the mod calls reads a globals mapping that is not a plain dict
    fns = tuple((weakref.ref(fn), fn.__code__) if fn is not None else None for fn in (score_fn, mask_fn))
    return (fns, statics, [(place, a.dtype == FLOAT) for place, a in scalars], [(place, a.rank) for place, a in tensors],
            mask_words.start, mask_words.stop - mask_words.start, mods.mask is not None)


class _TensorSlot:
    """One captured tensor's reader and what it passed last time."""

    __slots__ = ("read", "arg", "changes", "source", "version", "dtype", "device", "passed")

    def __init__(self, read: Callable, arg, changes: list) -> None:
        self.read, self.arg, self.changes, self.source = read, arg, changes, None  # changes: [count], shared
        self.version = self.dtype = self.device = self.passed = None

    def value(self, device) -> Any:
        """The tensor the launcher gets (on ``device``, in the kernel's dtype)."""
        t = self.read()
        if (self.source is not None and self.source() is t and t._version == self.version and t.dtype is self.dtype
                and not t.requires_grad and device == self.device and t.ndim == self.arg.rank):
            return t if self.passed is None else self.passed
        passed = _tensor_value(self.arg, t)
        passed = stable_copy(passed, passed.dtype, device)
        self.source, self.version, self.dtype, self.device = weakref.ref(t), t._version, t.dtype, device
        self.passed = None if passed is t else passed  # the source itself is held only weakly
        self.changes[0] += 1
        return passed


class CallValues:
    """Reads the values of calls with ``score_fn`` / ``mask_fn`` (either may be None) for ``mods``, the
    KernelMods traced from exactly these function objects (``prepare_mods(score_fn, mask_fn)[0]``)."""

    def __init__(self, mods: KernelMods, score_fn: "Callable | None", mask_fn: "Callable | None") -> None:
        self.mods = mods
        # a dropped function drops the readers too: they hold its cells, and the cells its captured tensors
        self._fns = tuple((weakref.ref(fn, self._forget), fn.__code__) if fn is not None else None
                          for fn in (score_fn, mask_fn))
        pairs = [(m, score_fn if m.kind == "score" else mask_fn) for m in mods.mods]
        statics = [(_place(source, fn), value) for m, fn in pairs for source, value in m.static]
        scalars = [(_place(a.source, fn), a) for m, fn in pairs for a in m.scalars]
        tensors = [(_place(a.source, fn), a) for m, fn in pairs for a in m.tensors]
        self._statics = [(_reader(place), value) for place, value in statics]
        self._scalars = [(_reader(place), a) for place, a in scalars]
        self._changes = [0]  # bumped by every read whose values differ from the previous read's
        self._words: list = []
        self._tensors = [_TensorSlot(_reader(place), a, self._changes) for place, a in tensors]
        first = len(mods.score.scalars) if mods.score is not None else 0
        self._mask_words = slice(first, first + (len(mods.mask.scalars) if mods.mask is not None else 0))
        self.native = None  # the launcher's reader (attach)
        self._published: "tuple | None" = None  # (epoch, block mask) it was last given
        self._native_spec = _native_spec(mods, score_fn, mask_fn, statics, scalars, tensors, self._mask_words)

    @property
    def epoch(self) -> int:
        """Changes whenever a read's values differ from the previous read's (a new number, another tensor, a new
        version of one): equal epochs, equal values."""
        return self._changes[0]

    def _forget(self, _ref=None) -> None:
        self._statics, self._scalars, self._tensors = (), (), ()
        self._native_spec = self._published = None
        if self.native is not None:
            self.native.forget()

    def forget(self) -> None:
        """Drop what this object and its launcher reader hold (the functions' cells, copies, block mask): it serves
        nothing from now on."""
        self._fns = None
        self._forget()

    def attach(self, native: Any, kernel: int) -> Any:
        """Make the launcher's reader (``native.ModReader``) of these calls through ``kernel``, where it can read every
        value as :meth:`read` does (plain functions, plain globals dictionaries, Python-number scalars): it, or None."""
        if self._native_spec is not None:
            self.native = native.ModReader(kernel, *self._native_spec)
            # the launcher's tables outlive this object (and the Attention holding it): its reader then forgets too
            weakref.finalize(self, self.native.forget).atexit = False
        return self.native

    def publish(self, device, q, k, words: list, block_mask) -> None:
        """Give the launcher's reader the state a successful :meth:`read` on ``device`` left: each tensor slot's, and
        the block mask of the call's sizes (q's, k's) and mask values (None: no mask_mod). The state it already has
        (the same epoch and block mask) is not given again: a reader that has it refused the call for good reason."""
        if self.native is None or (self._published is not None and self._published[0] == self._changes[0]
                                   and self._published[1] is block_mask):
            return
        self._published = (self._changes[0], block_mask)
        slots = [(s.source, s.version, s.dtype, s.passed) for s in self._tensors]
        self.native.update(device, slots, words[self._mask_words], q, k, block_mask)

    @staticmethod
    def usable(score_fn: Any, mask_fn: Any) -> bool:
        """Whether both functions can be held weakly and read through their cells (plain Python functions)."""
        for fn in (score_fn, mask_fn):
            if fn is None:
                continue
            try:
                weakref.ref(fn)
            except TypeError:
                return False
            if not (hasattr(fn, "__code__") and hasattr(fn, "__closure__") and hasattr(fn, "__globals__")):
                return False
        return True

    def serves(self, score_fn: Any, mask_fn: Any) -> bool:
        """Whether this reader was made for these function objects with their current code."""
        if self._fns is None:  # forgotten
            return False
        score, mask = self._fns
        if score is None:
            if score_fn is not None:
                return False
        elif score[0]() is not score_fn or score_fn.__code__ is not score[1]:
            return False
        if mask is None:
            return mask_fn is None
        return mask[0]() is mask_fn and mask_fn.__code__ is mask[1]

    def read(self, device) -> "tuple[list[int], list[Any]] | None":
        """This call's (scalar words, tensors on ``device``) in :meth:`KernelMods.pack`'s order, or None where the
        full path must run (a value that is stale for the trace, refused, or unreadable)."""
        words, tensors = [], []
        try:
            for read, value in self._statics:
                now = read()
                if type(now) is not type(value) or now != value:
                    return None
            for read, arg in self._scalars:
                words.append(_scalar_word(arg, read()))
            for slot in self._tensors:
                tensors.append(slot.value(device))
            if words != self._words:
                self._words = words
                self._changes[0] += 1
        except (StaleTrace, ValueError, TypeError, KeyError, OverflowError, AttributeError, RuntimeError):
            return None  # the full path reports it (ModError is a ValueError) or retraces
        return words, tensors
