"""CuTe-style layouts: a ``shape:stride`` pair is a function from coordinates to offsets.

Conventions (those of CuTe, ``include/cute/layout.hpp``):

* A *shape* is a positive int or a (nested) tuple of shapes; a *stride* is a
  non-negative int or a tuple congruent to the shape (same nesting).
* A 1-D coordinate ``i`` indexes the whole layout colexicographically: the first
  mode varies fastest. ``Layout((4,2),(2,1))(i) == (i % 4)*2 + (i // 4)*1``.
* An int coordinate given for a nested mode is decomposed colexicographically by that
  mode's sub-shapes. The last (innermost) sub-mode takes the remaining quotient
  without a modulo, so a 1-D index ``>= size`` extends the last mode. Composition
  relies on this: ``A.composition(B)(i) == A(B(i))`` even where ``B(i) >= A.size``.
* Negative strides are not supported (the algebra here assumes offsets >= 0).

The module imports neither torch nor numba. ``Layout.offsets`` evaluates every coordinate
at once with numpy (imported on first use), running the very function ``__call__`` runs on
one int (``_colex_eval``) on an array, so a table and a single evaluation cannot disagree.
"""

from __future__ import annotations

import functools
import math
import numbers
import re
from collections.abc import Callable, Sequence
from typing import Union

import attrs

IntTuple = Union[int, tuple["IntTuple", ...]]
"""An int or a nested tuple of ints (a shape, a stride or a coordinate)."""

CppCoord = Union[str, int, Sequence["CppCoord"]]
"""A C++ coordinate expression, or a nested sequence of them congruent to a mode."""

Tiler = Union["Layout", int, None, Sequence[Union["Layout", int, None]]]
"""A layout, an int ``n`` (meaning ``n:1``), or a tuple of those/None for by-mode use."""

_Mode = tuple[int, int]  # one flat (shape, stride) leaf


# --------------------------------------------------------------------------- int tuples


def is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _to_int_tuple(x: object, what: str, root: object | None = None) -> IntTuple:
    """Convert ints/lists/tuples (nested) into ints/tuples; ValueError on anything else."""
    root = x if root is None else root
    if is_int(x):
        return int(x)  # type: ignore[arg-type]
    if isinstance(x, (tuple, list)):
        if len(x) == 0:
            raise ValueError(f"Layout {what} must not contain an empty tuple; got {root!r}")
        return tuple(_to_int_tuple(e, what, root) for e in x)
    raise ValueError(f"Layout {what} must be an int or a nested tuple of ints; got {root!r}")


def _shape_conv(x: object) -> IntTuple:
    return _to_int_tuple(x, "shape")


def _stride_conv(x: object) -> IntTuple:
    return _to_int_tuple(x, "stride")


def flatten(t: IntTuple) -> tuple[int, ...]:
    """Leaves of an int tuple, left to right."""
    if isinstance(t, int):
        return (t,)
    return tuple(leaf for e in t for leaf in flatten(e))


def product(t: IntTuple) -> int:
    """Product of all leaves (the size of a shape)."""
    return math.prod(flatten(t))


def congruent(a: IntTuple, b: IntTuple) -> bool:
    """True when ``a`` and ``b`` have the same nesting structure."""
    if isinstance(a, int) or isinstance(b, int):
        return isinstance(a, int) and isinstance(b, int)
    return len(a) == len(b) and all(congruent(x, y) for x, y in zip(a, b))


def _depth(t: IntTuple) -> int:
    if isinstance(t, int):
        return 0
    return 1 + max(_depth(e) for e in t)


def _unflatten(leaves: Sequence[IntTuple], profile: IntTuple) -> IntTuple:
    """Rebuild ``leaves`` with the nesting of ``profile`` (same number of leaves)."""
    it = iter(leaves)

    def build(p: IntTuple) -> IntTuple:
        if isinstance(p, int):
            return next(it)
        return tuple(build(e) for e in p)

    return build(profile)


def int_tuple_str(t: IntTuple) -> str:
    """CuTe text of an int tuple: ``8``, ``(64,128)``, ``((8,8),2)``."""
    if isinstance(t, int):
        return str(t)
    return "(" + ",".join(int_tuple_str(e) for e in t) + ")"


