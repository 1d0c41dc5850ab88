"""Parsers for flashgen's text notations: layouts, swizzles, short-form kernel names.

    parse_layout("((8,8),(64,2)):((64,512),(1,4096))")  -> Layout
    parse_swizzle("Sw<3,3,3>")                          -> Swizzle
    parse_composed("Sw<3,3,3> o (64,64):(64,1)")        -> ComposedLayout
    parse_any_layout(text)                              -> Layout | ComposedLayout
    parse_config("(FP16, 128, 64, 64, 4): async+eager+swizzled+load_0_2_2_tiles")
                                                        -> KernelConfig

Each is the inverse of the object's ``str``.  The grammar is ``grammar/notation.lark``
(LALR(1), one start rule per notation, parsed by :mod:`flashgen.dsl.grammar`);
:class:`_ToObjects` maps its layout rules to constructors, and the short form is read by
:mod:`flashgen.dsl.short_form` through the knob table.  A malformed text raises
:class:`NotationError` (line, column, the text with a caret, what was expected); a
well-formed short form naming a kernel that cannot be built raises the
:class:`~flashgen.dsl.config.ConfigError` of ``KernelConfig``, with the short form
prefixed to its message.
"""
from __future__ import annotations

from typing import Any, Union

from lark import Token, Transformer, v_args

from .config import KernelConfig
from .grammar import NotationError, parse
from .knobs import FLAG_WORDS
from .layout import Layout
from .swizzle import ComposedLayout, Swizzle

__all__ = [
    "NotationError",
    "VALID_FLAGS",
    "parse_layout",
    "parse_swizzle",
    "parse_composed",
    "parse_any_layout",
    "parse_config",
]

#: The short form's flags in canonical order (``KernelConfig.flags`` prints them so).
VALID_FLAGS: tuple[str, ...] = FLAG_WORDS


@v_args(inline=True)
class _ToObjects(Transformer):
    """Maps the layout and swizzle rules of notation.lark to the constructors of the values they denote."""

    def int_mode(self, tok: Token) -> int:
        return int(tok)

    def tuple_mode(self, *modes: Any) -> tuple:
        return tuple(modes)

    def layout(self, shape: Any, stride: Any) -> Layout:
        return Layout(shape, stride)

    def swizzle(self, b: Token, m: Token, s: Token) -> Swizzle:
        return Swizzle(int(b), int(m), int(s))

    def composed(self, swizzle: Swizzle, layout: Layout) -> ComposedLayout:
        return ComposedLayout(swizzle, layout)


_TO_OBJECTS = _ToObjects()


# ---- public API -------------------------------------------------------------------------


def parse_layout(text: str) -> Layout:
    """``"(64,128):(128,1)"`` -> ``Layout((64, 128), (128, 1))``; ``"8:1"`` -> ``Layout(8, 1)``."""
    return parse(text, "layout", _TO_OBJECTS)


def parse_swizzle(text: str) -> Swizzle:
    """``"Sw<3,3,3>"`` -> ``Swizzle(3, 3, 3)``; S may be negative (``Sw<2,4,-3>``)."""
    return parse(text, "swizzle", _TO_OBJECTS)


def parse_composed(text: str) -> ComposedLayout:
    """``"Sw<3,3,3> o (64,64):(64,1)"`` -> ``ComposedLayout(Swizzle(3,3,3), Layout(...))``."""
    return parse(text, "composed", _TO_OBJECTS)


def parse_any_layout(text: str) -> Union[Layout, ComposedLayout]:
    """A plain layout or a swizzle-composed one, whichever the text is."""
    return parse(text, "any_layout", _TO_OBJECTS)


def parse_config(text: str) -> KernelConfig:
    """The seed's short form -> KernelConfig (:meth:`KernelConfig.from_short_form`).

    ``(DTYPE, d_head, B_r, B_c, n_warps): flags`` or ``(DTYPE, B_r, B_c, n_warps): flags``
    (d_head 128); DTYPE is FP16 or BF16 in any case; flags are ``+``-separated, each at
    most once, in any order, from :data:`VALID_FLAGS` (an mma.sync kernel needs
    ``load_<Q>_<K>_<V>_tiles``; ``wgmma`` chooses the Hopper engine).  An absent flag's
    switch is false.

    Raises NotationError for a malformed text, ConfigError for a kernel that cannot
    be built (the message starts with the short form).
    """
    return KernelConfig.from_short_form(text)
