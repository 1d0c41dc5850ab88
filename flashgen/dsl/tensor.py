"""Tensor: a named piece of memory in one space, with an element type and a layout."""
from __future__ import annotations

import attrs

from .dtypes import DType
from .layout import Layout
from .swizzle import ComposedLayout

SPACES = ("GM", "SM", "RF")


@attrs.frozen
class Tensor:
    """``name`` in memory ``space`` (GM, SM or RF) holding ``dtype`` elements at ``layout(coord)``."""

    name: str
    space: str = attrs.field(validator=attrs.validators.in_(SPACES))
    dtype: DType
    layout: "Layout | ComposedLayout"

    @property
    def bytes(self) -> int:
        return self.layout.cosize * self.dtype.size

    def __str__(self) -> str:
        return f"{self.name}[{self.space}, {self.dtype}]: {self.layout}"
