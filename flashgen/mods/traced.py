"""A traced mod in canonical form: its DAG, its run-time arguments, and the key of its kernel.

Canonical names replace the user's: scalars ``s0, s1, ...`` and tensors ``t0, t1, ...`` in the
order the DAG first uses them (operands before users, left to right). The canonical text lists the
DAG's nodes in that order with dtypes, tensor ranks and literal values but no captured values and
no user names, so :attr:`TracedMod.key` is the same for every function of one structure (which then
share one kernel) and for every call of one function (whatever its captured values are then).

:meth:`TracedMod.bind` reads the captured values of the moment from the function, converted to the
kernel's dtypes: the arguments of one call (:class:`ModArgs`). A value whose kind changed (an int
that became a float, a tensor of another rank, a literal-kept number with a new value) makes the
trace stale and the cache (cache.py) traces again.
"""
from __future__ import annotations

import functools
import hashlib

import attrs
import numpy as np

from .capture import Source, is_number
from .copies import stable_copy
from .cpp import render
from .evaluate import evaluate
from .errors import ModError
from .expr import BOOL, FLOAT, INT, INT32_MAX, INT32_MIN, Arg, Binary, Buffer, Cast, Load, Scalar, Unary, Where, postorder


class StaleTrace(Exception):
    """The function's captured values no longer fit its trace (see the module docstring)."""


@attrs.frozen
class ScalarArg:
    name: str  # canonical: s<i>, the struct field
    dtype: str
    source: Source  # where the value is read (source.name is the user's variable)
    from_tensor: bool = False  # a captured 0-d tensor rather than a Python number


@attrs.frozen
class TensorArg:
    name: str  # canonical: t<i>; the struct holds t<i> (pointer) and t<i>_s0.. (strides, elements)
    dtype: str
    rank: int
    source: Source


@attrs.frozen
class ModArgs:
    """One call's captured values in the struct's order: scalars (Python numbers) and tensors
    (torch, converted to float32 / int32 / bool, on their own device; strides in elements)."""

    scalars: tuple
    tensors: tuple
    names: tuple  # canonical names, scalars then tensors

    def values(self) -> dict:
        """Canonical name -> number or numpy array, for :meth:`TracedMod.evaluate`."""
        vals = list(self.scalars) + [t.detach().cpu().numpy() for t in self.tensors]
        return dict(zip(self.names, vals))


_TORCH_OF = {FLOAT: "float32", INT: "int32", BOOL: "bool"}


def _rebuild(node, memo: dict, rename: dict):
    """``node`` with every Scalar/Buffer renamed canonically (memoized over the DAG)."""
    if node in memo:
        return memo[node]
    new = node
    if isinstance(node, Scalar):
        new = Scalar(rename[node.name], node.dtype)
    elif isinstance(node, Load):
        b = node.buffer
        new = Load(Buffer(rename[b.name], b.dtype, b.rank), tuple(_rebuild(i, memo, rename) for i in node.index), node.dtype)
    elif isinstance(node, (Cast, Unary)):
        new = attrs.evolve(node, x=_rebuild(node.x, memo, rename))
    elif isinstance(node, Binary):
        new = attrs.evolve(node, a=_rebuild(node.a, memo, rename), b=_rebuild(node.b, memo, rename))
    elif isinstance(node, Where):
        new = attrs.evolve(node, cond=_rebuild(node.cond, memo, rename), a=_rebuild(node.a, memo, rename),
                           b=_rebuild(node.b, memo, rename))
    memo[node] = new
    return new


def canonical_text(kind: str, root) -> str:
    """One line per distinct node, operands as ``%<index>``: structure, dtypes, ranks, literals."""
    nodes = postorder(root)
    index = {n: i for i, n in enumerate(nodes)}
    lines = [f"{kind}_mod"]
    for i, n in enumerate(nodes):
        fields = []
        for f in attrs.fields(type(n)):
            v = getattr(n, f.name)
            if isinstance(v, tuple):
                fields.append("[" + " ".join(f"%{index[x]}" for x in v) + "]")
            elif hasattr(v, "operands"):  # an operand node
                fields.append(f"%{index[v]}")
            else:
                fields.append(repr(v))
        lines.append(f"%{i} = {type(n).__name__} " + " ".join(fields))
    return "\n".join(lines)


def make_traced(kind: str, root, scalars: dict, buffers: dict, static: tuple, description: str) -> "TracedMod":
    """Canonicalize a finished trace (``scalars``/``buffers``: user name -> (Source, ...))."""
    rename, s_args, t_args = {}, [], []
    for node in postorder(root):
        if isinstance(node, Scalar) and node.name not in rename:
            rename[node.name] = f"s{len(s_args)}"
            source, from_tensor = scalars[node.name]
            s_args.append(ScalarArg(rename[node.name], node.dtype, source, from_tensor))
        elif isinstance(node, Load) and node.buffer.name not in rename:
            b = node.buffer
            rename[b.name] = f"t{len(t_args)}"
            t_args.append(TensorArg(rename[b.name], b.dtype, b.rank, buffers[b.name][0]))
    return TracedMod(kind, _rebuild(root, {}, rename), tuple(s_args), tuple(t_args), static, description)


