"""The stand-in a mod receives for each tensor argument while it is traced.

A :class:`Proxy` wraps an expression node. Python operators build nodes directly; torch functions
reach :meth:`Proxy.__torch_function__` (PyTorch's protocol for tensor-like objects, which also
routes ``captured_tensor[proxy]`` and ``captured_tensor + proxy`` here) and method calls
(``score.exp()``, ``q_idx.float()``) reach ``__getattr__``; both go through torch_table.py's one
table of supported functions. Turning a proxy into a Python bool or number (``if score > 0``,
``and``/``or``/``not``, builtin ``min``/``max``, ``float(x)``, ``math.tanh(x)``) is data-dependent
control flow and raises through the tracer.
"""
from __future__ import annotations

from . import torch_table
from .expr import binary, unary

_BINARY = {"add": "add", "sub": "sub", "mul": "mul", "truediv": "truediv", "floordiv": "floordiv",
           "mod": "mod", "and": "and", "or": "or", "xor": "xor"}
_COMPARE = ("lt", "le", "gt", "ge", "eq", "ne")


class Proxy:
    __slots__ = ("expr", "tracer")
    __hash__ = None  # == builds an expression, so a proxy is no dict key

    def __init__(self, expr, tracer):
        self.expr = expr
        self.tracer = tracer

    def __repr__(self) -> str:
        return f"Proxy({self.expr.dtype})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        tracer = next(a.tracer for a in _flat(args, kwargs) if isinstance(a, Proxy))
        return tracer.wrap(torch_table.call(tracer, func, args, kwargs or {}))

    @property
    def dtype(self):
        """The torch dtype of this value in the kernel (for ``torch.tensor(x, dtype=score.dtype)``)."""
        return torch_table.TORCH_DTYPE[self.expr.dtype]

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "device":  # a constant's device (FlexAttention's noop_mask: new_ones(..., device=b.device))
            return None
        if name in ("shape", "ndim", "size", "numel", "dim", "data", "item", "tolist"):
            self.tracer.fail(f"uses Tensor.{name}: the mod sees one score and one index at a time, "
                             "with no shape or storage")
        return lambda *args, **kwargs: self.tracer.wrap(torch_table.call_method(self.tracer, name, self, args, kwargs))

    def _binary(self, op: str, other, reverse: bool = False):
        a, b = self.expr, self.tracer.lift(other)
        return self.tracer.wrap(self.tracer.checked(binary, op, *((b, a) if reverse else (a, b))))

    def _unary(self, op: str):
        return self.tracer.wrap(self.tracer.checked(unary, op, self.expr))

    def __neg__(self):
        return self._unary("neg")

    def __pos__(self):
        return self

    def __abs__(self):
        return self._unary("abs")

    def __invert__(self):
        return self._unary("not")

    def __bool__(self):
        return self.tracer.to_python(self.expr, "bool()", bool)

    def __float__(self):
        return self.tracer.to_python(self.expr, "float()", float)

    def __int__(self):
        return self.tracer.to_python(self.expr, "int()", int)

    def __index__(self):
        return self.tracer.to_python(self.expr, "an index (range(), list indexing)", int)

    def __len__(self):
        self.tracer.fail("len() of a traced value (its shape is not known while tracing)")

    def __iter__(self):
        self.tracer.fail("iteration over a traced value")

    def __getitem__(self, index):
        self.tracer.fail("indexing a mod argument (index captured tensors with the arguments instead)")

    def __pow__(self, other):
        if isinstance(other, Proxy):
            self.tracer.fail("x ** y of a traced exponent (exp(y * log(x)) compiles)")
        return self.tracer.wrap(self.tracer.checked(torch_table.power, self.expr, other))

    def __rpow__(self, other):
        self.tracer.fail("a ** x of a traced exponent (exp(x * log(a)) compiles)")


def _flat(args, kwargs):
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, (tuple, list)):
            yield from a
        else:
            yield a


def _define(op: str, name: str) -> None:
    setattr(Proxy, f"__{name}__", lambda self, other: self._binary(op, other))
    setattr(Proxy, f"__r{name}__", lambda self, other: self._binary(op, other, reverse=True))


for _name, _op in _BINARY.items():
    _define(_op, _name)
for _op in _COMPARE:
    setattr(Proxy, f"__{_op}__", (lambda op: lambda self, other: self._binary(op, other))(_op))
