"""Tracing: calling a mod with proxies and recording what it computes as an expression DAG.

``score_mod(score, b, h, q_idx, kv_idx)`` receives fp32 and int32 proxies, ``mask_mod(b, h, q_idx,
kv_idx)`` int32 ones. Captured Python numbers are swapped for run-time scalar proxies first
(capture.py); one that the code turns back into a Python value (``range(n)``, ``if flag > 0``,
``math.sqrt(d)``) cannot be a run-time argument, so the trace starts again with that number kept
as a literal (it then belongs to the kernel's key). Captured tensors are named when an operation
meets them. Everything else a mod does to the proxies goes through the tables of proxy.py and
torch_table.py; anything outside them raises a ModError naming the function and its line.
"""
from __future__ import annotations

import inspect
import os
import sys
import types

import numpy as np
import torch

from .capture import Captures, is_number
from .errors import ModError
from .evaluate import evaluate
from .expr import BOOL, FLOAT, INT, Arg, Buffer, Load, OpError, Scalar, cast, const, load, postorder
from .proxy import Proxy
from .torch_table import kernel_dtype
from .traced import TracedMod, make_traced

PARAMS = {"score": ("score", "b", "h", "q_idx", "kv_idx"), "mask": ("b", "h", "q_idx", "kv_idx")}
_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
CONTROL_FLOW_HINT = ("data-dependent Python control flow cannot be compiled: write torch.where(c, x, y) for "
                     "if/else, & | ~ for and/or/not, torch.minimum/torch.maximum for min/max")


class _NeedStatic(Exception):
    """Captured numbers the code turned into Python values: retrace with them as literals."""

    def __init__(self, names: set):
        super().__init__(sorted(names))
        self.names = names


def describe(fn, kind: str) -> str:
    """``score_mod softcap (mods.py:12)``: the function, where it is defined."""
    code = getattr(fn, "__code__", None)
    where = f" ({os.path.basename(code.co_filename)}:{code.co_firstlineno})" if code else ""
    return f"{kind}_mod {getattr(fn, '__qualname__', repr(fn))}{where}"


