"""The knob table: every knob of a kernel config, once.

A :class:`Knob` says what the knob is (type, allowed values, defaults, the engines it belongs to), how
the short form writes it (its flag), how the mangled kernel name writes it, and what it does. From
:data:`TABLE` come KernelConfig's fields and defaults, ``to_dict``/``from_dict``, the short form in both
directions, ``mangle``, the flag listings of errors and the CLI's knob listing. Adding a knob means
adding its row here and, in :mod:`flashgen.dsl.config`, its validity rule.

Knobs are *common* (every engine has them) or belong to one engine. A config of another engine holds
such a knob at its ``off`` value, the only value it accepts there (a wgmma config's copies are
asynchronous, so its ``async_copy`` is true).
"""
from __future__ import annotations

import functools
import numbers
import re
from typing import Any, Callable, Iterable, Mapping, Union

import attrs

from .dtypes import DType

MMA_SYNC, WGMMA = "mma_sync", "wgmma"
#: wgmma: query rows per consumer warpgroup (the instruction's m64) and warps per warpgroup
WGMMA_M, WARPS_PER_WG = 64, 4


@attrs.frozen
class Engine:
    """A kernel engine as messages and help name it."""

    name: str  #: the ``engine`` knob's value
    label: str  #: ``mma.sync``
    article: str  #: ``an`` (an mma.sync knob)
    summary: str

    @property
    def named(self) -> str:
        return f"{self.article} {self.label}"


ENGINES: tuple[Engine, ...] = (
    Engine(MMA_SYNC, "mma.sync", "an", "the FlashAttention-2 family on mma.sync, sm_80+"),
    Engine(WGMMA, "wgmma", "a", "TMA + wgmma + warp specialization, sm_90a"),
)
#: the engine of a config that names none; its configs leave the other engines' knobs out of their
#: dicts, so the seed family's YAML, names and hashes are the seed's
DEFAULT_ENGINE = ENGINES[0].name
ENGINE_NAMES = tuple(e.name for e in ENGINES)


def engine(name: str) -> Engine:
    return next(e for e in ENGINES if e.name == name)


# ---- spellings: how a knob is written in the short form and in the mangled name -----------------
# A spelling writes the values of the knobs it spells (one, or several that share the spelling object,
# in table order) as one word, or None for nothing.


@attrs.frozen
class Switch:
    """A bool knob: ``on`` when true; ``off`` (or nothing) when false. As a flag: present means true."""

    on: str
    off: str | None = None

    def write(self, values: tuple) -> str | None:
        return self.on if values[0] else self.off

    def words(self, knobs: tuple["Knob", ...]) -> tuple[str, ...]:
        return (self.on,)

    def regex(self, knobs: tuple["Knob", ...]) -> str:
        return re.escape(self.on)

    def read(self, word: str, knobs: tuple["Knob", ...]) -> tuple | None:
        return (True,) if word == self.on else None

    def absent(self, knobs: tuple["Knob", ...]) -> tuple | None:
        return (False,)


@attrs.frozen
class Pattern:
    """Integer knobs written into a format, ``stages_{}`` or ``load_{}_{}_{}_tiles`` (one ``{}`` per
    knob); ``shown`` names it in listings (``stages_N``); ``absent_values``: the values a short form
    without the flag means, None where the flag is required."""

    fmt: str
    shown: str = ""
    absent_values: tuple | None = None

    def write(self, values: tuple) -> str | None:
        return self.fmt.format(*values)

    def words(self, knobs: tuple["Knob", ...]) -> tuple[str, ...]:
        return (self.shown or self.fmt,)

    def regex(self, knobs: tuple["Knob", ...], number: str = "[0-9]+") -> str:
        return number.join(re.escape(part) for part in self.fmt.split("{}"))

    def read(self, word: str, knobs: tuple["Knob", ...]) -> tuple | None:
        m = re.fullmatch(self.regex(knobs, number="([0-9]+)"), word)
        return tuple(int(g) for g in m.groups()) if m else None

    def absent(self, knobs: tuple["Knob", ...]) -> tuple | None:
        return self.absent_values


