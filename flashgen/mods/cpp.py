"""A traced mod's DAG as one ``__host__ __device__`` C++ function and its argument struct.

::

    struct <name>_args { float s0; const float* t0; int t0_s0; ... };   // scalars, tensors + strides
    __host__ __device__ __forceinline__ float score_mod(float score, int b, int h, int q_idx, int kv_idx,
                                                        const score_mod_args& a);
    __host__ __device__ __forceinline__ bool mask_mod(int b, int h, int q_idx, int kv_idx, const mask_mod_args& a);

The text depends only on the canonical DAG (canonical names ``s<i>``/``t<i>``, no user names), so
two mods of one structure render the same function. Every node used by another becomes one
``const`` temporary in operand order; leaves (arguments, literals, struct fields) are inlined.
Tensor ``t<i>`` element ``[i0, i1]`` is ``a.t<i>[i0 * a.t<i>_s0 + i1 * a.t<i>_s1]`` (strides in elements).
"""
from __future__ import annotations

import math

from .expr import BOOL, FLOAT, INT, INT32_MIN, Arg, Binary, Buffer, Cast, Const, Load, Scalar, Unary, Where, postorder
from .ops import HELPERS, binary_cpp, cast_cpp, unary_cpp

CPP_TYPE = {BOOL: "bool", INT: "int", FLOAT: "float"}
SCORE_ARGS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_ARGS = ("b", "h", "q_idx", "kv_idx")


def literal(c: Const) -> str:
    """An exact C++ literal: fp32 as a hex float (``0x1.8p+1f``), infinities and NaN by macro."""
    if c.dtype == BOOL:
        return "true" if c.value else "false"
    if c.dtype == INT:
        return "(-2147483647 - 1)" if c.value == INT32_MIN else str(c.value)
    v = c.value
    if math.isnan(v):
        return "NAN"
    if math.isinf(v):
        return "INFINITY" if v > 0 else "(-INFINITY)"
    return f"{v.hex()}f" if math.copysign(1.0, v) > 0 else f"(-{(-v).hex()}f)"


def struct_cpp(name: str, scalars: tuple, buffers: tuple) -> str:
    """The argument struct: each scalar a field, each tensor a pointer and its strides."""
    fields = [f"{CPP_TYPE[s.dtype]} {s.name};" for s in scalars]
    for t in buffers:
        fields.append(f"const {CPP_TYPE[t.dtype]}* {t.name};")
        fields.extend(f"int {t.name}_s{d};" for d in range(t.rank))
    body = "".join(f"\n    {f}" for f in fields) or "\n    int unused;  // a mod without captured values"
    return f"struct {name}_args {{{body}\n}};"


def _load(node: Load, names: dict) -> str:
    t = node.buffer
    offset = " + ".join(f"{names[i]} * a.{t.name}_s{d}" for d, i in enumerate(node.index))
    return f"a.{t.name}[{offset}]"


def _expr(node, names: dict) -> str:
    if isinstance(node, Arg):
        return node.name
    if isinstance(node, Const):
        return literal(node)
    if isinstance(node, Scalar):
        return f"a.{node.name}"
    if isinstance(node, Load):
        return _load(node, names)
    if isinstance(node, Cast):
        return cast_cpp(node.dtype, node.x.dtype, names[node.x])
    if isinstance(node, Unary):
        return unary_cpp(node.op, node.dtype, names[node.x])
    if isinstance(node, Binary):
        return binary_cpp(node.op, node.a.dtype, names[node.a], names[node.b])
    if isinstance(node, Where):
        return f"({names[node.cond]} ? {names[node.a]} : {names[node.b]})"
    raise TypeError(f"not an expression node: {node!r}")


def function_cpp(kind: str, name: str, root, args: "str | None" = None) -> str:
    """The function ``name`` computing ``root`` (kind "score": float result, "mask": bool); its values in
    struct ``args`` (default ``<name>_args``)."""
    args = args or f"{name}_args"
    params = SCORE_ARGS if kind == "score" else MASK_ARGS
    sig = ", ".join(("float score" if p == "score" else f"int {p}") for p in params)
    result = "float" if kind == "score" else "bool"
    names, lines = {}, [" ".join(f"(void){p};" for p in params + ("a",))]
    for i, node in enumerate(postorder(root)):
        text = _expr(node, names)
        if isinstance(node, (Arg, Const, Scalar)):
            names[node] = text
        else:
            names[node] = f"v{i}"
            lines.append(f"const {CPP_TYPE[node.dtype]} v{i} = {text};")
    lines.append(f"return {names[root]};")
    body = "".join(f"\n    {line}" for line in lines)
    return (f"__host__ __device__ __forceinline__ {result} {name}({sig}, const {args}& a) {{{body}\n}}")


def render(kind: str, name: str, root, scalars: tuple, buffers: tuple) -> str:
    """Helpers (once per translation unit), the struct and the function."""
    return "\n".join((HELPERS, struct_cpp(name, scalars, buffers), function_cpp(kind, name, root))) + "\n"
