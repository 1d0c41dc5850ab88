"""Parsers for flashgen's text notations: layouts, swizzles, short-form kernel names.

    parse_layout("((8,8),(64,2)):((64,512),(1,4096))")  -> Layout
    parse_swizzle("Sw<3,3,3>")                          -> Swizzle
    parse_composed("Sw<3,3,3> o (64,64):(64,1)")        -> ComposedLayout
    parse_any_layout(text)                              -> Layout | ComposedLayout
    parse_config("(FP16, 128, 64, 64, 4): async+eager+swizzled+load_0_2_2_tiles")
                                                        -> KernelConfig

Each is the inverse of the object's ``str``.  The grammar is ``grammar/notation.lark``
(LALR(1), one start rule per notation); :class:`_ToObjects` maps its rules to
constructors.  A malformed text raises :class:`NotationError` (line, column, the text
with a caret, what was expected); a well-formed short form naming a kernel that cannot
be built raises the :class:`~flashgen.dsl.config.ConfigError` of ``KernelConfig``, with
the short form prefixed to its message.
"""
from __future__ import annotations

import re
from typing import Any, Union

import attrs
from lark import Lark, Token, Transformer, Tree, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError

from .config import ConfigError, KernelConfig
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
VALID_FLAGS: tuple[str, ...] = ("async", "eager", "swizzled", "load_Q_K_V_tiles", "buffer", "opt_softmax", "causal", "window",
                                "wgmma", "stages_N", "pingpong", "intra", "persistent")
#: Flags only the wgmma (Hopper) engine takes, and the mma.sync-only ones it refuses.
_WGMMA_FLAGS = frozenset({"wgmma", "stages_N", "pingpong", "intra", "persistent"})
_MMA_SYNC_FLAGS = frozenset({"async", "eager", "swizzled", "load_Q_K_V_tiles", "buffer", "opt_softmax"})

#: d_head of a short form that gives three sizes, ``(dtype, B_r, B_c, n_warps)``.
SHORT_FORM_D_HEAD = 128

_FORMS = {
    "layout": "SHAPE:STRIDE, e.g. (64,128):(128,1) or ((8,8),(64,2)):((64,512),(1,4096)) or 8:1",
    "swizzle": "Sw<B,M,S>, e.g. Sw<3,3,3>",
    "composed": "Sw<B,M,S> o SHAPE:STRIDE, e.g. Sw<3,3,3> o (64,64):(64,1)",
    "any_layout": "SHAPE:STRIDE or Sw<B,M,S> o SHAPE:STRIDE, e.g. (64,64):(64,1)",
    "config": "(DTYPE, d_head, B_r, B_c, n_warps): flag+flag+... (d_head may be left out: 128), "
    "e.g. (FP16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_0_tiles+buffer+opt_softmax",
}


#: Canonical names shared by flags that exclude each other, and why.
_EXCLUSIVE = {"mask": "a config has one score mask"}


class NotationError(ValueError):
    """A text that is not well formed in its notation.

    ``line`` and ``column`` are 1-based; ``problem`` says what is wrong there and
    ``detail`` what would be right.  ``str()`` reads
    ``"<problem> at column <c>; <detail>"``, then the offending line with a caret
    under the column, then the notation's form.
    """

    def __init__(self, problem: str, text: str, line: int, column: int, detail: str = "", form: str = ""):
        self.problem = problem
        self.text = text
        self.line = line
        self.column = column
        self.detail = detail
        self.form = form
        super().__init__(self._render())

    def __reduce__(self):
        return type(self), (self.problem, self.text, self.line, self.column, self.detail, self.form)

    def _render(self) -> str:
        lines = self.text.split("\n")
        where = f"line {self.line}, column {self.column}" if len(lines) > 1 else f"column {self.column}"
        head = f"{self.problem} at {where}" + (f"; {self.detail}" if self.detail else "")
        src = lines[self.line - 1].rstrip("\r") if 0 < self.line <= len(lines) else ""
        pad = "".join(ch if ch == "\t" else " " for ch in src[: self.column - 1])
        out = f"{head}\n    {src}\n    {pad}^"
        return out + (f"\n  expected form: {self.form}" if self.form else "")


# ---- intermediate values of the short form ---------------------------------------------


