"""Config files: one config, a list of configs, or a sweep -> valid configs (forward or backward) + skips.

The format (one rule: **a knob given as a list is swept**)::

    # one config: a mapping of knob names (flashgen.dsl.config.KNOBS, and HOPPER_KNOBS
    # with engine: wgmma); missing knobs take KernelConfig's defaults, dtype is required
    dtype: fp16
    B_r: 128
    B_c: 64

    # a sweep: every knob whose value is a list is swept; the combinations are the
    # product of the lists (the first listed knob varies slowest)
    dtype: [fp16, bf16]
    B_r: [64, 128]
    Q_mma_load_K_tiles: [0, 2]
    prune: seed        # optional: drop what the seed's tuning heuristics prune

    # a list: each item is a config mapping, a sweep mapping or a short-form string
    - "(FP16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax"
    - {dtype: bf16, B_c: [32, 64]}

    # backward kernels: kind: backward, then the knobs of BackwardConfig (swept the same way),
    # or a backward short form
    - {kind: backward, dtype: fp16, d_head: [64, 128], mask: causal}
    - "bwd(BF16, 128, 64, 64, 4): swizzled"

A document that is a single short-form string is one config too.

``prune`` and ``kind`` are the keys that are not knobs. ``prune: seed`` applies
:func:`flashgen.dsl.config.is_tuning_candidate` (the seed's register-pressure and
speed heuristics) to that mapping's combinations; ``prune: none`` (the default)
keeps every valid one. Pruned combinations are reported like invalid ones, with a
reason that says they are buildable.

Results: the valid configs, deduplicated, in document order; and the skipped
combinations, each with the knobs it had, where it came from (``file:line``) and
why (the :class:`~flashgen.dsl.config.ConfigError` message, or the pruning).

Hard errors (:class:`SweepError`, naming the file and line): unreadable or
malformed YAML, an empty document, a document that is neither a mapping, a list nor
a short form, an unknown key, an empty or nested list, a malformed short form.
A well-formed combination that cannot be built is not an error: it is skipped.
"""
from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any, Iterable

import attrs
import yaml

from ..dsl import configs
from ..dsl.config import HOPPER_KNOBS, KNOBS, ConfigError, is_tuning_candidate
from ..dsl.configs import AnyConfig

__all__ = ["PRUNE_MODES", "Skipped", "SweepError", "SweepResult", "load_sweep", "parse_sweep", "resolve"]

#: Values of the optional ``prune`` key.
PRUNE_MODES = ("none", "seed")
#: A sweep larger than this is refused (it is almost certainly a mistake).
MAX_COMBINATIONS = 100_000

PRUNED_REASON = "pruned by the seed's tuning heuristics (prune: seed); buildable, not invalid"


class SweepError(ConfigError):
    """A config file that cannot be read as configs (the message names file and line)."""


@attrs.frozen
class Skipped:
    """A combination that yields no config: its knobs, its origin and the reason."""

    knobs: dict = attrs.field(eq=False)
    where: str
    reason: str
    pruned: bool = False

    def describe(self) -> str:
        knobs = ", ".join(f"{k}={_show(v)}" for k, v in self.knobs.items())
        return f"{self.where}: {{{knobs}}}: {self.reason}"

    @property
    def category(self) -> str:
        """The reason without the values it names, so that skips by one rule count together:
        ``eager_load_blocks=true needs async_copy=true (eager loads ...)`` ->
        ``eager_load_blocks needs async_copy``."""
        return _TRAILING_WHY.sub("", _KNOB_VALUE.sub(r"\1", self.reason))


#: ``knob=value`` in a ConfigError message (values may be quoted: ``mask='diag'``)
_KNOB_VALUE = re.compile(r"\b([A-Za-z_]\w*)=(?:'[^']*'|\"[^\"]*\"|[^\s,:;)]+)")
#: a closing explanation in parentheses
_TRAILING_WHY = re.compile(r"\s*\([^()]*\)\s*$")


@attrs.frozen
class SweepResult:
    """Valid configs (deduplicated, document order), skipped combinations, duplicates dropped."""

    configs: tuple[AnyConfig, ...]
    skipped: tuple[Skipped, ...] = ()
    duplicates: int = 0

    @property
    def invalid(self) -> tuple[Skipped, ...]:
        return tuple(s for s in self.skipped if not s.pruned)

    @property
    def pruned(self) -> tuple[Skipped, ...]:
        return tuple(s for s in self.skipped if s.pruned)


def _kind(x: Any) -> str:
    """A YAML value's kind in words, for error messages."""
    if x is None:
        return "empty (null)"
    if isinstance(x, bool):
        return "a boolean"
    if isinstance(x, (int, float)):
        return f"a number ({x!r})"
    if isinstance(x, list):
        return "a list"
    return f"a {type(x).__name__} ({x!r})"


def _show(v: Any) -> str:
    return str(v) if isinstance(v, (bool, int, float, str)) else repr(v)