# ------------------------------------------------------------------------------ C++ text

_ATOM_RE = re.compile(r"[A-Za-z_][A-Za-z_0-9]*(\.[A-Za-z_][A-Za-z_0-9]*)*|[0-9]+")


def _is_wrapped(expr: str) -> bool:
    """True when ``expr`` is ``( ... )`` with the first paren closing at the end."""
    if not (expr.startswith("(") and expr.endswith(")")):
        return False
    depth = 0
    for k, ch in enumerate(expr):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return k == len(expr) - 1
    return False


def cpp_parenthesize(expr: str) -> str:
    """``expr`` made safe as an operand of any C++ binary operator.

    Identifiers (``tid``, ``threadIdx.x``), decimal literals and fully parenthesized
    text are returned unchanged; anything else is wrapped in parentheses.
    """
    expr = expr.strip()
    if _ATOM_RE.fullmatch(expr) or _is_wrapped(expr):
        return expr
    return f"({expr})"


def _cpp_coord_text(x: object) -> str:
    if is_int(x):
        if x < 0:  # type: ignore[operator]
            raise ValueError(f"to_cpp: integer coordinate must be >= 0; got {x}")
        return str(int(x))  # type: ignore[call-overload]
    if isinstance(x, str):
        if not x.strip():
            raise ValueError("to_cpp: empty coordinate expression")
        return x.strip()
    raise ValueError(f"to_cpp: a coordinate expression must be a str or int; got {x!r}")


# ------------------------------------------------------------------------------- layout


def _colex_eval(c, shape: IntTuple, stride: IntTuple):
    """Offset of int coordinate ``c`` in a (possibly nested) mode; last leaf extends.

    ``c`` is an int or a numpy int64 array of coordinates (``%``, ``//`` on non-negative
    int64 equal Python's), giving an int or an array of offsets.
    """
    shapes, strides = flatten(shape), flatten(stride)
    off = 0
    for s, d in zip(shapes[:-1], strides[:-1]):
        off = off + (c % s) * d
        c = c // s  # not in place: an array argument stays the caller's
    return off + c * strides[-1]


def _coord_eval(coord: object, shape: IntTuple, stride: IntTuple, root: object) -> int:
    """Offset of a tuple coordinate: ints are bounds-checked against their mode."""
    if is_int(coord):
        c = int(coord)  # type: ignore[call-overload]
        if not 0 <= c < product(shape):
            raise IndexError(
                f"coordinate {root!r}: component {c} is out of range for mode "
                f"{int_tuple_str(shape)}"
            )
        return _colex_eval(c, shape, stride)
    if isinstance(coord, (tuple, list)) and isinstance(shape, tuple) and len(coord) == len(shape):
        return sum(
            _coord_eval(c, s, d, root)
            for c, s, d in zip(coord, shape, stride)  # type: ignore[arg-type]
        )
    raise ValueError(
        f"coordinate {root!r} is not congruent to shape {int_tuple_str(shape)} "
        "(give an int, one int per top-level mode, or a tuple congruent to the shape)"
    )


def _from_modes(modes: Sequence[_Mode]) -> "Layout":
    """Flat layout from (shape, stride) leaves; no leaves -> ``1:0``; one -> scalar."""
    if not modes:
        return Layout(1, 0)
    if len(modes) == 1:
        return Layout(modes[0][0], modes[0][1])
    return Layout(tuple(s for s, _ in modes), tuple(d for _, d in modes))


def _merge_modes(modes: Sequence[_Mode], keep_last: bool) -> list[_Mode]:
    """Drop shape-1 leaves and merge neighbours ``(s0,d0),(s1,s0*d0) -> (s0*s1,d0)``.

    With ``keep_last`` the last leaf is never dropped, so the result also agrees with
    the input beyond its size (where the last mode extends); otherwise it agrees on
    ``[0, size)`` (CuTe's ``coalesce``).
    """
    out: list[_Mode] = []
    for k, (s, d) in enumerate(modes):
        if s == 1 and not (keep_last and k == len(modes) - 1):
            continue
        if out and out[-1][1] * out[-1][0] == d:
            out[-1] = (out[-1][0] * s, out[-1][1])
        else:
            out.append((s, d))
    return out