@attrs.frozen
class _Flag:
    """One flag of a short form: its spelling, the knobs it sets, where it stands."""

    name: str  # canonical name, one of VALID_FLAGS
    text: str
    knobs: tuple[tuple[str, Any], ...]
    line: int
    column: int
    end_line: int
    end_column: int


def _flag(name: str, tok: Token, **knobs: Any) -> _Flag:
    return _Flag(name, str(tok), tuple(knobs.items()), tok.line, tok.column, tok.end_line, tok.end_column)


@attrs.frozen
class _ShortForm:
    """A parsed short form before the flag-count checks and KernelConfig's rules."""

    dtype: str
    sizes: tuple[tuple[str, int], ...]
    flags: tuple[_Flag, ...]

    def to_config(self, text: str) -> KernelConfig:
        """Check flag counts (each at most once, load exactly once), then build the config."""
        seen: dict[str, _Flag] = {}
        for f in self.flags:
            if f.name in seen:
                raise self._repeated(seen[f.name], f, text)
            seen[f.name] = f
        if "wgmma" in seen:
            return self._wgmma_config(text, seen)
        for f in self.flags:
            if f.name in _WGMMA_FLAGS:
                raise NotationError(
                    f"flag '{f.text}' needs the wgmma engine", text, f.line, f.column,
                    "add +wgmma (Hopper kernels), or drop it for an mma.sync kernel", _FORMS["config"],
                )
        if "load_Q_K_V_tiles" not in seen:
            last = self.flags[-1]
            raise NotationError(
                "missing load_Q_K_V_tiles flag", text, last.end_line, last.end_column,
                "a short form names its shared->register k-tile counts exactly once, e.g. +load_2_2_0_tiles",
                _FORMS["config"],
            )
        knobs: dict[str, Any] = dict(
            dtype=self.dtype,
            async_copy=False,
            eager_load_blocks=False,
            swizzled=False,
            mma_double_buffer_loads=False,
            optimized_softmax=False,
        )
        knobs.update(self.sizes)
        for f in self.flags:
            knobs.update(f.knobs)
        try:
            return KernelConfig(**knobs)
        except ConfigError as e:
            raise ConfigError(f"invalid kernel config '{' '.join(text.split())}': {e}") from e


    @staticmethod
    def _repeated(first: _Flag, again: _Flag, text: str) -> NotationError:
        """A flag given twice, or two flags that set one knob differently (causal, window)."""
        if again.name in _EXCLUSIVE and again.knobs != first.knobs:
            problem = f"{first.text} and {again.text} exclude each other"
            detail = f"{_EXCLUSIVE[again.name]}: keep one of them"
        else:
            problem = f"duplicate flag '{again.text}'"
            detail = f"'{first.text}' is already given at column {first.column}; each flag may appear once"
        return NotationError(problem, text, again.line, again.column, detail, _FORMS["config"])

    def _wgmma_config(self, text: str, seen: dict[str, _Flag]) -> KernelConfig:
        """A wgmma short form: no mma.sync flags; stages/pingpong/intra off unless given."""
        for f in self.flags:
            if f.name in _MMA_SYNC_FLAGS:
                raise NotationError(
                    f"flag '{f.text}' is an mma.sync flag", text, f.line, f.column,
                    "a +wgmma kernel takes wgmma, stages_N, pingpong, intra, persistent and a mask flag", _FORMS["config"],
                )
        knobs: dict[str, Any] = dict(dtype=self.dtype, engine="wgmma", stages=1, pingpong=False, intra_overlap=False,
                                     persistent=False)
        knobs.update(self.sizes)
        for f in self.flags:
            knobs.update(f.knobs)
        try:
            return KernelConfig.from_dict(knobs)
        except ConfigError as e:
            raise ConfigError(f"invalid kernel config '{' '.join(text.split())}': {e}") from e


# ---- the grammar's rules -> constructors -----------------------------------------------


