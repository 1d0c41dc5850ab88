"""KernelConfig: every knob of the FlashAttention-2 forward kernel family.

A config is a frozen, validated value whose fields are the rows of the knob table
(:mod:`flashgen.dsl.knobs`): common knobs and each engine's own, a knob of another engine
held at its ``off`` value. Validity rules (what can be built) are enforced at
construction; the seed's *tuning heuristics* (what is worth timing) live apart in
:func:`is_tuning_candidate` and never make a config invalid.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import json
import numbers
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import attrs

from . import knobs, short_form
from .dtypes import DType
from .knobs import ENGINE_KNOB, KNOB, MMA_SYNC, TABLE, WARPS_PER_WG, WGMMA, WGMMA_M, Knob

#: Knob names of a default-engine (mma.sync) config's dict, in order: the seed's knobs and the mask.
KNOBS: tuple[str, ...] = tuple(k.name for k in knobs.listed(knobs.DEFAULT_ENGINE))
#: The other knobs (the engine and the wgmma engine's), in a wgmma config's dict after :data:`KNOBS`.
HOPPER_KNOBS: tuple[str, ...] = tuple(k.name for k in TABLE if k.name not in KNOBS)
ENGINES = knobs.ENGINE_NAMES
MASKS = KNOB["mask"].choices
WARPGROUP = 32 * WARPS_PER_WG  # threads of one warpgroup (wgmma's unit)
#: log2(e): the softmax runs on exp2 with the scale folded in (scale * LOG2E, rounded to fp32),
#: one literal for the emitted kernels and the simulators
LOG2E = 1.4426950408889634

MMA_M, MMA_N, MMA_K = 16, 8, 16  # m16n8k16
FRAG_K = 8  # one "k tile" = 8 columns of the reduction dimension (one 8x8 ldmatrix matrix)
SWIZZLE_TILE_COLS = 64  # shared-memory tiles are 64 elements (128 bytes) wide
SMEM_LIMIT_BYTES = 227 * 1024  # opt-in dynamic shared memory per block on sm_90 (sm_80: 163 KiB)
REGS_PER_SM = 65536
SMEM_PER_SM = 228 * 1024


class ConfigError(ValueError):
    """A knob value or a combination of knob values that cannot be built."""


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigError(f"{name} must be true or false, got {value!r}")


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _dtype(value: Any) -> DType:
    try:
        return DType.parse(value)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _field(knob: Knob):
    """The attrs field of a knob: default of the default engine; ints and dtypes converted on the way
    in, bools checked after every conversion (attrs runs validators once all fields are set)."""
    default = attrs.NOTHING if knob.required else knob.default_on(knobs.DEFAULT_ENGINE)
    if knob.type is DType:
        return attrs.field(default=default, converter=_dtype)
    if knob.type is int:
        return attrs.field(default=default, converter=functools.partial(_int, knob.name))
    if knob.type is bool:
        return attrs.field(default=default, validator=lambda _, a, v: _bool(a.name, v))
    return attrs.field(default=default)


def smem_cols(d_head: int) -> int:
    """Columns of a shared-memory tile of ``d_head``: rounded up to 64, 128 or 256 (whole 64-wide
    swizzle blocks, a power-of-two count so 16-byte chunks split evenly over the threads)."""
    blocks = -(-d_head // SWIZZLE_TILE_COLS)
    return SWIZZLE_TILE_COLS * (1 << (blocks - 1).bit_length())


def mma_cols(d_head: int) -> int:
    """``d_head`` rounded up to the MMA's k16 (the columns past d_head are zero-filled)."""
    return -(-d_head // MMA_K) * MMA_K


@attrs.frozen(order=False, these={k.name: _field(k) for k in TABLE})
class KernelConfig:
    """One FlashAttention forward kernel: one field per row of :data:`flashgen.dsl.knobs.TABLE`.

    Block sizes ``B_r`` x ``B_c`` over ``n_warps`` warps and the score mask are common; the
    mma.sync engine adds copy and pipelining switches and how many 8-wide k tiles each operand
    loads shared->registers per step (0 = the whole block at once); the wgmma engine adds the K/V
    ring's ``stages`` and its overlap switches (``pingpong``, ``intra_overlap``, ``persistent``).
    """

    @classmethod
    def wgmma(cls, dtype: Any, **knobs_: Any) -> "KernelConfig":
        """A Hopper-engine config: the wgmma defaults for the knobs not given (``n_warps`` follows from
        ``B_r``: one producer + B_r/64 consumer warpgroups)."""
        return cls.from_dict({"dtype": dtype, **knobs_, "engine": WGMMA})

    @property
    def is_wgmma(self) -> bool:
        return self.engine == WGMMA

    @property
    def consumers(self) -> int:
        """wgmma: consumer warpgroups (64 query rows each)."""
        return self.B_r // WGMMA_M

    @property
    def fragment_regs(self) -> int:
        """wgmma: 32-bit registers a consumer thread holds for the O and S accumulators and P's A fragments."""
        return self.d_head // 2 + self.B_c // 2 + self.B_c // 4

    @property
    def register_budget(self) -> int:
        """wgmma: registers a consumer thread may give to fragments (setmaxnreg's share less room for
        addresses, loop state and softmax temporaries)."""
        return consumer_regs(self.consumers) - REGISTER_MARGIN

    @property
    def q_in_registers(self) -> bool:
        """wgmma: Q's A fragments (d_head / 4 registers) are loaded once per tile (ldmatrix) and S = Q K^T
        reads A from registers, when they fit the budget: Q is then not re-read from shared memory for
        every key block (1-2% on an H100 at B_c 128, docs/results/q_registers_h100.txt)."""
        return self.fragment_regs + self.d_head // 4 <= self.register_budget

    def __attrs_post_init__(self) -> None:
        # the engine first (what else is valid depends on it), then the other engines' knobs at their
        # off values, the allowed values, and last the engine's own rules
        _check_choice(ENGINE_KNOB, self.engine)
        for knob in TABLE:
            value = getattr(self, knob.name)
            if self.engine not in knob.engines and value != knob.off:
                raise ConfigError(f"{knob.name}={value!r} is {knobs.engine(knob.engines[0]).named} knob; "
                                  f"an engine={self.engine} config fixes it at {knob.off!r}")
        for knob in TABLE:
            if knob.type is str and knob is not ENGINE_KNOB:
                _check_choice(knob, getattr(self, knob.name))
        for rule in _RULES[self.engine]:
            rule(self)

    # ---- derived sizes -------------------------------------------------------------
    @property
    def threads(self) -> int:
        return 32 * self.n_warps

    @property
    def rows_per_warp(self) -> int:
        """Query rows (of Q, S, P and O) owned by one warp."""
        return self.B_r // self.n_warps

    @property
    def m_tiles_per_warp(self) -> int:
        """16-row MMA tiles per warp."""
        return self.rows_per_warp // MMA_M

    @property
    def d_smem(self) -> int:
        """Columns of a shared-memory tile: d_head rounded up to 64, 128 or 256 (whole 64-wide
        swizzle blocks, a power-of-two count so 16-byte chunks split evenly over the threads)."""
        return smem_cols(self.d_head)

    @property
    def d_mma(self) -> int:
        """d_head rounded up to the MMA's k16; columns in [d_head, d_mma) are zero-filled."""
        return mma_cols(self.d_head)

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: one Q, one K and one V block (O reuses Q's space); wgmma: Q,
        ``stages`` K and V blocks (persistent: and an output tile apart from Q), the mbarriers
        and 1 KiB to align the base for the 128B swizzle."""
        if self.is_wgmma:
            rows = (2 if self.persistent else 1) * self.B_r + 2 * self.stages * self.B_c
            barriers = 1 + 4 * self.stages + (1 if self.persistent else 0)
            return rows * self.d_head * self.dtype.size + 8 * barriers + 1024
        return (self.B_r + 2 * self.B_c) * self.d_smem * self.dtype.size

    def k_tiles(self, operand: str) -> int:
        """Total 8-wide k tiles of an operand's reduction dimension (Q/K: d_mma, V: B_c)."""
        return (self.B_c if operand == "V" else self.d_mma) // FRAG_K

    def load_k_tiles(self, operand: str) -> int:
        """k tiles loaded shared->registers per step for operand Q, K or V (0 resolved to all)."""
        n = getattr(self, f"{operand}_mma_load_K_tiles")
        return n if n else self.k_tiles(operand)

    def rf_buffers(self, operand: str) -> int:
        """Register tile buffers for an operand: 2 when double-buffered, else 1."""
        whole = getattr(self, f"{operand}_mma_load_K_tiles") == 0
        return 1 if whole or not self.mma_double_buffer_loads else 2

    def rf_tile_regs(self, operand: str) -> int:
        """32-bit registers per thread holding one operand's register tile(s)."""
        rows = {"Q": self.rows_per_warp, "K": self.B_c, "V": self.d_mma}[operand]
        elems = rows * self.load_k_tiles(operand) * FRAG_K * self.rf_buffers(operand)
        return elems * self.dtype.size // 4 // 32

    @property
    def register_estimate(self) -> int:
        """Rough registers per thread: accumulators + operand tiles + ~40 for addresses and softmax."""
        o_acc = self.rows_per_warp * self.d_mma // 32
        s_acc = self.rows_per_warp * self.B_c // 32
        tiles = sum(self.rf_tile_regs(op) for op in "QKV")
        return o_acc + s_acc + tiles + 40

    @property
    def ctas_per_sm_estimate(self) -> int:
        """CTAs per SM allowed by shared memory and the register estimate (H100/H200)."""
        by_smem = SMEM_PER_SM // (self.smem_bytes + 1024)
        regs = min(255, -(-self.register_estimate // 8) * 8)
        by_regs = REGS_PER_SM // (regs * self.threads)
        return max(0, min(by_smem, by_regs, 64 // self.n_warps))

    # ---- names ----------------------------------------------------------------------
    def _values(self) -> dict[str, Any]:
        return {k.name: getattr(self, k.name) for k in TABLE}

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the knobs in table order (dtype as its name); an mma.sync config leaves out the
        engine and the wgmma knobs (:func:`flashgen.dsl.knobs.listed`)."""
        return {k.name: k.plain(getattr(self, k.name)) for k in knobs.listed(self.engine)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "KernelConfig":
        """Build from a mapping with knob-name keys; unknown keys are an error. A knob left out takes
        the default of the config's engine (``engine``, else mma_sync)."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"a kernel config must be a mapping of knob names, got {type(data).__name__}")
        unknown = sorted(set(data) - set(KNOB))
        if unknown:
            raise ConfigError(f"unknown config key(s) {unknown}; valid keys: {', '.join(KNOB)}")
        for knob in TABLE:
            if knob.required and knob.name not in data:
                raise ConfigError(f"config is missing '{knob.name}' ({' or '.join(knob.choices)})")
        return cls(**knobs.with_defaults(data))

    @classmethod
    def from_short_form(cls, text: str) -> "KernelConfig":
        """The short form (:mod:`flashgen.dsl.short_form`) -> KernelConfig: NotationError for a malformed
        text, ConfigError (starting with the short form) for a kernel that cannot be built."""
        values = short_form.values(text)
        try:
            return cls.from_dict(values)
        except ConfigError as e:
            raise ConfigError(f"invalid kernel config '{' '.join(text.split())}': {e}") from e

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> "KernelConfig":
        import yaml

        return cls.from_dict(yaml.safe_load(text))

    def replace(self, **changes: Any) -> "KernelConfig":
        return attrs.evolve(self, **changes)

    @property
    def flags(self) -> tuple[str, ...]:
        """The short form's flags, in canonical order."""
        return knobs.flags(self._values())

    def short_form(self) -> str:
        """The seed's notation, e.g. ``(FP16, 128, 64, 64, 4): async+eager+swizzled+load_0_2_2_tiles``."""
        return short_form.render(self._values())

    def __str__(self) -> str:
        return self.short_form()

    def mangle(self) -> str:
        """A deterministic C identifier naming this config (also the .cu file stem)."""
        return "_".join(["flash_fwd", *knobs.mangled_parts(self._values())])

    def content_hash(self) -> str:
        """sha256 (16 hex digits) of the canonical JSON of the knobs."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


# ---- validity rules (each names itself and the values) ---------------------------------


def _check_choice(knob: Knob, value: Any) -> None:
    if value not in knob.choices:
        raise ConfigError(f"{knob.name}={value!r}: expected one of {', '.join(knob.choices)}")


def _rule_sizes(c: KernelConfig) -> None:
    if c.d_head <= 0 or c.d_head % 8 or c.d_head > 256:
        raise ConfigError(
            f"d_head={c.d_head}: must be a multiple of 8 between 8 and 256 "
            "(rows move in 16-byte vectors; larger heads exceed the register file)"
        )
    if not _is_pow2(c.n_warps) or c.n_warps > 16:
        raise ConfigError(f"n_warps={c.n_warps}: must be a power of two between 1 and 16")
    if c.B_r <= 0 or c.B_r % (MMA_M * c.n_warps):
        raise ConfigError(
            f"B_r={c.B_r} with n_warps={c.n_warps}: each warp owns B_r/n_warps rows, "
            f"which must be a positive multiple of the MMA's {MMA_M} rows"
        )
    if c.B_c <= 0 or c.B_c % 16:
        raise ConfigError(f"B_c={c.B_c}: must be a positive multiple of 16 (an ldmatrix.x4 covers 16 key rows)")
    chunks = c.B_c * c.d_smem // 8
    if chunks % c.threads:
        raise ConfigError(
            f"B_c={c.B_c}, d_head={c.d_head}, n_warps={c.n_warps}: the K/V block's {chunks} 16-byte chunks "
            f"must split evenly over the CTA's {c.threads} threads"
        )
    acc = (c.rows_per_warp * (c.d_mma + c.B_c) // 32)
    if acc > 224:
        raise ConfigError(
            f"d_head={c.d_head}, B_r={c.B_r}, B_c={c.B_c}, n_warps={c.n_warps}: the O and S accumulators alone need "
            f"{acc} registers per thread (> 224 of 255); use fewer rows per warp (smaller B_r or more warps) or a smaller B_c"
        )


def _rule_eager(c: KernelConfig) -> None:
    if c.eager_load_blocks and not c.async_copy:
        raise ConfigError("eager_load_blocks=true needs async_copy=true (eager loads overlap cp.async copies with math)")


def _rule_tile_counts(c: KernelConfig) -> None:
    for op in "QKV":
        n = getattr(c, f"{op}_mma_load_K_tiles")
        total = c.k_tiles(op)
        red = "d_head (rounded up to 16)" if op != "V" else "B_c"
        name = f"{op}_mma_load_K_tiles"
        if n < 0:
            raise ConfigError(f"{name}={n}: must be 0 (whole block) or a power of two >= 2")
        if n == 0:
            continue
        if n < 2 or not _is_pow2(n):
            raise ConfigError(
                f"{name}={n}: must be 0 (whole block) or a power of two >= 2 "
                f"(an m16n8k16 MMA consumes 2 k tiles of 8 columns)"
            )
        limit = total // 2 if c.mma_double_buffer_loads else total
        if n > limit:
            why = " (halved under mma_double_buffer_loads: two buffers must fit the block)" if c.mma_double_buffer_loads else ""
            raise ConfigError(f"{name}={n}: at most {limit} = {red}/8{'/2' if c.mma_double_buffer_loads else ''}{why}")
        if total % n:
            raise ConfigError(f"{name}={n}: {n} k tiles of 8 must divide the {total * 8} columns of {red}")
    if c.Q_mma_load_K_tiles and c.Q_mma_load_K_tiles != c.K_mma_load_K_tiles:
        raise ConfigError(
            f"Q_mma_load_K_tiles={c.Q_mma_load_K_tiles}, K_mma_load_K_tiles={c.K_mma_load_K_tiles}: "
            "a non-zero Q tile count must equal the K tile count (Q and K are loaded in lock-step)"
        )


def _rule_smem(c: KernelConfig) -> None:
    if c.smem_bytes > SMEM_LIMIT_BYTES:
        raise ConfigError(
            f"shared memory (B_r + 2*B_c) * {c.d_smem} columns * {c.dtype.size} = {c.smem_bytes} bytes exceeds the "
            f"{SMEM_LIMIT_BYTES}-byte per-block limit"
        )



# ---- wgmma engine rules ----------------------------------------------------------------

#: Registers a producer warpgroup keeps after ``setmaxnreg.dec`` (it only issues TMA copies).
PRODUCER_REGS = 24
#: Registers of a consumer thread kept for addresses, loop state and softmax temporaries (the rest may
#: hold fragments; past it ptxas spills or serializes wgmma).
REGISTER_MARGIN = 40


#: registers are allocated to threads (and moved by setmaxnreg) in multiples of this
REG_ALLOC_UNIT = 8


def launch_regs(threads: int) -> int:
    """Registers per thread a one-CTA-per-SM kernel of ``threads`` threads launches with: ptxas caps it
    at REGS_PER_SM / threads in allocation units (384 threads: 168, so the CTA holds 64,512 of 65,536)."""
    return min(256, REGS_PER_SM // threads // REG_ALLOC_UNIT * REG_ALLOC_UNIT)


def consumer_regs(consumers: int) -> int:
    """Registers per consumer thread after ``setmaxnreg.inc``: the CTA's launch allocation less what the
    producer keeps, split evenly. The pool is the launch allocation, not the SM's register file:
    ``setmaxnreg.inc`` waits until the pool holds what it asks for, so asking for more never returns
    (with two consumers a 32-register producer would leave 236, not 240)."""
    threads = WARPGROUP * (1 + consumers)
    pool = launch_regs(threads) * threads
    per = (pool - WARPGROUP * PRODUCER_REGS) // (WARPGROUP * consumers)
    return min(256, per // REG_ALLOC_UNIT * REG_ALLOC_UNIT)


def _wgmma_rule_sizes(c: KernelConfig) -> None:
    if c.d_head <= 0 or c.d_head % 64 or c.d_head > 256:
        raise ConfigError(
            f"d_head={c.d_head}: the wgmma engine takes d_head 64, 128, 192 or 256 (whole 128-byte swizzle "
            "atoms of 64 columns per TMA box); use engine=mma_sync for other head sizes"
        )
    if c.B_r <= 0 or c.B_r % WGMMA_M or not 1 <= c.B_r // WGMMA_M <= 3:
        raise ConfigError(f"B_r={c.B_r}: the wgmma engine gives each consumer warpgroup {WGMMA_M} query rows; B_r must be 64, 128 or 192")
    want = 4 * (1 + c.consumers)
    if c.n_warps != want:
        raise ConfigError(f"n_warps={c.n_warps}: B_r={c.B_r} means 1 producer + {c.consumers} consumer warpgroups = {want} warps")
    if c.B_c <= 0 or c.B_c % 16 or c.B_c > 256:
        raise ConfigError(f"B_c={c.B_c}: must be a multiple of 16 in 16..256 (wgmma N of S = Q K^T, k16 steps of P V, a TMA box)")
    if not 1 <= c.stages <= 4:
        raise ConfigError(f"stages={c.stages}: the K/V ring takes 1 to 4 stages")
    if c.pingpong and c.consumers < 2:
        raise ConfigError(f"pingpong=true passes the tensor cores between consumer warpgroups; B_r={c.B_r} has one")
    regs, budget = c.fragment_regs, c.register_budget  # O and S accumulators, P fragments (32-bit each)
    if regs > budget:
        raise ConfigError(
            f"d_head={c.d_head}, B_c={c.B_c}: O ({c.d_head // 2}) + S ({c.B_c // 2}) + P ({c.B_c // 4}) = {regs} registers per "
            f"consumer thread exceed {budget} (the {consumer_regs(c.consumers)} a consumer gets with {c.consumers} consumer "
            "warpgroups, less room for addresses and softmax); use a smaller B_c or fewer consumers"
        )
    if c.smem_bytes > SMEM_LIMIT_BYTES:
        raise ConfigError(
            f"shared memory ({'2 * B_r' if c.persistent else 'B_r'} + 2 * stages * B_c) * d_head * {c.dtype.size} + barriers "
            f"+ alignment = {c.smem_bytes} bytes exceeds the {SMEM_LIMIT_BYTES}-byte per-block limit; use fewer stages or a "
            f"smaller B_c{' (persistent=true stages the output apart from Q)' if c.persistent else ''}"
        )


#: Each engine's validity rules, run in order once the knobs' own checks pass.
_RULES: dict[str, tuple[Callable[[KernelConfig], None], ...]] = {
    MMA_SYNC: (_rule_sizes, _rule_eager, _rule_tile_counts, _rule_smem),
    WGMMA: (_wgmma_rule_sizes,),
}


# ---- the seed's config sets ------------------------------------------------------------


def is_tuning_candidate(c: KernelConfig) -> bool:
    """The seed's pruning of its tuning space (register pressure / speed heuristics).

    Not a validity rule: a config rejected here still builds and is correct.
    """
    if c.B_r == 64:
        if c.n_warps == 8:
            return False
        if c.B_c == 32 and c.Q_mma_load_K_tiles == 0:
            return False
        if c.B_c == 64 and c.Q_mma_load_K_tiles != 0:
            return False
    elif c.B_r == 128 and c.Q_mma_load_K_tiles == 0:
        return False
    return True


def _valid_product(space: Mapping[str, Iterable[Any]]) -> list[KernelConfig]:
    keys = list(space)
    out = []
    for values in itertools.product(*(space[k] for k in keys)):
        try:
            out.append(KernelConfig(**dict(zip(keys, values))))
        except ConfigError:
            continue
    return out


def tuning_space(dtypes: Iterable[DType | str] = ("bf16", "fp16")) -> list[KernelConfig]:
    """The seed's autotuning space: valid configs of its product that pass the pruning."""
    space = {
        "dtype": [DType.parse(d) for d in dtypes],
        "d_head": [128],
        "B_r": [64, 128],
        "B_c": [32, 64],
        "n_warps": [4],
        "async_copy": [True],
        "eager_load_blocks": [True],
        "swizzled": [True],
        "Q_mma_load_K_tiles": [0, 2],
        "K_mma_load_K_tiles": [0, 2],
        "V_mma_load_K_tiles": [0, 2],
        "mma_double_buffer_loads": [False, True],
        "optimized_softmax": [False, True],
    }
    return [c for c in _valid_product(space) if is_tuning_candidate(c)]


PROGRESSION: tuple[str, ...] = (
    "(FP16, 128, 64, 64, 4): async+load_0_0_0_tiles",
    "(FP16, 128, 64, 64, 4): async+swizzled+load_0_0_0_tiles",
    "(FP16, 128, 64, 64, 4): async+eager+swizzled+load_0_0_0_tiles",
    "(FP16, 128, 64, 64, 4): async+eager+swizzled+load_2_2_2_tiles",
    "(FP16, 128, 64, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer",
    "(FP16, 128, 64, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax",
    "(FP16, 128, 64, 64, 4): async+eager+swizzled+load_0_2_2_tiles+opt_softmax",
)
"""The seed's kernel progression (kernels 1-7), each step adding one optimisation."""

#: The seed's best configs (fastest of its tuning space on an H200); the defaults users get.
#: ``KernelConfig(dtype=...)`` with no other knobs equals the ``load_2_2_2`` one.
DEFAULTS: tuple[str, ...] = (
    "(FP16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax",
    "(FP16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_0_tiles+buffer+opt_softmax",
    "(BF16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax",
    "(BF16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_0_tiles+buffer+opt_softmax",
)


def kernel_progression(all_block_sizes: bool = False) -> list[KernelConfig]:
    """The seed's progression; with ``all_block_sizes`` each step over its block-size grid."""
    base = [KernelConfig.from_short_form(s) for s in PROGRESSION]
    if not all_block_sizes:
        return base
    out = []
    for cfg in base:
        for B_r, B_c, n_warps in itertools.product((128, 64), (128, 64, 32), (4, 8)):
            if (B_r < 128 and n_warps == 8) or B_r < B_c:
                continue
            try:
                out.append(cfg.replace(B_r=B_r, B_c=B_c, n_warps=n_warps))
            except ConfigError:
                continue
    return out


def hopper_configs(dtypes: Iterable[DType | str] = ("fp16", "bf16")) -> list[KernelConfig]:
    """The wgmma engine's d_head-128 set: the base config (pingpong + intra overlap, 2 stages) and its
    variants (each overlap off, 3 stages, B_c 176, persistent with B_c 128 and 160: the shipped
    defaults), for benchmarks and the GPU tests."""
    out = []
    for dt in dtypes:
        base = KernelConfig.wgmma(dt)
        out += [base, base.replace(intra_overlap=False), base.replace(pingpong=False), base.replace(stages=3),
                base.replace(B_c=176), base.replace(persistent=True), base.replace(B_c=160, persistent=True)]
    return out


def default_configs() -> list[KernelConfig]:
    return [KernelConfig.from_short_form(s) for s in DEFAULTS]


def load_config(source: "KernelConfig | Mapping[str, Any] | str | Path") -> KernelConfig:
    """A config from a KernelConfig, a dict, a YAML path, or a short-form name."""
    if isinstance(source, KernelConfig):
        return source
    if isinstance(source, Mapping):
        return KernelConfig.from_dict(source)
    text = str(source)
    if text.lstrip().startswith("("):
        return KernelConfig.from_short_form(text)
    path = Path(text)
    if path.suffix in (".yaml", ".yml", ".json") or path.exists():
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        return KernelConfig.from_yaml(path.read_text())
    raise ConfigError(
        f"cannot read a config from {text!r}: expected a KernelConfig, a dict, a YAML path, "
        "or a short form like '(FP16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_0_tiles+buffer+opt_softmax'"
    )
