"""The short form of a kernel config, both ways, through the knob table.

    (FP16, 128, 64, 64, 4): async+eager+swizzled+load_0_2_2_tiles+buffer+opt_softmax
    (FP16, 128, 128, 128, 12): wgmma+stages_2+pingpong+intra

``(DTYPE, d_head, B_r, B_c, n_warps): flags`` (``(DTYPE, B_r, B_c, n_warps)``: d_head at its
default). Each flag is one knob's spelling (:data:`flashgen.dsl.knobs.FLAGS`), given at most once,
in any order; a knob whose flag is left out takes its ``absent`` value (a switch is false), except
that a required flag (``load_Q_K_V_tiles``) must be given. The engine flag (``wgmma``) chooses the
engine; a flag of another engine's knob is refused. :func:`values` returns the knob values a text
names, for :meth:`KernelConfig.from_dict`; :func:`render` writes a config's values back.

The backward kernels' name is the same head and flags after ``bwd`` (the flags optional), limited
to the knobs the backward has: ``bwd(FP16, 128, 64, 64, 4): swizzled+causal``
(:func:`backward_values`).
"""
from __future__ import annotations

from typing import Any, Collection, Mapping

import attrs

from .dtypes import DType
from .grammar import FORMS, NotationError, parse_tree
from .knobs import (BACKWARD_FLAGS, DEFAULT_ENGINE, ENGINE_FLAG, FLAGS, HEAD, Spelled, engine, engine_flags, flags, read_flag,
                    with_defaults)

_FORM = FORMS["config"]
_BACKWARD_FORM = FORMS["backward"]


@attrs.frozen
class _Flag:
    """One flag of a short form: its spelling, the knob values it sets, where it stands."""

    group: Spelled
    text: str
    values: tuple[tuple[str, Any], ...]
    line: int
    column: int
    end_line: int
    end_column: int
    form: str = _FORM

    def error(self, problem: str, detail: str, text: str) -> NotationError:
        return NotationError(problem, text, self.line, self.column, detail, self.form)


@attrs.frozen
class _ShortForm:
    """A parsed short form before the flag checks and KernelConfig's rules."""

    dtype: str
    sizes: tuple[tuple[str, int], ...]
    flags: tuple[_Flag, ...]

    def values(self, text: str) -> dict[str, Any]:
        """The knob values: each flag at most once, all of one engine, every required one given."""
        seen: dict[Spelled, _Flag] = {}
        for f in self.flags:
            if f.group in seen:
                raise _repeated(seen[f.group], f, text)
            seen[f.group] = f
        chosen = seen.get(ENGINE_FLAG)
        this = engine(dict(chosen.values)["engine"] if chosen else DEFAULT_ENGINE)
        for f in self.flags:
            if f.group in BACKWARD_FLAGS:
                raise f.error(f"flag '{f.text}' is a knob of the backward kernels",
                              f"a backward short form starts with bwd(...); {this.named} kernel takes "
                              f"{engine_flags(this.name)}", text)
            if this.name not in f.group.engines:
                raise _other_engine(f, this.name, text)
        out: dict[str, Any] = {HEAD[0].name: self.dtype, **dict(self.sizes)}
        for group in FLAGS:
            if this.name not in group.engines:
                continue
            given = seen.get(group)
            if given is None and group.absent() is None:
                raise self._missing(group, this.name, text)
            out.update(dict(given.values) if given else group.absent())
        return out

    def _missing(self, group: Spelled, engine_name: str, text: str) -> NotationError:
        last = self.flags[-1]
        example = group.write(with_defaults({"engine": engine_name}))
        names = [k.name for k in group.knobs]
        listing = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
        return NotationError(
            f"missing {group.words()[0]} flag", text, last.end_line, last.end_column,
            f"{engine(engine_name).named} short form names {listing} exactly once, e.g. +{example}", _FORM,
        )


def _repeated(first: _Flag, again: _Flag, text: str) -> NotationError:
    """A flag given twice, or two flags that set one knob differently (causal, window)."""
    exclusive = getattr(again.group.spelling, "exclusive", "")
    if exclusive and again.values != first.values:
        return again.error(f"{first.text} and {again.text} exclude each other", f"{exclusive}: keep one of them", text)
    return again.error(f"duplicate flag '{again.text}'",
                       f"'{first.text}' is already given at column {first.column}; each flag may appear once", text)


def _other_engine(f: _Flag, engine_name: str, text: str) -> NotationError:
    """A flag of a knob that the config's engine does not have."""
    owner = engine(f.group.engines[0])
    detail = f"{engine(engine_name).named} kernel takes {engine_flags(engine_name)}"
    if owner.name in ENGINE_FLAG.words():
        detail += f"; +{owner.name} selects the {owner.label} engine"
    return f.error(f"flag '{f.text}' needs the {owner.label} engine", detail, text)


def _flag(tok, form: str = _FORM) -> _Flag:
    group, values = read_flag(str(tok))  # the FLAG terminal matches flag words only
    return _Flag(group, str(tok), tuple(values.items()), tok.line, tok.column, tok.end_line, tok.end_column, form)


def _sizes(sizes) -> tuple[tuple[str, int], ...]:
    """The head's sizes: HEAD is dtype, d_head, B_r, B_c, n_warps; ``sizes3`` leaves out d_head."""
    head = HEAD[1:] if sizes.data == "sizes4" else HEAD[2:]
    return tuple((k.name, int(n)) for k, n in zip(head, sizes.children))


def values(text: str) -> dict[str, Any]:
    """The knob values a short form names (NotationError for a malformed text or misused flags)."""
    dtype, sizes, flag_list = parse_tree(text, "config").children  # config: "(" DTYPE "," sizes ")" ":" flags
    return _ShortForm(str(dtype), _sizes(sizes), tuple(_flag(t) for t in flag_list.children)).values(text)


def backward_values(text: str, fields: Collection[str]) -> dict[str, Any]:
    """The knob values a backward short form names (``fields``: the backward config's knobs): the
    head, and each flag of a knob it has at most once; a knob whose flag is left out takes its
    ``absent`` value (``swizzled`` false, ``mask`` none)."""
    dtype, sizes, *rest = parse_tree(text, "backward").children  # backward: "bwd" "(" DTYPE "," sizes ")" [":" flags]
    given = tuple(_flag(t, _BACKWARD_FORM) for part in rest if part is not None for t in part.children)
    groups = [g for g in FLAGS + BACKWARD_FLAGS if all(k.name in fields for k in g.knobs)]
    seen: dict[Spelled, _Flag] = {}
    for f in given:
        if f.group not in groups:
            words = ", ".join(w for g in groups for w in g.words())
            raise f.error(f"flag '{f.text}' is not a backward knob", f"the backward takes {words}", text)
        if f.group in seen:
            raise _repeated(seen[f.group], f, text)
        seen[f.group] = f
    out: dict[str, Any] = {HEAD[0].name: str(dtype), **dict(_sizes(sizes))}
    for group in groups:
        out.update(dict(seen[group].values) if group in seen else group.absent())
    return out


def render(values: Mapping[str, Any]) -> str:
    """A config's knob values as its short form."""
    head = ", ".join(v.short if isinstance(v, DType) else str(v) for v in (values[k.name] for k in HEAD))
    return f"({head}): {'+'.join(flags(values))}"