@v_args(inline=True)
class _ToObjects(Transformer):
    """Maps each rule of notation.lark to the constructor of the value it denotes."""

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

    def sizes4(self, d_head: Token, b_r: Token, b_c: Token, n_warps: Token) -> tuple:
        return (("d_head", int(d_head)), ("B_r", int(b_r)), ("B_c", int(b_c)), ("n_warps", int(n_warps)))

    def sizes3(self, b_r: Token, b_c: Token, n_warps: Token) -> tuple:
        return (("d_head", SHORT_FORM_D_HEAD), ("B_r", int(b_r)), ("B_c", int(b_c)), ("n_warps", int(n_warps)))

    def async_flag(self, tok: Token) -> _Flag:
        return _flag("async", tok, async_copy=True)

    def eager_flag(self, tok: Token) -> _Flag:
        return _flag("eager", tok, eager_load_blocks=True)

    def swizzled_flag(self, tok: Token) -> _Flag:
        return _flag("swizzled", tok, swizzled=True)

    def load_flag(self, tok: Token) -> _Flag:
        q, k, v = (int(n) for n in str(tok).split("_")[1:4])  # load_<q>_<k>_<v>_tiles
        return _flag(
            "load_Q_K_V_tiles", tok, Q_mma_load_K_tiles=q, K_mma_load_K_tiles=k, V_mma_load_K_tiles=v
        )

    def buffer_flag(self, tok: Token) -> _Flag:
        return _flag("buffer", tok, mma_double_buffer_loads=True)

    def opt_softmax_flag(self, tok: Token) -> _Flag:
        return _flag("opt_softmax", tok, optimized_softmax=True)

    # causal and window both choose the score mask: at most one of them (same canonical name)
    def causal_flag(self, tok: Token) -> _Flag:
        return _flag("mask", tok, mask="causal")

    def window_flag(self, tok: Token) -> _Flag:
        return _flag("mask", tok, mask="window")

    def wgmma_flag(self, tok: Token) -> _Flag:
        return _flag("wgmma", tok, engine="wgmma")

    def stages_flag(self, tok: Token) -> _Flag:
        return _flag("stages_N", tok, stages=int(str(tok).split("_")[1]))

    def pingpong_flag(self, tok: Token) -> _Flag:
        return _flag("pingpong", tok, pingpong=True)

    def intra_flag(self, tok: Token) -> _Flag:
        return _flag("intra", tok, intra_overlap=True)

    def persistent_flag(self, tok: Token) -> _Flag:
        return _flag("persistent", tok, persistent=True)

    def flags(self, *flags: _Flag) -> tuple[_Flag, ...]:
        return flags

    def config(self, dtype: Token, sizes: tuple, flags: tuple[_Flag, ...]) -> _ShortForm:
        return _ShortForm(str(dtype), sizes, flags)


_PARSER = Lark.open(
    "grammar/notation.lark",
    rel_to=__file__,
    parser="lalr",
    start=list(_FORMS),
    propagate_positions=True,
    cache=True,  # lark keeps the built tables in a temp file keyed by the grammar: a fresh process starts fast
)
_TO_OBJECTS = _ToObjects()

# ---- lark's errors -> NotationError ----------------------------------------------------

_FLAG_TERMINALS = frozenset({"ASYNC", "EAGER", "SWIZZLED", "LOAD_TILES", "BUFFER", "OPT_SOFTMAX", "CAUSAL", "WINDOW",
                             "WGMMA", "STAGES", "PINGPONG", "INTRA", "PERSISTENT"})
_TERMINAL_WORDS = {
    "NAT": "a non-negative integer",
    "INT": "an integer",
    "DTYPE": "a dtype (FP16 or BF16)",
    "$END": "end of input",
}
_TERMINAL_ORDER = {t.name: i for i, t in enumerate(_PARSER.terminals)}
_IDENT = re.compile(r"[A-Za-z0-9_]+")
_WORD = re.compile(r"[A-Za-z0-9_]+|\S")


def _expected_words(names: set[str]) -> str:
    """Terminal names -> "',' or ')'" (grammar order; the flags folded into one entry)."""
    words: list[str] = []
    for name in sorted(names, key=lambda n: (_TERMINAL_ORDER.get(n, len(_TERMINAL_ORDER)), n)):
        if name in _FLAG_TERMINALS:
            word = f"a flag ({', '.join(VALID_FLAGS)})"
        elif name in _TERMINAL_WORDS:
            word = _TERMINAL_WORDS[name]
        else:
            word = f"'{_PARSER.get_terminal(name).pattern.value}'"
        if word not in words:
            words.append(word)
    if not words:
        return "nothing more"
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _found_at(text: str, pos: int) -> str:
    """The word (or the one character) at ``pos``: what the user wrote there."""
    m = _WORD.match(text, pos)
    return m.group() if m else text[pos : pos + 1]