# ---- YAML with line numbers ------------------------------------------------------------


class _Map(dict):
    """A YAML mapping that remembers its line and each key's line (1-based)."""

    line: int = 0
    key_lines: dict


class _Seq(list):
    line: int = 0
    item_lines: list


class _Loader(yaml.SafeLoader):
    """SafeLoader building :class:`_Map`/:class:`_Seq` so errors can cite lines."""

    def construct_yaml_map(self, node):  # type: ignore[override]
        data = _Map()
        data.line = node.start_mark.line + 1
        data.key_lines = {}
        yield data
        self.flatten_mapping(node)  # YAML merge keys (<<)
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, "found an unhashable key", key_node.start_mark
                ) from None
            if key in data:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, f"found duplicate key {key!r}", key_node.start_mark
                )
            data[key] = self.construct_object(value_node, deep=True)
            data.key_lines[key] = key_node.start_mark.line + 1

    def construct_yaml_seq(self, node):  # type: ignore[override]
        data = _Seq()
        data.line = node.start_mark.line + 1
        data.item_lines = [n.start_mark.line + 1 for n in node.value]
        yield data
        data.extend(self.construct_object(n, deep=True) for n in node.value)


_Loader.add_constructor("tag:yaml.org,2002:map", _Loader.construct_yaml_map)
_Loader.add_constructor("tag:yaml.org,2002:seq", _Loader.construct_yaml_seq)


def _load_yaml(text: str, source: str) -> Any:
    try:
        docs = list(yaml.load_all(text, Loader=_Loader))  # noqa: S506 - _Loader is a SafeLoader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
        problem = getattr(exc, "problem", None) or str(exc)
        context = getattr(exc, "context", None)
        msg = f"{where}: invalid YAML: {problem}" + (f" ({context})" if context else "")
        raise SweepError(msg) from None
    docs = [d for d in docs if d is not None]
    if not docs:
        raise SweepError(
            f"{source}: the file is empty: expected a config mapping, a list of configs, or a sweep "
            "(see examples/*.yaml)"
        )
    if len(docs) > 1:
        raise SweepError(f"{source}: holds {len(docs)} YAML documents; put the configs in one list instead")
    return docs[0]


# ---- expansion ---------------------------------------------------------------------------


class _Collector:
    def __init__(self) -> None:
        self.configs: dict[AnyConfig, None] = {}
        self.skipped: list[Skipped] = []
        self.duplicates = 0

    def add(self, cfg: AnyConfig) -> None:
        if cfg in self.configs:
            self.duplicates += 1
        else:
            self.configs[cfg] = None

    def result(self) -> SweepResult:
        return SweepResult(tuple(self.configs), tuple(self.skipped), self.duplicates)


def _line(obj: Any, default: int = 0) -> int:
    return getattr(obj, "line", default) or default


#: the keys of a mapping that are not knobs
_NOT_KNOBS = ("prune", "kind")


def _knob_names(kind: str) -> tuple[str, ...]:
    if kind == configs.DEFAULT_KIND:
        return tuple(KNOBS + HOPPER_KNOBS)
    return tuple(f.name for f in attrs.fields(configs.KINDS[kind]))


def _kind_and_prune(m: dict, at) -> tuple[str, str]:
    """The mapping's ``kind`` (its keys checked against that kind's knobs) and ``prune`` mode."""
    kind = m.get("kind", configs.DEFAULT_KIND)
    if kind not in configs.KINDS:
        raise SweepError(f"{at('kind')}: kind must be one of {', '.join(configs.KINDS)}, got {kind!r}")
    names = _knob_names(kind)
    for key in m:
        if key not in _NOT_KNOBS and key not in names:
            what = "config key" if kind == configs.DEFAULT_KIND else f"{kind} config key"
            raise SweepError(f"{at(key)}: unknown {what} {key!r}; valid keys: {', '.join(names)} (and 'prune', 'kind')")
    prune = m.get("prune", "none")
    if prune is None or prune is False:
        prune = "none"
    if prune not in PRUNE_MODES:
        raise SweepError(f"{at('prune')}: prune must be one of {', '.join(PRUNE_MODES)}, got {prune!r}")
    if prune != "none" and kind != configs.DEFAULT_KIND:
        raise SweepError(f"{at('prune')}: prune: {prune} applies the forward's tuning heuristics; a {kind} sweep has none")
    return kind, prune