@attrs.frozen
class Choice:
    """A str knob written as its value, except ``silent`` (the default), which is not written. As
    flags: each other value is one, and at most one of them may be given (``exclusive`` says why)."""

    silent: str
    exclusive: str = ""

    def write(self, values: tuple) -> str | None:
        return None if values[0] == self.silent else values[0]

    def words(self, knobs: tuple["Knob", ...]) -> tuple[str, ...]:
        return tuple(v for v in knobs[0].choices if v != self.silent)

    def regex(self, knobs: tuple["Knob", ...]) -> str:
        return "|".join(re.escape(w) for w in self.words(knobs))

    def read(self, word: str, knobs: tuple["Knob", ...]) -> tuple | None:
        return (word,) if word in self.words(knobs) else None

    def absent(self, knobs: tuple["Knob", ...]) -> tuple | None:
        return (self.silent,)


Spelling = Union[Switch, Pattern, Choice]
#: a default computed from the knobs before it (their values so far), or None where it cannot be
Derived = Callable[[Mapping[str, Any]], Any]


@attrs.frozen(eq=False)  # a row of the table: equal to itself only (and hashable with a mapping default)
class Knob:
    """One knob. ``default``: its value on the engines it belongs to when none is given, or a mapping
    engine -> value (a value may be :data:`Derived`); ``off``: the value configs of the other engines
    hold; ``flag``: its short-form spelling (None: a size of the short form's head); ``mangled``: its
    spelling in the mangled kernel name."""

    name: str
    type: type
    help: str
    default: Any = None
    engines: tuple[str, ...] = ENGINE_NAMES
    off: Any = None
    choices: tuple[str, ...] = ()
    flag: Spelling | None = None
    mangled: Spelling | None = None

    @property
    def common(self) -> bool:
        return set(self.engines) == set(ENGINE_NAMES)

    @property
    def required(self) -> bool:
        return self.default is None

    def default_on(self, engine: str) -> Any:
        """The value a config of ``engine`` takes when none is given (possibly :data:`Derived`)."""
        if engine not in self.engines:
            return self.off
        return self.default.get(engine) if isinstance(self.default, Mapping) else self.default

    def plain(self, value: Any) -> Any:
        """The value as dicts, YAML and hashes hold it (a dtype by its name)."""
        return value.value if isinstance(value, DType) else value


