"""The score_mod and mask_mod one kernel is built with, and how their values reach it.

A kernel's plan holds one :class:`KernelMods` (in its score mask). It renders the C++ the
kernel needs (the helpers once, each mod's argument struct and function), the kernel
parameters that carry the values, and the host code that fills them from the launcher's
flat list of 64-bit words; :meth:`KernelMods.pack` makes that list's parts in Python.

Word order (one definition, used by both sides): every scalar of the score mod, then every
scalar of the mask mod (float bits, int or bool, one word each); then every tensor of the
score mod, then every tensor of the mask mod, each as its data pointer followed by its
strides in elements. The launcher appends the tensors' words itself (from the tensors, so a
traced call takes them as graph inputs), the scalars come first as numbers.
"""
from __future__ import annotations

import functools
import hashlib
import struct
from typing import Any

import attrs

from .bias import bias_over_scale
from .cpp import CPP_TYPE, function_cpp, struct_cpp
from .expr import BOOL, FLOAT, const
from .grad import derivative, is_one, reads_score
from .ops import HELPERS
from .ranges import INDEX_LIMIT, has_split_casts
from .traced import ModArgs, TracedMod


@attrs.frozen
class KernelMods:
    """``score``: a ``score_mod`` TracedMod or None; ``mask``: a ``mask_mod`` TracedMod or None."""

    score: "TracedMod | None" = None
    mask: "TracedMod | None" = None

    def __attrs_post_init__(self) -> None:
        for kind, mod in (("score", self.score), ("mask", self.mask)):
            if mod is not None and mod.kind != kind:
                raise ValueError(f"a {mod.kind}_mod given as the {kind}_mod")
        if self.score is None and self.mask is None:
            raise ValueError("KernelMods without a score_mod or a mask_mod: use no KernelMods")

    @property
    def mods(self) -> tuple[TracedMod, ...]:
        return tuple(m for m in (self.score, self.mask) if m is not None)

    @property
    def key(self) -> str:
        """What the kernel's text depends on: the structure of each mod (not its captured values)."""
        return f"score={self.score.key if self.score else '-'} mask={self.mask.key if self.mask else '-'}"

    def kernel_name(self, base: str) -> str:
        """The name of the kernel of config name ``base`` built with these mods (8 hex digits of :attr:`key`)."""
        return f"{base}_m{hashlib.sha256(self.key.encode()).hexdigest()[:8]}"

    @property
    def n_words(self) -> int:
        return sum(len(m.scalars) + sum(1 + t.rank for t in m.tensors) for m in self.mods)

    @property
    def index_limit(self) -> "int | None":
        """The longest sequence the kernel takes (its conversions of index arithmetic split, exact up to there:
        :mod:`flashgen.mods.ranges`), or None: any length."""
        return _index_limit(self)

    @property
    def bias(self):
        """The score_mod's bias over the scale where it adds one to the score (ALiBi, a bias table), as a DAG
        over ``inv_scale`` (:func:`flashgen.mods.bias.bias_over_scale`): the forward kernels start the S
        accumulator at it. None without a score_mod or for one of another form."""
        return _bias(self.score) if self.score is not None else None

    def uses(self, arg: str) -> bool:
        """Whether the mask mod reads its argument ``arg`` ("b" or "h"): the block mask has that dimension."""
        return self.mask is not None and arg in self.mask.arguments_read

    def block_mask_shape(self, batch: int, heads: int, seq_q: int, seq_k: int, B_r: int, B_c: int,
                         transposed: bool = False, tile_order: bool = False) -> tuple[int, ...]:
        """The int32 block mask of a call: per (batch, head, query block) the kept key-block range [lo, hi)
        and a class per key block (0 empty, 1 partial, 2 full); batch/heads 1 where the mask_mod ignores them.
        ``transposed`` (a backward kernel's): per (batch, head, key block) the query-block range, then a class
        per query block. ``tile_order`` (a forward kernel that takes one,
        :func:`flashgen.attention.scheduler.orders_tiles`): those rows flattened, then the launch's tile order
        (a tile per query block, head and batch entry)."""
        n_qb, n_kb = -(-seq_q // B_r), -(-seq_k // B_c)
        rows, classes = (n_kb, n_qb) if transposed else (n_qb, n_kb)
        shape = (batch if self.uses("b") else 1, heads if self.uses("h") else 1, rows, 2 + classes)
        if tile_order and not transposed:
            return (shape[0] * shape[1] * rows * (2 + classes) + n_qb * heads * batch,)
        return shape

    def describe(self) -> str:
        return " + ".join(m.description for m in self.mods)

    def manifest(self) -> dict:
        """What a caller of the emitted C launcher needs (JSON-able): the functions, the ``mod_words`` layout
        (each scalar's word, then each tensor's pointer and strides in elements, score_mod's before
        mask_mod's), their count and the longest sequence the kernel takes (None: any). ``mask_diagonal``: where the
        mask_mod has diagonal conjuncts (:attr:`TracedMod.diagonal`), the top-left ``window`` calls run them as, with
        ``rest``, the mask_mod those calls compile (None: none, they run the built-in masked kernel); this kernel
        holds the whole mask_mod, right for any window its caller passes."""
        words, w = [], 0
        for m in self.mods:
            for s in m.scalars:
                words.append({"word": w, "mod": m.kind, "field": s.name, "variable": s.source.name, "dtype": s.dtype,
                              "holds": "fp32 bits" if s.dtype == FLOAT else "the value"})
                w += 1
        for m in self.mods:
            for t in m.tensors:
                words.append({"word": w, "mod": m.kind, "field": t.name, "variable": t.source.name, "dtype": t.dtype,
                              "holds": f"the address, then {t.rank} stride(s) in elements"})
                w += 1 + t.rank
        return {"score_mod": self.score.description if self.score else None,
                "mask_mod": self.mask.description if self.mask else None,
                "key": self.key, "n_mod_words": self.n_words, "mod_words": words, "max_seq": self.index_limit,
                "mask_diagonal": _diagonal_manifest(self.mask)}

    def score_derivative(self):
        """``d score_mod / d score`` (:func:`flashgen.mods.grad.derivative`; None: 0, or no score_mod)."""
        return derivative(self.score.expr) if self.score is not None else None

    @property
    def derivative_kind(self) -> str:
        """How the backward applies the score_mod's derivative: "one" (a bias: not at all), "zero" (scores do not
        reach the output: dS is 0), "indices" (a function of b, h, q_idx, kv_idx: evaluated where used) or
        "score" (it reads the score: evaluated where the score is recomputed and kept until dS)."""
        d = self.score_derivative()
        if self.score is None or is_one(d):
            return "one"
        if d is None:
            return "zero"
        return "score" if reads_score(d) else "indices"

    # ---- C++ ---------------------------------------------------------------------------------

    def to_cpp(self, backward: bool = False) -> str:
        """The helpers, then per mod its ``<kind>_mod_args`` struct and ``<kind>_mod`` function; ``backward``:
        also ``score_mod_grad`` (the derivative, same arguments) where the backward evaluates it, else
        ``score_bias`` (:attr:`bias`, same arguments; its captured values read once per tile, ``score_bias_tile_of``)
        where the score_mod adds a bias."""
        parts = [HELPERS, _WORD_FLOAT]
        for m in self.mods:
            name = f"{m.kind}_mod"
            parts += [struct_cpp(name, m.scalars, m.tensors), function_cpp(m.kind, name, m.expr)]
        if not backward and self.bias is not None:
            parts.append("// the score_mod's bias over softmax_scale: where the S accumulator starts (flashgen.mods.bias)")
            parts.append(function_cpp("bias", "score_bias", self.bias, args="score_mod_args", per_tile=True))
        if backward and self.derivative_kind in ("indices", "score"):
            parts.append("// d score_mod / d score (flashgen.mods.grad)")
            parts.append(function_cpp("score", "score_mod_grad", self.score_derivative(), args="score_mod_args"))
        return "\n".join(parts)

    def params_cpp(self, backward: bool = False) -> list[str]:
        """The kernel parameters holding the values (fields of the kernel's Params struct; ``backward``: a backward
        kernel's, which holds no bias scale)."""
        out = [f"{m.kind}_mod_args {m.kind}_args;  // {m.description}" for m in self.mods]
        if self.score is not None:
            out.append("float mod_scale;  // softmax_scale: score_mod sees the scaled score")
        if self.bias is not None and not backward:
            out.append("float bias_scale;  // 1 / softmax_scale: the forward's S accumulator starts at the bias times it")
        if self.mask is not None:
            out.append("const int* block_mask;  // the mask_mod's block mask (block_mask_row), or nullptr")
        return out

    def fill_cpp(self, p: str = "p", a: str = "a", backward: bool = False, scales: bool = True) -> list[str]:
        """Host lines filling ``p``'s mod parameters from ``a->mod_words`` (false return: wrong count).
        With a score_mod the softmax runs on its results as they are: scale_log2 is log2(e) (the score_mod saw
        the scale); the forward's scale is 1, the backward's stays softmax_scale (d score / d (q k) = scale,
        applied to dK and dQ as they are written). Except in the forward of a score_mod that adds a bias
        (:attr:`bias`): its softmax takes the accumulator, which holds the bias over the scale, at the usual
        scale. ``scales`` False: the values alone (the block mask's kernels, which run no softmax and whose
        arguments carry no softmax_scale)."""
        lines = [f"if ({a}->n_mod_words != {self.n_words} || ({self.n_words} && {a}->mod_words == nullptr))",
                 "    return (int)cudaErrorInvalidValue;  // the launcher passes the words of flashgen.mods.KernelMods"]
        if self.index_limit is not None:
            lines += [f"if ({a}->seq_q > {self.index_limit} || {a}->seq_k > {self.index_limit})",
                      "    return (int)cudaErrorInvalidValue;  // split index conversions are exact for shorter sequences"]
        w = 0
        for m in self.mods:
            for s in m.scalars:
                lines.append(f"{p}.{m.kind}_args.{s.name} = {_from_word(s.dtype, f'{a}->mod_words[{w}]')};")
                w += 1
        for m in self.mods:
            for t in m.tensors:
                lines.append(f"{p}.{m.kind}_args.{t.name} = reinterpret_cast<const {CPP_TYPE[t.dtype]}*>({a}->mod_words[{w}]);")
                lines += [f"{p}.{m.kind}_args.{t.name}_s{d} = int({a}->mod_words[{w + 1 + d}]);" for d in range(t.rank)]
                w += 1 + t.rank
        if scales:
            lines += self._scales_cpp(p, a, backward)
        if self.mask is not None:
            lines.append(f"{p}.block_mask = {a}->block_mask;")
        return lines

    def _scales_cpp(self, p: str, a: str, backward: bool) -> list[str]:
        """:meth:`fill_cpp`'s scale lines (a score_mod only)."""
        if self.score is None:
            return []
        if backward or self.bias is None:
            scale = "" if backward else f" {p}.scale = 1.f;"
            return [f"{p}.mod_scale = {a}->softmax_scale;{scale} {p}.scale_log2 = 1.4426950408889634f;"]
        return [f"{p}.mod_scale = {a}->softmax_scale;", f"{p}.bias_scale = 1.f / {a}->softmax_scale;",
                f"if (!std::isfinite({p}.bias_scale)) return (int)cudaErrorInvalidValue;  // the bias over a scale of 0"]

    # ---- values --------------------------------------------------------------------------------

    def pack(self, score_args: "ModArgs | None", mask_args: "ModArgs | None") -> tuple[list[int], list[Any]]:
        """(scalar words, tensors) of one call in the launcher's order; the tensors' words (pointer,
        strides) are the launcher's to append."""
        words, tensors = [], []
        pairs = [(m, score_args if m.kind == "score" else mask_args) for m in self.mods]
        for m, args in pairs:
            words += [_to_word(s.dtype, v) for s, v in zip(m.scalars, args.scalars)]
        for m, args in pairs:
            tensors += list(args.tensors)
        return words, tensors


#: a float scalar's word back to the float (host code: the launch function fills the parameters)
_WORD_FLOAT = ("static inline float fg_word_float(long long w) {\n"
               "    const int bits = int(w); float f; __builtin_memcpy(&f, &bits, sizeof f); return f;\n}")


def prepare_mods(score_mod: Any = None, mask_mod: Any = None, diagonal: bool = False) -> "tuple[KernelMods | None, tuple]":
    """The KernelMods of a call's functions (each traced once, :func:`flashgen.mods.prepare`) and this call's
    values ``(score ModArgs, mask ModArgs)``; (None, (None, None)) without either function. ``diagonal``: the call
    runs the mask_mod's diagonal conjuncts as the built-in causal / window rule (:attr:`TracedMod.diagonal`), so
    its kernel holds the rest of the mask_mod alone (none where nothing else is left, or where the mask_mod keeps
    every score)."""
    from .cache import prepare

    if score_mod is None and mask_mod is None:
        return None, (None, None)
    for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be a function, got {type(fn).__name__}")
    score, score_args = prepare(score_mod, "score") if score_mod is not None else (None, None)
    mask, mask_args = prepare(mask_mod, "mask") if mask_mod is not None else (None, None)
    if diagonal and mask is not None and mask.diagonal is not None:
        mask = mask.diagonal[1]
        mask_args = mask.bind(mask_mod) if mask is not None else None
    if diagonal and mask is not None and mask.expr == const(True, BOOL):  # keeps every score (FlexAttention's noop_mask)
        mask = mask_args = None
    if score is None and mask is None:
        return None, (None, None)
    return KernelMods(score, mask), (score_args, mask_args)


@functools.lru_cache(maxsize=256)
def _bias(score: TracedMod):
    return bias_over_scale(score.expr)


@functools.lru_cache(maxsize=256)
def _index_limit(mods: KernelMods) -> "int | None":
    return INDEX_LIMIT if has_split_casts([m.expr for m in mods.mods] + [mods.score_derivative()]) else None


def _diagonal_manifest(mask: "TracedMod | None") -> "dict | None":
    """:meth:`KernelMods.manifest`'s ``mask_diagonal`` entry."""
    found = mask.diagonal if mask is not None else None
    if found is None:
        return None
    diagonal, rest = found
    return {"window": list(diagonal.window), "align": "top_left", "rest": rest.description if rest is not None else None}


def _to_word(dtype: str, value) -> int:
    if dtype == FLOAT:
        return struct.unpack("<i", struct.pack("<f", value))[0]
    return int(value)


def _from_word(dtype: str, word: str) -> str:
    if dtype == FLOAT:
        return f"fg_word_float({word})"
    return f"{CPP_TYPE[dtype]}({word})"
