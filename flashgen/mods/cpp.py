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
from .ranges import INDICES, reads_indices, split_casts

CPP_TYPE = {BOOL: "bool", INT: "int", FLOAT: "float"}
SCORE_ARGS = ("score", "b", "h", "q_idx", "kv_idx")
SPLIT_ARGS = ("q_base", "q_off", "kv_base", "kv_off")
MASK_ARGS = ("b", "h", "q_idx", "kv_idx")
BIAS_ARGS = ("inv_scale",) + MASK_ARGS  # flashgen.mods.bias: a score_mod's bias over the scale
_PARAMS = {"score": SCORE_ARGS, "mask": MASK_ARGS, "bias": BIAS_ARGS}
_FLOAT_ARGS = ("score", "score_scale", "inv_scale")


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


def tile_values(root) -> tuple:
    """The nodes of ``root`` a kernel evaluates once per tile (batch and head fixed, so is every value free of the
    score and the indices): those reading a captured tensor that a node reading the score or an index uses, or the
    result itself. Left in the per-block code such a load waits on memory every key block, before the S GEMM can
    start: the kernels' barriers (memory clobbers) keep the compiler from hoisting it."""
    reads, out = reads_indices(root), []
    varies, loads = {}, {}
    for n in postorder(root):
        varies[n] = reads[n] or (isinstance(n, Arg) and n.name == "score") or any(varies[o] for o in n.operands)
        loads[n] = isinstance(n, Load) or any(loads[o] for o in n.operands)
        users = [o for o in n.operands if not varies[o] and loads[o] and o not in out] if varies[n] else []
        out += dict.fromkeys(users)
    return tuple(out) + ((root,) if not varies[root] and loads[root] and root not in out else ())


def _bind(node, text: str, var: str, names: dict, lines: list) -> None:
    """``node``'s name for its users: a leaf's own text, else the ``const`` temporary ``var`` holding it."""
    if isinstance(node, (Arg, Const, Scalar)):
        names[node] = text
    else:
        names[node] = var
        lines.append(f"const {CPP_TYPE[node.dtype]} {var} = {text};")


def _tile_cpp(name: str, tile: tuple, args: str, head: tuple) -> str:
    """The struct of ``tile``'s values (:func:`tile_values`) and ``<name>_tile_of`` computing them."""
    fields = "".join(f" {CPP_TYPE[n.dtype]} f{k};" for k, n in enumerate(tile)) or " int unused;"
    names, lines = {}, [" ".join(f"(void){p};" for p in head + ("a",))]
    for root in tile:
        for n in postorder(root):
            if n in names:
                continue
            _bind(n, _expr(n, names), f"v{len(names)}", names, lines)
    lines.append(f"return {name}_tile{{{', '.join(names[n] for n in tile) or '0'}}};")
    body = "".join(f"\n    {line}" for line in lines)
    return (f"struct {name}_tile {{{fields} }};  // {name}'s values per tile (its batch and head)\n"
            f"__host__ __device__ __forceinline__ {name}_tile {name}_tile_of({_signature(head)}, const {args}& a) {{{body}\n}}")


def function_cpp(kind: str, name: str, root, args: "str | None" = None, per_tile: bool = False) -> str:
    """The function ``name`` computing ``root`` (kind "score": float result, "mask": bool, "bias": a score_mod's
    bias over the scale, :mod:`flashgen.mods.bias`, float of ``inv_scale`` and the indices); its values in
    struct ``args`` (default ``<name>_args``). Rendered as ``<name>_at``, whose indices come as a base and an
    offset (``q_idx = q_base + q_off``: kernels pass a fragment's compile-time offsets apart, so conversions
    of index arithmetic split, :mod:`flashgen.mods.ranges`) and a score_mod's score as the raw score and the
    scale it sees it at (``score * score_scale``: folded into the score's one factor where it has one), and
    ``<name>`` with plain indices and the score as it is over it. ``per_tile``: the values :func:`tile_values`
    names come from ``<name>_tile_of`` (once per tile), which ``<name>_at`` takes first (``<name>`` calls it)."""
    args = args or f"{name}_args"
    params = _PARAMS[kind]
    head = {"score": ("score", "score_scale"), "mask": (), "bias": ("inv_scale",)}[kind] + params[-4:-2] + SPLIT_ARGS
    result = "bool" if kind == "mask" else "float"
    split, reads, based = split_casts(root), reads_indices(root), {}
    fused, scaled = _fused_products(root, split, reads), _scaled_use(root, reads)
    names, lines = {}, [" ".join(f"(void){p};" for p in head + ("a",)),
                        "const int q_idx = q_base + q_off, kv_idx = kv_base + kv_off;", "(void)q_idx; (void)kv_idx;"]
    tile = tile_values(root) if per_tile else ()
    live, nodes = _live(root, split, fused, reads, set(tile)), postorder(root)
    order = {n: i for i, n in enumerate(nodes)}
    for i, node in enumerate(nodes):
        if node not in live:
            continue
        if node in tile:
            names[node] = f"t.f{tile.index(node)}"
            continue
        if isinstance(node, Arg) and node.name == "score":
            names[node] = "score"
            if scaled is None:  # the score_mod sees the scaled score
                names[node] = "score_s"
                lines.append("const float score_s = score * score_scale;")
            continue
        if scaled is not None and node is scaled[0]:  # the scale folded into the score's one factor or divisor
            text = f"fg_scaled_{'div' if node.op == 'truediv' else 'mul'}(score, score_scale, {names[scaled[1]]})"
        elif node in split or node in fused:
            u, cast = fused.get(node, (None, node))
            _at_bases(cast.x, names, order, reads, based, lines)
            base, off = f"(float)({based[cast.x]})", "(float)({} * q_off + {} * kv_off)".format(*split[cast])
            text = f"{base} + {off}" if u is None else f"fg_mul_split({names[u]}, {base}, {off})"
        else:
            text = _expr(node, names)
        _bind(node, text, f"v{i}", names, lines)
    lines.append(f"return {names[root]};")
    body = "".join(f"\n    {line}" for line in lines)
    first = f"const {name}_tile& t, " if per_tile else ""
    at = f"__host__ __device__ __forceinline__ {result} {name}_at({first}{_signature(head)}, const {args}& a) {{{body}\n}}"
    call = ", ".join(params[:-4] + (("1.f",) if kind == "score" else ()) + params[-4:-2] + ("q_idx", "0", "kv_idx", "0", "a"))
    tile_head = tuple(p for p in head[:-4] if p not in ("score", "score_scale"))  # what a tile's values may read
    if per_tile:
        call = f"{name}_tile_of({', '.join(tile_head + ('a',))}), {call}"
    plain = (f"__host__ __device__ __forceinline__ {result} {name}({_signature(params)}, const {args}& a) "
             f"{{ return {name}_at({call}); }}")
    return (_tile_cpp(name, tile, args, tile_head) + "\n" if per_tile else "") + at + "\n" + plain