def _expand_mapping(m: dict, source: str, line: int, out: _Collector) -> None:
    key_lines = getattr(m, "key_lines", {})
    at = lambda key: f"{source}:{key_lines.get(key, line)}"  # noqa: E731
    kind, prune = _kind_and_prune(m, at)
    axes: list[tuple[str, list]] = []
    for key, value in m.items():
        if key in _NOT_KNOBS:
            continue
        if isinstance(value, list):
            if not value:
                raise SweepError(f"{at(key)}: {key}: an empty list sweeps nothing; give at least one value")
            for v in value:
                if isinstance(v, (list, dict)):
                    raise SweepError(f"{at(key)}: {key}: a swept value must be a scalar, got {v!r}")
            axes.append((key, list(value)))
        elif isinstance(value, dict):
            raise SweepError(f"{at(key)}: {key}: expected a value or a list of values, got a mapping")
        else:
            axes.append((key, [value]))
    total = 1
    for _, values in axes:
        total *= len(values)
    if total > MAX_COMBINATIONS:
        raise SweepError(f"{source}:{line}: the sweep has {total} combinations (more than {MAX_COMBINATIONS})")
    where = f"{source}:{line}"
    names = [k for k, _ in axes]
    for values in itertools.product(*(v for _, v in axes)):
        knobs = dict(zip(names, values))
        try:
            cfg = configs.KINDS[kind].from_dict(knobs)
        except (ConfigError, TypeError, ValueError) as exc:  # a knob's value or a rule
            out.skipped.append(Skipped(knobs, where, str(exc)))
            continue
        if prune == "seed" and not is_tuning_candidate(cfg):
            out.skipped.append(Skipped(knobs, where, PRUNED_REASON, pruned=True))
            continue
        out.add(cfg)


def _expand_short_form(text: str, where: str, out: _Collector) -> None:
    from ..dsl.notation import NotationError

    try:
        out.add(configs.parse_short_form(text))
    except NotationError as exc:
        raise SweepError(f"{where}: malformed short form: {exc}") from None
    except ConfigError as exc:
        # the rule's own message: the short form itself is in the knobs already
        rule = exc.__cause__ if isinstance(exc.__cause__, ConfigError) else exc
        out.skipped.append(Skipped({"short_form": " ".join(text.split())}, where, str(rule)))


def _expand(doc: Any, source: str, out: _Collector) -> None:
    if isinstance(doc, dict):
        _expand_mapping(doc, source, _line(doc, 1), out)
    elif isinstance(doc, str):
        _expand_short_form(doc, f"{source}:1", out)
    elif isinstance(doc, list):
        lines = getattr(doc, "item_lines", [])
        if not doc:
            raise SweepError(f"{source}:{_line(doc, 1)}: the list of configs is empty")
        for i, item in enumerate(doc):
            line = lines[i] if i < len(lines) else _line(doc, 1)
            if isinstance(item, dict):
                _expand_mapping(item, source, line, out)
            elif isinstance(item, str):
                _expand_short_form(item, f"{source}:{line}", out)
            else:
                raise SweepError(
                    f"{source}:{line}: list item {i + 1} is {_kind(item)}; expected a config mapping "
                    "or a short-form string"
                )
    else:
        raise SweepError(
            f"{source}: expected a config mapping, a list of configs, or a sweep; got {_kind(doc)}"
        )


def parse_sweep(text: str, source: str = "<string>") -> SweepResult:
    """Configs and skipped combinations of a YAML text (see the module docstring)."""
    out = _Collector()
    _expand(_load_yaml(text, source), source, out)
    return out.result()


def load_sweep(path: "str | Path") -> SweepResult:
    """:func:`parse_sweep` of a file; SweepError when it cannot be read."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SweepError(f"{path}: no such config file") from None
    except IsADirectoryError:
        raise SweepError(f"{path}: is a directory, not a config file") from None
    except UnicodeDecodeError as exc:
        raise SweepError(f"{path}: not a UTF-8 text file ({exc.reason})") from None
    except OSError as exc:
        raise SweepError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return parse_sweep(text, str(path))


def resolve(spec: "str | Path") -> SweepResult:
    """A command-line CFG: a named set, a short form, or a YAML file.

    Named sets are :data:`flashgen.dsl.sets.NAMED_SETS`. A short form that is
    malformed raises NotationError; one naming an unbuildable kernel raises ConfigError
    (a single explicit config is not a sweep to skip from).
    """
    from ..dsl.sets import NAMED_SETS, did_you_mean, listing

    text = str(spec).strip()
    if text in NAMED_SETS:
        return SweepResult(tuple(dict.fromkeys(NAMED_SETS[text]())))
    if text.startswith("(") or configs.is_backward_text(text):
        return SweepResult((configs.parse_short_form(text),))
    path = Path(text)
    if path.exists():
        return load_sweep(path)
    if path.suffix in (".yaml", ".yml"):
        raise SweepError(f"{path}: no such config file{did_you_mean(text)}")
    raise SweepError(
        f"{text!r} is not a config file, a short form like '(FP16, 128, 128, 64, 4): async+eager+swizzled+"
        f"load_2_2_2_tiles+buffer+opt_softmax', or a named set ({listing()}){did_you_mean(text)}"
    )


def merge(results: Iterable[SweepResult]) -> SweepResult:
    """Several results as one (configs deduplicated across them, first seen first)."""
    out = _Collector()
    for r in results:
        out.duplicates += r.duplicates
        out.skipped.extend(r.skipped)
        for cfg in r.configs:
            out.add(cfg)
    return out.result()
