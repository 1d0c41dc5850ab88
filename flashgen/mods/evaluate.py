"""A traced mod's DAG evaluated in numpy, in the kernel's dtypes (fp32, int32, bool).

The simulator's side of the rule whose C++ side is cpp.py: the same nodes, the same explicit casts,
one operation at a time with the semantics of ops.py. Arguments broadcast as numpy arrays do
(FlexAttention's index tensors ``b (B,1,1,1)``, ``h (1,H,1,1)``, ... work unchanged).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from .expr import Arg, Binary, Cast, Const, Load, Scalar, Unary, Where, postorder
from .ops import NP_DTYPE, binary_np, cast_np, unary_np


def _node(node, env: dict, inputs: Mapping, values: Mapping) -> np.ndarray:
    if isinstance(node, Arg):
        return np.asarray(inputs[node.name], dtype=NP_DTYPE[node.dtype])
    if isinstance(node, Const):
        return np.asarray(node.value, dtype=NP_DTYPE[node.dtype])
    if isinstance(node, Scalar):
        return np.asarray(values[node.name], dtype=NP_DTYPE[node.dtype])
    if isinstance(node, Load):
        table = np.asarray(values[node.buffer.name], dtype=NP_DTYPE[node.dtype])
        return table[tuple(env[i] for i in node.index)]
    ops = [env[o] for o in node.operands]
    if isinstance(node, Cast):
        out = cast_np(node.dtype, ops[0])
    elif isinstance(node, Unary):
        out = unary_np(node.op, ops[0])
    elif isinstance(node, Binary):
        out = binary_np(node.op, *ops)
    elif isinstance(node, Where):
        out = np.where(*ops)
    else:
        raise TypeError(f"not an expression node: {node!r}")
    return np.asarray(out, dtype=NP_DTYPE[node.dtype])


def evaluate(root, inputs: Mapping, values: Mapping) -> np.ndarray:
    """``root`` over ``inputs`` (the mod's arguments by name) and ``values`` (canonical scalar and
    tensor names -> numbers / arrays in the kernel's dtypes). Indices must lie inside each tensor
    (as in the kernel, which does not check them; a negative index is not wrapped there)."""
    env = {}
    with np.errstate(all="ignore"):  # overflow, 0/0, log(0) produce the values the kernel produces
        for node in postorder(root):
            env[node] = _node(node, env, inputs, values)
    return env[root]