@attrs.frozen(eq=False)
class TracedMod:
    kind: str  # "score" or "mask"
    expr: object  # the root of the canonical DAG
    scalars: tuple  # ScalarArg, struct order
    tensors: tuple  # TensorArg, struct order
    static: tuple  # (Source, value): captured numbers kept as literals
    description: str  # "score_mod softcap (mods.py:12)"

    @functools.cached_property  # a traced mod is immutable; calls read its key and arguments every time
    def canonical(self) -> str:
        return canonical_text(self.kind, self.expr)

    @functools.cached_property
    def key(self) -> str:
        """Hash of :attr:`canonical`: equal for equal structure, whatever the captured values."""
        return hashlib.sha256(self.canonical.encode()).hexdigest()[:16]

    @functools.cached_property
    def diagonal(self) -> "tuple | None":
        """A mask_mod's (:class:`flashgen.mods.diagonal.Diagonal`, rest): its diagonal conjuncts, which the built-in
        causal / window rule runs, and the rest of it as a TracedMod of its own (canonical names; it reads its values
        from the same function; None: no rest). None where it has no such conjunct (or for a score_mod). Derived
        once per trace, so every call of one trace compiles the same rest."""
        from .diagonal import split

        found = split(self.expr) if self.kind == "mask" else None
        if found is None or found.rest is None:
            return None if found is None else (found, None)
        scalars = {a.name: (a.source, a.from_tensor) for a in self.scalars}
        buffers = {t.name: (t.source, None) for t in self.tensors}
        return found, make_traced("mask", found.rest, scalars, buffers, self.static, f"{self.description} less its diagonal")

    @functools.cached_property
    def arguments_read(self) -> frozenset:
        """The names of the mod's own arguments its DAG reads (``b``, ``h``, ``q_idx``, ...)."""
        return frozenset(n.name for n in postorder(self.expr) if isinstance(n, Arg))

    def to_cpp(self, name: "str | None" = None) -> str:
        """Helpers, ``struct <name>_args`` and the ``__host__ __device__`` function ``name``
        (default ``score_mod`` / ``mask_mod``)."""
        return render(self.kind, name or f"{self.kind}_mod", self.expr, self.scalars, self.tensors)

    def evaluate(self, *inputs, args) -> np.ndarray:
        """The mod in numpy as the kernel computes it: ``evaluate(score, b, h, q_idx, kv_idx, args=...)``
        (a mask mod without ``score``); ``args`` a ModArgs or its :meth:`ModArgs.values` dict."""
        params = ("score", "b", "h", "q_idx", "kv_idx")[self.kind == "mask":]
        if len(inputs) != len(params):
            raise TypeError(f"{self.kind}_mod takes {len(params)} inputs ({', '.join(params)}), got {len(inputs)}")
        values = args.values() if isinstance(args, ModArgs) else args
        return evaluate(self.expr, dict(zip(params, inputs)), values)

    def check_static(self, fn) -> None:
        """Raise StaleTrace where a value of ``fn`` compiled in as a literal (:attr:`static`) changed: the trace's
        structure, its literals included, then no longer holds."""
        for source, value in self.static:
            now = source.read(fn)
            if type(now) is not type(value) or now != value:
                raise StaleTrace(f"'{source.name}' is compiled in as {value!r}, now {now!r}")

    def bind(self, fn) -> ModArgs:
        """The captured values of ``fn`` now; raises StaleTrace if they no longer fit the trace."""
        self.check_static(fn)
        scalars = tuple(_scalar_value(a, a.source.read(fn)) for a in self.scalars)
        tensors = tuple(_tensor_value(a, a.source.read(fn)) for a in self.tensors)
        return ModArgs(scalars, tensors, tuple(a.name for a in self.scalars + self.tensors))


def _scalar_value(arg: ScalarArg, value):
    import torch

    if arg.from_tensor:
        if not (isinstance(value, torch.Tensor) and value.dim() == 0):
            raise StaleTrace(f"'{arg.source.name}' is no longer a 0-d tensor")
        value = value.item()
    elif not is_number(value) or isinstance(value, int) != (arg.dtype == INT):
        raise StaleTrace(f"'{arg.source.name}' changed kind: {value!r} for a {arg.dtype} argument")
    if arg.dtype == INT:
        if isinstance(value, float) or not INT32_MIN <= value <= INT32_MAX:
            raise StaleTrace(f"'{arg.source.name}' = {value!r} is no int32")
        return int(value)
    return float(value) if arg.dtype == FLOAT else bool(value)


def _tensor_value(arg: TensorArg, value):
    import torch

    from .torch_table import kernel_dtype

    if not isinstance(value, torch.Tensor) or value.dim() != arg.rank or kernel_dtype(value.dtype, arg.source.name) != arg.dtype:
        raise StaleTrace(f"'{arg.source.name}' is no longer a {arg.rank}-D {arg.dtype} tensor")
    def check(t) -> None:  # once per copy (it synchronizes with the device)
        if t.dtype == torch.int64 and t.numel() and (t.min() < INT32_MIN or t.max() > INT32_MAX):
            raise ModError(f"captured tensor '{arg.source.name}' holds values outside int32, the kernel's integers")

    if value.requires_grad and torch.is_grad_enabled():
        raise ModError(f"captured tensor '{arg.source.name}' requires grad: gradients do not flow into tensors a "
                       "score_mod / mask_mod captures; pass it detached (.detach()) or call under torch.no_grad()")
    return stable_copy(value, getattr(torch, _TORCH_OF[arg.dtype]), check=check)