def _translate(err: UnexpectedInput, text: str, start: str) -> NotationError:
    """A NotationError saying, in words, what lark found and what it expected."""
    found: str | None  # None: the end of the input
    if isinstance(err, UnexpectedCharacters):
        expected = set(err.allowed or ())
        line, column = err.line, err.column
        found = _found_at(text, err.pos_in_stream)
    elif isinstance(err, UnexpectedToken):
        tok = err.token
        expected = set(err.accepts or err.expected or ())
        if tok.type == "$END":  # lark lends $END the last token's position: point just past it
            line, column = (tok.end_line, tok.end_column) if tok.end_line is not None else (1, 1)
            found = None
        else:
            line, column = tok.line, tok.column
            found = _found_at(text, tok.start_pos)
    elif isinstance(err, UnexpectedEOF):
        expected = set(err.expected or ())
        lines = text.split("\n")
        line, column, found = len(lines), len(lines[-1]) + 1, None
    else:  # pragma: no cover - lark raises only the three above
        raise err
    expected.discard("WS")
    form = _FORMS[start]
    is_word = found is not None and _IDENT.fullmatch(found) is not None
    if expected and expected <= _FLAG_TERMINALS and is_word:
        return NotationError(f"unknown flag '{found}'", text, line, column, f"valid flags: {', '.join(VALID_FLAGS)}", form)
    if expected == {"DTYPE"} and is_word:
        return NotationError(f"unknown dtype '{found}'", text, line, column, "expected FP16 or BF16", form)
    what = "end of input" if found is None else f"'{found}'"
    return NotationError(f"unexpected {what}", text, line, column, f"expected {_expected_words(expected)}", form)


def _parse(text: str, start: str) -> Any:
    if not isinstance(text, str):
        raise TypeError(f"expected the notation as a str, got {type(text).__name__}")
    try:
        tree = _PARSER.parse(text, start=start)
    except UnexpectedInput as e:
        raise _translate(e, text, start) from None
    try:
        return _TO_OBJECTS.transform(tree)
    except VisitError as e:  # a constructor refused well-formed text, e.g. Layout(8, (1,2))
        if not isinstance(e.orig_exc, ValueError):
            raise e.orig_exc from None
        meta = e.obj.meta if isinstance(e.obj, Tree) and not e.obj.meta.empty else None
        line, column = (meta.line, meta.column) if meta else (1, 1)
        raise NotationError(f"invalid {e.rule}", text, line, column, str(e.orig_exc), _FORMS[start]) from e.orig_exc


# ---- public API -------------------------------------------------------------------------


def parse_layout(text: str) -> Layout:
    """``"(64,128):(128,1)"`` -> ``Layout((64, 128), (128, 1))``; ``"8:1"`` -> ``Layout(8, 1)``."""
    return _parse(text, "layout")


def parse_swizzle(text: str) -> Swizzle:
    """``"Sw<3,3,3>"`` -> ``Swizzle(3, 3, 3)``; S may be negative (``Sw<2,4,-3>``)."""
    return _parse(text, "swizzle")


def parse_composed(text: str) -> ComposedLayout:
    """``"Sw<3,3,3> o (64,64):(64,1)"`` -> ``ComposedLayout(Swizzle(3,3,3), Layout(...))``."""
    return _parse(text, "composed")


def parse_any_layout(text: str) -> Union[Layout, ComposedLayout]:
    """A plain layout or a swizzle-composed one, whichever the text is."""
    return _parse(text, "any_layout")


def parse_config(text: str) -> KernelConfig:
    """The seed's short form -> KernelConfig.

    ``(DTYPE, d_head, B_r, B_c, n_warps): flags`` or ``(DTYPE, B_r, B_c, n_warps): flags``
    (d_head 128); DTYPE is FP16 or BF16 in any case; flags are ``+``-separated, each at
    most once, in any order, from async, eager, swizzled, buffer, opt_softmax and
    ``load_<Q>_<K>_<V>_tiles`` (required).  An absent flag's knob is false.

    Raises NotationError for a malformed text, ConfigError for a kernel that cannot
    be built (the message starts with the short form).
    """
    return _parse(text, "config").to_config(text)