def _as_layout(t: "Layout | int", what: str) -> "Layout":
    if isinstance(t, Layout):
        return t
    if is_int(t):
        return Layout(int(t), 1)  # type: ignore[call-overload]
    raise ValueError(f"{what}: expected a Layout or an int; got {t!r}")


@attrs.frozen
class Layout:
    """A CuTe layout ``shape:stride``: a function from coordinates to int offsets.

    ``shape`` is a positive int or nested tuple; ``stride`` is congruent to it with
    non-negative ints. Lists are converted to tuples. Equality and hashing compare
    ``shape`` and ``stride`` exactly (``8:1`` differs from ``(8):(1)``).
    """

    shape: IntTuple = attrs.field(converter=_shape_conv)
    stride: IntTuple = attrs.field(converter=_stride_conv)

    def __attrs_post_init__(self) -> None:
        if not congruent(self.shape, self.stride):
            raise ValueError(
                f"Layout shape {int_tuple_str(self.shape)} and stride "
                f"{int_tuple_str(self.stride)} are not congruent (same nesting required)"
            )
        if any(s < 1 for s in flatten(self.shape)):
            raise ValueError(
                f"Layout shape entries must be >= 1; got shape {int_tuple_str(self.shape)}"
            )
        if any(d < 0 for d in flatten(self.stride)):
            raise ValueError(
                f"Layout stride entries must be >= 0; got stride {int_tuple_str(self.stride)}"
            )

    # ---------------------------------------------------------------- constructors

    @classmethod
    def col_major(cls, shape: IntTuple | Sequence[int]) -> "Layout":
        """Compact layout with the first mode fastest (CuTe's default, LayoutLeft)."""
        shape_t = _shape_conv(shape)
        strides, acc = [], 1
        for s in flatten(shape_t):
            strides.append(acc)
            acc *= s
        return cls(shape_t, _unflatten(strides, shape_t))

    @classmethod
    def row_major(cls, shape: IntTuple | Sequence[int]) -> "Layout":
        """Compact layout with the last mode fastest (C order, LayoutRight)."""
        shape_t = _shape_conv(shape)
        strides, acc = [], 1
        for s in reversed(flatten(shape_t)):
            strides.append(acc)
            acc *= s
        return cls(shape_t, _unflatten(strides[::-1], shape_t))

    # ------------------------------------------------------------------ properties

    @property
    def size(self) -> int:
        """Number of coordinates (product of the shape)."""
        return product(self.shape)

    @property
    def cosize(self) -> int:
        """Largest offset + 1, i.e. ``self(size - 1) + 1`` for non-negative strides."""
        return sum((s - 1) * d for s, d in zip(flatten(self.shape), flatten(self.stride))) + 1

    @property
    def rank(self) -> int:
        """Number of top-level modes (1 for an int shape)."""
        return 1 if isinstance(self.shape, int) else len(self.shape)

    @property
    def depth(self) -> int:
        """Nesting depth: 0 for an int shape, 1 for a flat tuple, ..."""
        return _depth(self.shape)

    def modes(self) -> tuple["Layout", ...]:
        """The top-level modes as layouts."""
        return tuple(self[i] for i in range(self.rank))

    def __getitem__(self, i: int) -> "Layout":
        """Sub-layout of top-level mode ``i`` (``self[0]`` of an int-shape layout is itself)."""
        if isinstance(self.shape, int):
            if i in (0, -1):
                return self
            raise IndexError(f"mode {i} out of range for rank-1 layout {self}")
        assert isinstance(self.stride, tuple)
        if not -self.rank <= i < self.rank:
            raise IndexError(f"mode {i} out of range for rank-{self.rank} layout {self}")
        return Layout(self.shape[i], self.stride[i])

    # ------------------------------------------------------------------ evaluation

    def __call__(self, coord: object) -> int:
        """Offset of ``coord``.

        ``coord`` is an int (1-D colexicographic index over the whole layout; must be
        >= 0, values >= size extend the last mode as in CuTe), a tuple with one int
        per top-level mode (each decomposed colexicographically within its mode), or
        a nested tuple congruent to the shape. Tuple components are bounds-checked.
        """
        if is_int(coord):
            c = int(coord)  # type: ignore[call-overload]
            if c < 0:
                raise IndexError(f"1-D coordinate must be >= 0; got {c} for layout {self}")
            return _colex_eval(c, self.shape, self.stride)
        if isinstance(self.shape, int) and isinstance(coord, (tuple, list)) and len(coord) == 1:
            return _coord_eval(coord[0], self.shape, self.stride, coord)
        return _coord_eval(coord, self.shape, self.stride, coord)

    def offsets(self):
        """``out[i] == self(i)`` for every 1-D coordinate ``i < size``: a read-only int64 numpy array.

        Memoized per layout (layouts are values), so repeated tables of one plan cost nothing.
        """
        return _offsets(self)

    def offsets_at(self, *coords):
        """Offsets of in-range coordinate arrays, one per top-level mode (broadcast together).

        ``offsets_at(rows, cols)[k] == self((rows[k], cols[k]))``: the 1-D index of a coordinate
        is its colexicographic position over the top-level modes, looked up in :meth:`offsets`.
        IndexError when a component is outside its mode (as ``__call__``).
        """
        return table_at(self, self.offsets(), coords)

    def flat_modes(self) -> tuple[_Mode, ...]:
        """The (shape, stride) leaves, left to right."""
        return tuple(zip(flatten(self.shape), flatten(self.stride)))

    # --------------------------------------------------------------------- algebra

    def flatten(self) -> "Layout":
        """Same function with the nesting removed: a flat tuple (an int shape stays scalar)."""
        if isinstance(self.shape, int):
            return self
        return Layout(flatten(self.shape), flatten(self.stride))

    def coalesce(self) -> "Layout":
        """Equivalent layout on ``[0, size)`` with the fewest flat modes.

        Shape-1 modes are dropped and neighbours with ``d1 == s0 * d0`` merged
        (CuTe's ``coalesce``). The result is flat: a scalar ``s:d`` when one mode
        remains, ``1:0`` when none does.
        """
        return _from_modes(_merge_modes(self.flat_modes(), keep_last=False))

    def composition(self, other: Tiler) -> "Layout":
        """Functional composition ``R = self o other``: ``R(i) == self(other(i))``.

        ``other`` is a Layout (R keeps its hierarchy: one mode of R per top-level mode
        of ``other``), an int ``n`` (= ``n:1``), or a tuple of Layouts/ints/None
        applied mode by mode (None keeps the mode; modes beyond the tuple are kept).

        For each flat mode ``s:d`` of ``other`` the flat modes ``(s_k, d_k)`` of
        ``self`` are consumed in order; the *stride divisibility condition* requires
        the running stride ``r`` and ``s_k`` to divide one another, and the *shape
        divisibility condition* requires the remaining shape to be a multiple of
        what a mode contributes (unless all remaining elements fall inside one mode).
        The flat modes of ``other`` are composed separately, which is exact only when
        their images add without carrying between modes of ``self`` (the *by-mode
        distributivity condition*, checked here; CuTe assumes it). ValueError names
        the failing condition and values.
        """
        if other is None:
            return self
        if isinstance(other, (tuple, list)):
            if len(other) > self.rank:
                raise ValueError(
                    f"by-mode composition: {len(other)} tilers for rank-{self.rank} layout {self}"
                )
            parts = [
                self[i] if t is None else self[i].composition(_as_layout(t, "composition"))
                for i, t in enumerate(other)
            ]
            parts += [self[i] for i in range(len(other), self.rank)]
            return make_layout(*parts)
        return _compose(self, _as_layout(other, "composition"))

    def complement(self, cotarget: int | None = None) -> "Layout":
        """The layout of the offsets in ``[0, cotarget)`` that ``self`` does not reach.

        ``self`` must be injective apart from stride-0 modes (which are ignored, as in
        CuTe): sorted by stride, each stride must be a multiple of the extent
        ``shape * stride`` of the previous mode. With ``E = max(shape_k * stride_k)``
        and ``cotarget`` a multiple of ``E``, ``make_layout(self, result)`` is a
        bijection onto ``[0, cotarget)``. Default ``cotarget`` is ``cosize``.
        The result is coalesced and its strides are increasing.
        """
        m = self.cosize if cotarget is None else cotarget
        if not is_int(m) or m < 1:
            raise ValueError(f"complement: cotarget must be an int >= 1; got {cotarget!r}")
        modes = sorted((d, s) for s, d in self.flat_modes() if s > 1 and d > 0)
        out: list[_Mode] = []
        cur = 1
        for d, s in modes:
            if d < cur or d % cur:
                raise ValueError(
                    f"complement: layout {self} is not injective with sortable strides: "
                    f"stride {d} is not a multiple of the extent {cur} of the modes below it"
                )
            out.append((d // cur, cur))
            cur = s * d
        out.append((-(-int(m) // cur), cur))
        return _from_modes(_merge_modes(out, keep_last=False))

    def logical_divide(self, tiler: Tiler) -> "Layout":
        """``self o (tiler, complement(tiler, size))``: mode 0 = the tile, mode 1 = tiles.

        ``tiler`` is a Layout, an int ``n`` (= ``n:1``) or a tuple of those/None
        (applied mode by mode). The result has the same size; when ``size`` is a
        multiple of the tiler's extent it reaches the same offsets as ``self``.
        """
        if isinstance(tiler, (tuple, list)):
            if len(tiler) > self.rank:
                raise ValueError(
                    f"by-mode logical_divide: {len(tiler)} tilers for rank-{self.rank} layout {self}"
                )
            parts = [
                self[i] if t is None else self[i].logical_divide(t)
                for i, t in enumerate(tiler)
            ]
            parts += [self[i] for i in range(len(tiler), self.rank)]
            return make_layout(*parts)
        if tiler is None:
            return self
        t = _as_layout(tiler, "logical_divide")
        return self.composition(make_layout(t, t.complement(self.size)))

    def logical_product(self, other: "Layout | int") -> "Layout":
        """``(self, complement(self, size*cosize(other)) o other)``: ``other`` copies of ``self``.

        Mode 0 is ``self``; mode 1 places the copies at the offsets ``self`` leaves
        free, laid out by ``other``.
        """
        b = _as_layout(other, "logical_product")
        rest = self.complement(self.size * b.cosize).composition(b)
        return make_layout(self, rest)

    def right_inverse(self) -> "Layout":
        """Layout ``R`` with ``self(R(i)) == i`` for all ``i < R.size`` (largest such prefix).

        Built from the modes whose strides chain ``1, s0, s0*s1, ...`` after sorting
        by stride; ``R`` maps an offset back to the 1-D coordinate that produces it.
        """
        flat = self.flat_modes()
        domain_strides, acc = [], 1
        for s, _ in flat:
            domain_strides.append(acc)
            acc *= s
        ranked = sorted((d, s, ds) for (s, d), ds in zip(flat, domain_strides) if s > 1 and d > 0)
        out: list[_Mode] = []
        cur = 1
        for d, s, ds in ranked:
            if d != cur:
                break
            out.append((s, ds))
            cur *= s
        return _from_modes(_merge_modes(out, keep_last=False))

    # ------------------------------------------------------------------------ text

    def to_cpp(self, coord_exprs: CppCoord) -> str:
        """C++ int expression for the offset of the given coordinate expressions.

        ``coord_exprs`` is a list with one C++ expression per top-level mode (an
        entry may itself be a nested list congruent to that mode), or a single
        string: the 1-D index over the whole layout (same as ``self(int)``). An
        expression for a nested mode is decomposed colexicographically with ``/``
        and ``%``; the last sub-mode of size > 1 takes the quotient without ``%``
        and shape-1 sub-modes are dropped. Contract: the value equals ``self(...)``
        for in-range coordinates (each in ``[0, size of its mode)``), where C++
        ``/``, ``%`` on non-negative ints equal Python's ``//``, ``%``.
        Integer-literal coordinates are folded into one constant.
        The result is an identifier/literal or fully parenthesized; it is
        deterministic.
        """
        terms: list[str] = []
        const = [0]
        if isinstance(coord_exprs, (str, int)) and not isinstance(coord_exprs, bool):
            _render_mode(coord_exprs, self.shape, self.stride, terms, const)
        elif isinstance(coord_exprs, (list, tuple)):
            if len(coord_exprs) != self.rank:
                raise ValueError(
                    f"to_cpp: {len(coord_exprs)} coordinate expressions for rank-{self.rank} "
                    f"layout {self}; give one per top-level mode"
                )
            for e, m in zip(coord_exprs, self.modes()):
                _render_mode(e, m.shape, m.stride, terms, const)
        else:
            raise ValueError(f"to_cpp: expected a str or a list of expressions; got {coord_exprs!r}")
        if const[0] or not terms:
            terms.append(str(const[0]))
        text = " + ".join(terms)
        return text if len(terms) == 1 and _ATOM_RE.fullmatch(text) else f"({text})"

    def __str__(self) -> str:
        return f"{int_tuple_str(self.shape)}:{int_tuple_str(self.stride)}"

    def table(self) -> str:
        """Grid of offsets of a rank-2 layout: rows = mode 0, columns = mode 1."""
        if self.rank != 2:
            raise ValueError(f"table() needs a rank-2 layout; {self} has rank {self.rank}")
        return format_table(str(self), self[0].size, self[1].size, lambda r, c: self((r, c)))


@functools.lru_cache(maxsize=1024)
def _offsets(layout: Layout):
    import numpy as np  # on first use: importing the algebra stays free of numpy

    out = _colex_eval(np.arange(layout.size, dtype=np.int64), layout.shape, layout.stride)
    out.setflags(write=False)
    return out


def table_at(layout: "Layout", table, coords: tuple):
    """``table[i]`` at the 1-D index ``i`` of per-mode coordinate arrays of ``layout``.

    ``table`` is indexed like ``layout``'s 1-D coordinates (its offsets, or a swizzle of them).
    """
    import numpy as np

    if len(coords) != layout.rank:
        raise ValueError(f"offsets_at: {len(coords)} coordinate arrays for rank-{layout.rank} layout {layout}")
    index, radix = 0, 1
    for c, mode in zip(coords, layout.modes()):
        c = np.asarray(c, dtype=np.int64)
        if c.size and (c.min() < 0 or c.max() >= mode.size):
            raise IndexError(f"offsets_at: coordinates outside mode {int_tuple_str(mode.shape)} of {layout}")
        index = index + c * radix
        radix *= mode.size
    return table[index]


def make_layout(*layouts: Layout) -> Layout:
    """Concatenate layouts as top-level modes: ``make_layout(A, B)(a, b) == A(a) + B(b)``."""
    if not layouts:
        raise ValueError("make_layout needs at least one layout")
    for m in layouts:
        if not isinstance(m, Layout):
            raise ValueError(f"make_layout: expected Layouts; got {m!r}")
    return Layout(tuple(m.shape for m in layouts), tuple(m.stride for m in layouts))


def _compose_leaf(
    a: Layout, modes: Sequence[_Mode], n: int, r: int, digits: list[int]
) -> list[_Mode]:
    """Flat modes of ``a o (n:r)`` over ``a``'s merged flat ``modes``.

    Adds to ``digits[k]`` the largest coordinate this leaf reaches in mode ``k`` of
    ``a`` (the last mode of ``a`` is unbounded and not tracked).
    """
    if r == 0 or n == 1:  # every element is a(0) == 0
        return [(n, 0)]
    out: list[_Mode] = []
    rest_n, rest_r = n, r
    what = f"composition {a} o {n}:{r}"
    for k, (s, d) in enumerate(modes):
        if rest_n == 1:
            break
        if k == len(modes) - 1:  # the last mode extends without bound
            out.append((rest_n, rest_r * d))
            rest_n = 1
            break
        if rest_r >= s:
            if rest_r % s:
                raise ValueError(
                    f"{what}: stride divisibility condition fails: "
                    f"remaining stride {rest_r} is not a multiple of mode shape {s}"
                )
            rest_r //= s
            continue
        if (rest_n - 1) * rest_r < s:  # every remaining element lies inside this mode
            out.append((rest_n, rest_r * d))
            digits[k] += (rest_n - 1) * rest_r
            rest_n = 1
            break
        if s % rest_r:
            raise ValueError(
                f"{what}: stride divisibility condition fails: "
                f"mode shape {s} is not a multiple of remaining stride {rest_r}"
            )
        t = s // rest_r
        if rest_n % t:
            raise ValueError(
                f"{what}: shape divisibility condition fails: remaining shape {rest_n} "
                f"is not a multiple of {t} (mode shape {s} / stride {rest_r})"
            )
        out.append((t, rest_r * d))
        digits[k] += (t - 1) * rest_r
        rest_n //= t
        rest_r = 1
    return out


def _compose(a: Layout, b: Layout) -> Layout:
    """``a o b`` for a Layout ``b``: compose each leaf of ``b``, keep ``b``'s nesting.

    Composing leaf by leaf is exact only if the leaves' images add in ``a``'s
    mixed-radix coordinates without carrying from one mode of ``a`` into the next;
    this is checked (largest coordinates per mode of ``a`` must sum below its shape).
    """
    modes = _merge_modes(a.flat_modes(), keep_last=True)
    digits = [0] * len(modes)
    parts = [_from_modes(_compose_leaf(a, modes, n, r, digits)) for n, r in b.flat_modes()]
    for k, (s, _) in enumerate(modes[:-1]):
        if digits[k] >= s:
            raise ValueError(
                f"composition {a} o {b}: by-mode distributivity condition fails: the modes "
                f"of {b} reach coordinates summing to {digits[k]} in mode {s}:{modes[k][1]} "
                f"of {a}, which would carry into the next mode"
            )
    if isinstance(b.shape, int):
        return parts[0]
    return Layout(
        _unflatten([p.shape for p in parts], b.shape),
        _unflatten([p.stride for p in parts], b.shape),
    )


def _render_mode(
    expr: CppCoord, shape: IntTuple, stride: IntTuple, terms: list[str], const: list[int]
) -> None:
    """Append the C++ terms of one mode's offset to ``terms`` (literals go to ``const``)."""
    if isinstance(expr, (list, tuple)):
        if isinstance(shape, int) or len(expr) != len(shape):
            raise ValueError(
                f"to_cpp: coordinate expressions {expr!r} are not congruent to mode "
                f"{int_tuple_str(shape)}"
            )
        assert isinstance(stride, tuple)
        for e, s, d in zip(expr, shape, stride):
            _render_mode(e, s, d, terms, const)
        return
    text = _cpp_coord_text(expr)
    if text.isdigit():
        const[0] += _colex_eval(int(text), shape, stride)
        return
    base = cpp_parenthesize(text)
    leaves, div = [], 1
    for s, d in zip(flatten(shape), flatten(stride)):
        if s > 1:  # an in-range coordinate of a shape-1 leaf is 0
            leaves.append((s, d, div))
        div *= s
    for k, (s, d, div) in enumerate(leaves):
        if d == 0:
            continue
        coord = base if div == 1 else f"{base} / {div}"
        if k != len(leaves) - 1:
            coord = f"{coord} % {s}"
        if coord != base:
            coord = f"({coord})"
        terms.append(coord if d == 1 else f"{coord} * {d}")


def format_table(title: str, n_rows: int, n_cols: int, cell: Callable[[int, int], int]) -> str:
    """Text grid with ``cell(r, c)`` for ``r < n_rows``, ``c < n_cols`` (CuTe print_layout style)."""
    values = [[str(cell(r, c)) for c in range(n_cols)] for r in range(n_rows)]
    w = max([len(v) for row in values for v in row] + [len(str(n_cols - 1))])
    rw = len(str(n_rows - 1))
    sep = " " * (rw + 1) + "+" + "+".join("-" * (w + 2) for _ in range(n_cols)) + "+"
    lines = [title, " " * (rw + 2) + " ".join(f" {c:>{w}} " for c in range(n_cols)).rstrip(), sep]
    for r, row in enumerate(values):
        lines.append(f"{r:>{rw}} |" + "|".join(f" {v:>{w}} " for v in row) + "|")
        lines.append(sep)
    return "\n".join(lines)