def _signature(params: tuple) -> str:
    return ", ".join((f"float {p}" if p in _FLOAT_ARGS else f"int {p}") for p in params)


def _scaled_use(root, reads: dict) -> "tuple | None":
    """(the one node using the score, its other operand ``u``) where that node is ``score * u``, ``u * score`` or
    ``score / u`` with ``u`` free of the score and the indices (softcap's ``score / cap``): the kernels' scale
    folds into ``u``, one multiply per score fewer. None where the score has another use, or none."""
    users = [n for n in postorder(root) for o in n.operands if isinstance(o, Arg) and o.name == "score"]
    if len(users) != 1 or not isinstance(users[0], Binary) or users[0].dtype != FLOAT:
        return None
    n = users[0]
    score_first = isinstance(n.a, Arg) and n.a.name == "score"
    other = n.b if score_first else n.a
    if n.op not in ("mul", "truediv") or (n.op == "truediv" and not score_first) or reads[other]:
        return None
    if any(isinstance(o, Arg) and o.name == "score" for o in postorder(other)):
        return None
    return n, other


def _fused_products(root, split: dict, reads: dict) -> dict:
    """fp32 products of a split cast and a value free of the indices (ALiBi's slope times q_idx - kv_idx):
    product -> (that value, the cast), rendered as ``fg_mul_split`` (one multiply-add per score on the device)."""
    out = {}
    for n in postorder(root):
        if isinstance(n, Binary) and n.op == "mul" and n.dtype == FLOAT:
            for cast, u in ((n.a, n.b), (n.b, n.a)):
                if cast in split and not reads[u]:
                    out[n] = (u, cast)
                    break
    return out


def _live(root, split: dict, fused: dict, reads: dict, given: set = frozenset()) -> set:
    """The nodes ``root`` needs at the plain indices: a split cast's operand is needed at the bases, where
    only the nodes not reading the indices keep their plain values; a fused product needs its value and its
    cast's operand at the bases, not the cast; a ``given`` node (a value per tile) needs nothing more."""
    live, stack, at_bases = set(), [root], []
    while stack or at_bases:
        if at_bases:
            n = at_bases.pop()
            if reads[n]:
                at_bases.extend(n.operands)
            else:
                stack.append(n)
            continue
        n = stack.pop()
        if n in live:
            continue
        live.add(n)
        if n in given:
            continue
        if n in fused:
            stack.append(fused[n][0])
            at_bases.append(fused[n][1].x)
            continue
        for o in n.operands:
            (at_bases if n in split else stack).append(o)
    return live


def _at_bases(x, names: dict, order: dict, reads: dict, based: dict, lines: list) -> None:
    """Lines computing ``x`` with q_idx and kv_idx at their bases, into ``based`` (node -> its name there:
    ``q_base`` / ``kv_base`` for the indices, ``v<i>_b`` for the nodes reading them, each rendered once)."""
    for n in postorder(x):
        if not reads[n] or n in based:
            continue
        if isinstance(n, Arg):
            based[n] = n.name.replace("_idx", "_base")
            continue
        based[n] = f"v{order[n]}_b"
        lines.append(f"const int {based[n]} = {_expr(n, {o: based[o] if o in based else names[o] for o in n.operands})};")


def render(kind: str, name: str, root, scalars: tuple, buffers: tuple) -> str:
    """Helpers (once per translation unit), the struct and the function."""
    return "\n".join((HELPERS, struct_cpp(name, scalars, buffers), function_cpp(kind, name, root))) + "\n"