def _user_line() -> str:
    """' at file:line' of the innermost frame outside flashgen.mods and torch (the user's line)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith((_HERE, _TORCH)):
            return f", line {frame.f_lineno}"
        frame = frame.f_back
    return ""


class Tracer:
    """The state of one trace: the captures, and the scalars and tensors met so far."""

    def __init__(self, fn, kind: str, captures: Captures):
        self.fn, self.kind, self.captures = fn, kind, captures
        self.scalars = {}  # name -> (Source, is_tensor)
        self.buffers = {}  # name -> (Source, Buffer)

    def error(self, msg: str) -> ModError:
        head = describe(self.fn, self.kind)[:-1] + _user_line() + ")"
        return ModError(f"{head} {msg}" if msg.startswith("uses") else f"{head}: {msg}")

    def fail(self, msg: str):
        raise self.error(msg)

    def checked(self, build, *args):
        try:
            return build(*args)
        except OpError as e:
            raise self.error(str(e)) from None

    def wrap(self, expr) -> Proxy:
        return Proxy(expr, self)

    def scalar(self, source, dtype: str, is_tensor: bool) -> Scalar:
        self.scalars[source.name] = (source, is_tensor)
        return Scalar(source.name, dtype)

    def lift(self, x):
        """Any operand as an expression node (proxies, Python numbers, 0-d tensors)."""
        if isinstance(x, Proxy):
            return x.expr
        if isinstance(x, (bool, np.bool_)):
            return const(bool(x), BOOL)
        if isinstance(x, (int, np.integer)):
            return self.checked(const, int(x), INT)
        if isinstance(x, (float, np.floating)):
            return const(float(x), FLOAT)
        if isinstance(x, torch.Tensor):
            return self._tensor_operand(x)
        raise self.error(f"uses a {type(x).__name__} value ({x!r}) in a traced operation")

    def _tensor_operand(self, t: torch.Tensor):
        source = self.captures.name_of(t)
        if t.dim() == 0:
            dtype = self.checked(kernel_dtype, t.dtype, "a 0-d tensor")
            return self.scalar(source, dtype, True) if source else self.checked(const, t.item(), dtype)
        what = f"the captured tensor '{source.name}'" if source else "a tensor made inside the mod"
        raise self.error(f"uses {what} of shape {tuple(t.shape)} as a whole: index it element by element "
                         "with the mod's arguments (e.g. bias[h, q_idx - kv_idx])")

    def index(self, t, index) -> Load:
        """``t[index]`` for a captured tensor ``t`` and integer expression indices."""
        source = self.captures.name_of(t) if isinstance(t, torch.Tensor) else None
        if source is None:
            self.fail("indexes a tensor that is not captured from the function's closure or globals; "
                      "create tensors outside the mod and capture them")
        parts = index if isinstance(index, tuple) else (index,)
        for p in parts:
            if p is None or p is Ellipsis or isinstance(p, (slice, list, torch.Tensor)):
                self.fail(f"indexes '{source.name}' with {p!r}: only integer expressions (one per dimension) compile")
        dtype = self.checked(kernel_dtype, t.dtype, f"captured tensor '{source.name}'")
        buffer = Buffer(source.name, dtype, t.dim())
        self.buffers[source.name] = (source, buffer)
        return self.checked(load, buffer, tuple(self.lift(p) for p in parts))

    def to_python(self, expr, what: str, conv):
        """A proxy turned into a Python value: only constants and captured scalars can be."""
        nodes = postorder(expr)
        if any(isinstance(n, (Arg, Load)) for n in nodes):
            self.fail(f"converts a traced value to a Python value ({what}); {CONTROL_FLOW_HINT}")
        names = {n.name for n in nodes if isinstance(n, Scalar)}
        if any(self.scalars[n][1] for n in names):  # a captured 0-d tensor has no literal form
            self.fail(f"converts a value computed from a captured 0-d tensor to a Python value ({what}); {CONTROL_FLOW_HINT}")
        if names:
            raise _NeedStatic(names)
        return conv(evaluate(expr, {}, {}).item())


def _check_callable(fn, kind: str) -> None:
    if not isinstance(fn, types.FunctionType):
        raise ModError(f"{kind}_mod {fn!r} must be a plain Python function (def or lambda); "
                       "keep state in variables it captures")
    try:
        inspect.signature(fn).bind(*PARAMS[kind])
    except TypeError:
        raise ModError(f"{describe(fn, kind)} must take {len(PARAMS[kind])} arguments "
                       f"({', '.join(PARAMS[kind])}), as FlexAttention's {kind}_mod does") from None


def _compiled_in(value, made_static: bool) -> bool:
    """Whether a captured value is part of the trace as a Python value (a flag, a string, a tuple of
    sizes or of functions, a function it calls, a number the code needed as a Python number), so that a
    new value must retrace."""
    if is_number(value):
        return made_static
    # a function the mod calls (a helper, a composed mask's part): the trace followed its code and captures
    return isinstance(value, (bool, str, tuple, type(None), types.FunctionType))


def trace(fn, kind: str) -> TracedMod:
    """Trace ``fn`` as a ``kind`` ("score" or "mask") mod into its canonical TracedMod."""
    if kind not in PARAMS:
        raise ValueError(f"kind={kind!r}: expected 'score' or 'mask'")
    _check_callable(fn, kind)
    captures, static = Captures.of(fn), set()
    while True:
        tracer = Tracer(fn, kind, captures)
        numbers = [s for s in captures.numbers() if s.name not in static]
        replace = {s: tracer.wrap(tracer.scalar(s, INT if isinstance(s.read(fn), int) else FLOAT, False))
                   for s in numbers}
        args = [tracer.wrap(Arg(p, FLOAT if p == "score" else INT)) for p in PARAMS[kind]]
        try:
            result = captures.substitute(replace)(*args)
        except _NeedStatic as e:
            if e.names <= static:
                raise AssertionError(f"retracing did not make {sorted(e.names)} static") from None
            static |= e.names
            continue
        break
    root = cast(tracer.lift(result), FLOAT if kind == "score" else BOOL)
    frozen = tuple((s, v) for s in captures.sources if _compiled_in(v := s.read(fn), s.name in static))
    return make_traced(kind, root, tracer.scalars, tracer.buffers, frozen, describe(fn, kind))
