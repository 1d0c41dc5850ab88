"""The LALR(1) parser of flashgen's text notations (``notation.lark``) and its errors.

:func:`parse_tree` turns a text into lark's tree for one start rule, :func:`parse` into a
transformer's value; a malformed text raises :class:`NotationError` (line, column, the text
with a caret, what was expected). The short form's flags are one terminal, ``FLAG``, whose
words come from the knob table (:data:`flashgen.dsl.knobs.FLAG_WORDS`). lark is imported and
the parser built on the first parse, so that importing a config costs neither.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

from ..knobs import FLAG_WORDS, HEAD, flag_regex

__all__ = ["FORMS", "NotationError", "parse", "parse_tree"]

#: d_head of a short form that gives three sizes, ``(dtype, B_r, B_c, n_warps)``: its default
SHORT_FORM_D_HEAD = next(k for k in HEAD if k.name == "d_head").default

#: Each start rule's form, as errors show it.
FORMS = {
    "layout": "SHAPE:STRIDE, e.g. (64,128):(128,1) or ((8,8),(64,2)):((64,512),(1,4096)) or 8:1",
    "swizzle": "Sw<B,M,S>, e.g. Sw<3,3,3>",
    "composed": "Sw<B,M,S> o SHAPE:STRIDE, e.g. Sw<3,3,3> o (64,64):(64,1)",
    "any_layout": "SHAPE:STRIDE or Sw<B,M,S> o SHAPE:STRIDE, e.g. (64,64):(64,1)",
    "config": f"(DTYPE, d_head, B_r, B_c, n_warps): flag+flag+... (d_head may be left out: {SHORT_FORM_D_HEAD}), "
    "e.g. (FP16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_0_tiles+buffer+opt_softmax",
    "backward": f"bwd(DTYPE, d_head, B_r, B_c, n_warps): flag+flag+... (the flags may be left out; d_head too: "
    f"{SHORT_FORM_D_HEAD}), e.g. bwd(FP16, 128, 64, 64, 4): swizzled+causal",
}


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


@functools.cache
def _parser():
    from lark import Lark

    grammar = (Path(__file__).with_name("notation.lark").read_text()
               + f"\n// generated from the knob table (flashgen/dsl/knobs.py)\nFLAG: /{flag_regex()}/\n")
    # cache: lark keeps the built tables in a temp file keyed by the grammar, so a fresh process starts fast
    return Lark(grammar, parser="lalr", start=list(FORMS), propagate_positions=True, cache=True)


# ---- lark's errors -> NotationError ----------------------------------------------------

_TERMINAL_WORDS = {
    "NAT": "a non-negative integer",
    "INT": "an integer",
    "DTYPE": "a dtype (FP16 or BF16)",
    "FLAG": f"a flag ({', '.join(FLAG_WORDS)})",
    "$END": "end of input",
}
_IDENT = re.compile(r"[A-Za-z0-9_]+")
_WORD = re.compile(r"[A-Za-z0-9_]+|\S")


def _expected_words(names: set[str]) -> str:
    """Terminal names -> "',' or ')'" (grammar order)."""
    order = {t.name: i for i, t in enumerate(_parser().terminals)}
    words: list[str] = []
    for name in sorted(names, key=lambda n: (order.get(n, len(order)), n)):
        word = _TERMINAL_WORDS.get(name) or f"'{_parser().get_terminal(name).pattern.value}'"
        if word not in words:
            words.append(word)
    if not words:
        return "nothing more"
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _found_at(text: str, pos: int) -> str:
    """The word (or the one character) at ``pos``: what the user wrote there."""
    m = _WORD.match(text, pos)
    return m.group() if m else text[pos : pos + 1]


def _translate(err, text: str, start: str) -> NotationError:
    """A NotationError saying, in words, what lark found and what it expected."""
    from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedToken

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
    form = FORMS[start]
    is_word = found is not None and _IDENT.fullmatch(found) is not None
    if expected == {"FLAG"} and is_word:
        return NotationError(f"unknown flag '{found}'", text, line, column, f"valid flags: {', '.join(FLAG_WORDS)}", form)
    if expected == {"DTYPE"} and is_word:
        return NotationError(f"unknown dtype '{found}'", text, line, column, "expected FP16 or BF16", form)
    what = "end of input" if found is None else f"'{found}'"
    return NotationError(f"unexpected {what}", text, line, column, f"expected {_expected_words(expected)}", form)


def parse_tree(text: str, start: str):
    """lark's tree of ``text`` for the start rule ``start``."""
    from lark.exceptions import UnexpectedInput

    if not isinstance(text, str):
        raise TypeError(f"expected the notation as a str, got {type(text).__name__}")
    try:
        return _parser().parse(text, start=start)
    except UnexpectedInput as e:
        raise _translate(e, text, start) from None


def parse(text: str, start: str, transformer) -> Any:
    """The value a lark ``Transformer`` makes of ``text``'s tree for the start rule ``start``."""
    from lark import Tree
    from lark.exceptions import VisitError

    tree = parse_tree(text, start)
    try:
        return transformer.transform(tree)
    except VisitError as e:  # a constructor refused well-formed text, e.g. Layout(8, (1,2))
        if not isinstance(e.orig_exc, ValueError):
            raise e.orig_exc from None
        meta = e.obj.meta if isinstance(e.obj, Tree) and not e.obj.meta.empty else None
        line, column = (meta.line, meta.column) if meta else (1, 1)
        raise NotationError(f"invalid {e.rule}", text, line, column, str(e.orig_exc), FORMS[start]) from e.orig_exc