def _wgmma_warps(values: Mapping[str, Any]) -> int | None:
    """One producer and B_r/64 consumer warpgroups of 4 warps."""
    rows = values.get("B_r")
    if isinstance(rows, bool) or not isinstance(rows, numbers.Integral):
        return None
    return WARPS_PER_WG * (1 + int(rows) // WGMMA_M)


# the load flag and its mangled part spell the three tile counts together
_LOAD_FLAG = Pattern("load_{}_{}_{}_tiles", shown="load_Q_K_V_tiles")
_LOAD_NAME = Pattern("q{}k{}v{}")
_MMA = (MMA_SYNC,)
_WG = (WGMMA,)


def _tiles(op: str, reduction: str) -> Knob:
    return Knob(
        f"{op}_mma_load_K_tiles", int,
        f"8-wide k tiles of {op} loaded shared->registers per step, over {reduction} (0: the whole block at once)",
        default=2, engines=_MMA, off=0, flag=_LOAD_FLAG, mangled=_LOAD_NAME,
    )


#: Every knob, in the order of dict and YAML keys (the seed's knobs first).
TABLE: tuple[Knob, ...] = (
    Knob("dtype", DType, "fp16 or bf16 inputs and outputs (fp32 accumulation and softmax)", choices=("fp16", "bf16"),
         mangled=Pattern("{}")),
    Knob("d_head", int, "head dimension", default=128, mangled=Pattern("d{}")),
    Knob("B_r", int, "query rows per CTA", default=128, mangled=Pattern("br{}")),
    Knob("B_c", int, "key/value rows per step of the key loop", default={MMA_SYNC: 64, WGMMA: 128}, mangled=Pattern("bc{}")),
    Knob("n_warps", int, "warps per CTA",
         default={MMA_SYNC: 4, WGMMA: _wgmma_warps}, mangled=Pattern("w{}")),
    Knob("async_copy", bool, "global->shared copies with cp.async instead of synchronous 16-byte copies",
         default=True, engines=_MMA, off=True, flag=Switch("async"), mangled=Switch("async", "sync")),
    Knob("eager_load_blocks", bool, "issue the next V copy before S = Q K^T and the next K copy after it (needs async_copy)",
         default=True, engines=_MMA, off=True, flag=Switch("eager"), mangled=Switch("eager")),
    Knob("swizzled", bool, "XOR-swizzled shared-memory tiles: bank-conflict-free 16-byte stores and ldmatrix loads",
         default=True, engines=_MMA, off=True, flag=Switch("swizzled"), mangled=Switch("swz", "noswz")),
    _tiles("Q", "d_head"),
    _tiles("K", "d_head"),
    _tiles("V", "B_c"),
    Knob("mma_double_buffer_loads", bool, "register double buffering: ldmatrix for step i+1 before the MMAs of step i",
         default=True, engines=_MMA, off=False, flag=Switch("buffer"), mangled=Switch("buf")),
    Knob("optimized_softmax", bool, "scale * log2(e) folded into one FMA, ex2, no rescale of the first block",
         default=True, engines=_MMA, off=True, flag=Switch("opt_softmax"), mangled=Switch("opt")),
    Knob("mask", str, "score mask compiled into the kernel: causal or a sliding window (sizes chosen per call)",
         default="none", choices=("none", "causal", "window"), flag=Choice("none", "a config has one score mask"),
         mangled=Choice("none")),
    Knob("engine", str, "; ".join(f"{e.name}: {e.summary}" for e in ENGINES), default=DEFAULT_ENGINE,
         choices=ENGINE_NAMES, flag=Choice(DEFAULT_ENGINE), mangled=Choice(DEFAULT_ENGINE)),
    Knob("stages", int, "shared-memory stages of the K/V ring that the producer warpgroup fills",
         default=2, engines=_WG, off=1, flag=Pattern("stages_{}", "stages_N", (1,)), mangled=Pattern("s{}")),
    Knob("pingpong", bool, "consumer warpgroups take turns issuing their GEMMs, one's softmax overlapping the others' GEMMs",
         default=True, engines=_WG, off=False, flag=Switch("pingpong"), mangled=Switch("pp")),
    Knob("intra_overlap", bool, "S_j = Q K_j^T and O += P_{j-1} V_{j-1} issued together; the softmax runs under the PV GEMM",
         default=True, engines=_WG, off=False, flag=Switch("intra"), mangled=Switch("intra")),
    Knob("persistent", bool, "one CTA per SM loops over tiles; the output is staged apart from Q",
         default=False, engines=_WG, off=False, flag=Switch("persistent"), mangled=Switch("persist")),
)
KNOB: dict[str, Knob] = {k.name: k for k in TABLE}
ENGINE_KNOB = KNOB["engine"]


# ---- groups: knobs that share one spelling --------------------------------------------------


@attrs.frozen
class Spelled:
    """A spelling with the knobs it writes (several where they share the spelling object)."""

    spelling: Spelling
    knobs: tuple[Knob, ...]

    @property
    def engines(self) -> tuple[str, ...]:
        return self.knobs[0].engines

    @property
    def common(self) -> bool:
        return self.knobs[0].common

    def write(self, values: Mapping[str, Any]) -> str | None:
        return self.spelling.write(tuple(values[k.name] for k in self.knobs))

    def words(self) -> tuple[str, ...]:
        return self.spelling.words(self.knobs)

    def regex(self) -> str:
        return self.spelling.regex(self.knobs)

    def read(self, word: str) -> dict[str, Any] | None:
        values = self.spelling.read(word, self.knobs)
        return None if values is None else dict(zip((k.name for k in self.knobs), values))

    def absent(self) -> dict[str, Any] | None:
        values = self.spelling.absent(self.knobs)
        return None if values is None else dict(zip((k.name for k in self.knobs), values))


def _groups(knobs: Iterable[Knob], slot: str) -> tuple[Spelled, ...]:
    order: dict[int, tuple[Spelling, list[Knob]]] = {}
    for k in knobs:
        spelling = getattr(k, slot)
        if spelling is not None:
            order.setdefault(id(spelling), (spelling, []))[1].append(k)
    return tuple(Spelled(s, tuple(ks)) for s, ks in order.values())


FLAGS: tuple[Spelled, ...] = _groups(TABLE, "flag")
#: the knobs of the short form's head, ``(DTYPE, d_head, B_r, B_c, n_warps)``
HEAD: tuple[Knob, ...] = tuple(k for k in TABLE if k.flag is None)
#: every flag word, in table order (``load_Q_K_V_tiles`` for the tile counts)
FLAG_WORDS: tuple[str, ...] = tuple(w for g in FLAGS for w in g.words())
#: the flag that chooses the engine (``wgmma``; none: the default engine)
ENGINE_FLAG = next(g for g in FLAGS if ENGINE_KNOB in g.knobs)


#: Knobs only the backward kernels have (:class:`flashgen.dsl.backward_config.BackwardConfig`): their
#: flags share the short form's grammar; no forward engine takes them.
BACKWARD_ONLY: tuple[Knob, ...] = (
    Knob("d_split", int, "backward: warps per group that split dK, dV and dQ's columns", default=1, engines=(), off=1,
         flag=Pattern("d_split_{}", "d_split_N", (1,)), mangled=Pattern("ds{}")),
    Knob("dq_split", int, "backward, mma_sync: warps splitting dQ's columns (dQ's own warp grid: n_warps/dq_split rows of "
         "warps down the query block); 0: as d_split", default=0, engines=(), off=0,
         flag=Pattern("dq_split_{}", "dq_split_N", (0,)), mangled=Pattern("dq{}")),
    Knob("deterministic", bool, "backward: dQ's adds from the key blocks in a fixed order, so gradients are "
         "bit-identical run to run", default=False, engines=(), off=False, flag=Switch("deterministic"), mangled=Switch("det")),
    Knob("split_scores", bool, "backward: the warps of a d_split group split S^T and dP^T's query columns and stage P^T "
         "and dS^T in shared memory for dV and dK, instead of each computing the group's whole tiles", default=False,
         engines=(), off=False, flag=Switch("split_scores"), mangled=Switch("ss")),
    Knob("longest_first", bool, "backward: the grid's last (kv head, batch) pairs, about two waves of CTAs, start key block by "
         "key block (a causal mask's longest CTAs of the tail first) instead of each pair's key blocks together", default=False,
         engines=(), off=False, flag=Switch("longest_first"), mangled=Switch("lf")),
    Knob("exp_first", bool, "backward, wgmma, query blocks past 64 rows: the exponentials of P^T while dP^T's wgmma is "
         "in flight, then dS^T, instead of both GEMMs waited for and P^T and dS^T made in one pass", default=False,
         engines=(), off=False, flag=Switch("exp_first"), mangled=Switch("ef")),
)
BACKWARD_FLAGS: tuple[Spelled, ...] = _groups(BACKWARD_ONLY, "flag")


def flag_regex() -> str:
    """One regular expression matching exactly the flag words (each a whole word)."""
    return "(?:" + "|".join(g.regex() for g in FLAGS + BACKWARD_FLAGS) + r")\b"


def read_flag(word: str) -> tuple[Spelled, dict[str, Any]]:
    """The flag a word is and the knob values it sets; KeyError for no flag."""
    for group in FLAGS + BACKWARD_FLAGS:
        values = group.read(word)
        if values is not None:
            return group, values
    raise KeyError(word)


def written_order(engine_name: str) -> list[Knob]:
    """The order knobs are written in, in the short form and the mangled name: the head (dtype and
    sizes), the engine, the engine's own knobs, then the common ones (the mask)."""
    own = [k for k in TABLE if not k.common and engine_name in k.engines]
    rest = [k for k in TABLE if k.common and k.flag is not None and k is not ENGINE_KNOB]
    return [*HEAD, ENGINE_KNOB, *own, *rest]


@functools.cache
def _written(engine_name: str, slot: str) -> tuple[Spelled, ...]:
    return _groups(written_order(engine_name), slot)


def flags(values: Mapping[str, Any]) -> tuple[str, ...]:
    """The short form's flags of a config's knob values, in canonical order."""
    written = (g.write(values) for g in _written(values["engine"], "flag"))
    return tuple(w for w in written if w is not None)


def mangled_parts(values: Mapping[str, Any]) -> list[str]:
    """The parts of the mangled kernel name after ``flash_fwd``."""
    written = (g.write(values) for g in _written(values["engine"], "mangled"))
    return [w for w in written if w is not None]


def engine_flags(engine_name: str) -> str:
    """The flags a short form of this engine takes, for messages: ``wgmma, stages_N, pingpong, intra,
    persistent and a mask flag``."""
    marker = [w for w in ENGINE_FLAG.words() if w == engine_name]
    own = [w for g in FLAGS if not g.common and engine_name in g.engines for w in g.words()]
    common = [g.knobs[0].name for g in FLAGS if g.common and g is not ENGINE_FLAG]
    return ", ".join(marker + own) + "".join(f" and a {name} flag" for name in common)


# ---- dicts -------------------------------------------------------------------------------------


def listed(engine_name: str) -> tuple[Knob, ...]:
    """The knobs of a config's dict (and so of its YAML and hash): every knob, except that a
    default-engine config leaves out the engine and the other engines' knobs."""
    if engine_name == DEFAULT_ENGINE:
        return tuple(k for k in TABLE if DEFAULT_ENGINE in k.engines and k is not ENGINE_KNOB)
    return TABLE


def with_defaults(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with the defaults of its engine for the knobs it leaves out (an unknown engine: as
    given; the config refuses it)."""
    name = data.get("engine", DEFAULT_ENGINE)
    if name not in ENGINE_NAMES:
        return dict(data)
    out = dict(data)
    for k in TABLE:
        if k.name in out or k.required:
            continue
        value = k.default_on(name)
        value = value(out) if callable(value) else value
        if value is not None:
            out[k.name] = value
    return out


def _shown(value: Any) -> str:
    """A default as YAML writes it; a derived one by its docstring."""
    if callable(value):
        doc = value.__doc__.strip().rstrip(".")
        return doc[0].lower() + doc[1:]
    return str(value).lower() if isinstance(value, bool) else str(value)


def describe() -> list[str]:
    """One line per knob for help texts: name, engines (where not common), flag, defaults, help."""
    lines = []
    for k in TABLE:
        where = "" if k.common else f" [{', '.join(engine(e).label for e in k.engines)} only]"
        flag = next((g for g in FLAGS if k in g.knobs), None)
        spelled = f"flag {' / '.join(flag.words())}" if flag else "in the short form's head"
        defaults = {} if k.required else {engine(e).label: _shown(k.default_on(e)) for e in k.engines}
        if len(set(defaults.values())) == 1:
            spelled += f"; default {next(iter(defaults.values()))}"
        elif defaults:
            spelled += "; default " + ", ".join(f"{e}: {v}" for e, v in defaults.items())
        lines.append(f"{k.name}{where} ({spelled}): {k.help}")
    return lines
