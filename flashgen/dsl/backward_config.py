"""BackwardConfig: the knobs of the attention backward kernel (dQ, dK, dV).

The backward is not a forward config with a direction switch: its CTA owns ``B_c`` *key* rows and
walks the query blocks of ``B_r`` rows (the forward's roles swapped), and most forward knobs mean
nothing here (the eager K/V copies, the per-operand k-tile counts, the softmax variant). So it has
a small config of its own, with the forward's common knobs under the same names and values
(``dtype``, ``d_head``, ``B_r``, ``B_c``, ``n_warps``, ``swizzled``, ``mask``, ``engine``) and the
same kind of validity rules, each naming the values it rejects.

Work split (mma.sync): the warps form ``n_warps / d_split`` groups of ``d_split``; warp ``w`` is
in group ``g = w // d_split`` at place ``h = w % d_split``. Group ``g`` owns key rows
``[g * B_c/groups, ...)`` of S^T, dP^T, dS^T, dK and dV and query rows ``[g * B_r/groups, ...)`` of
dQ; of those rows' dK, dV and dQ, warp ``h`` owns the ``dw`` columns from ``h * dw``, ``dw`` its
share of d_head rounded up to a power of two (:attr:`BackwardConfig.d_cols_per_warp`; the shared
tiles keep their ``d_smem`` columns, and the shares' columns past d_head are computed and dropped).
Every warp of a group computes the group's S^T and dP^T (the A operands of its dV and dK columns)
itself: ``d_split`` cuts the accumulators a thread holds for dK, dV and dQ
by ``d_split`` at the price of S^T and dP^T computed ``d_split`` times. ``split_scores`` removes that
price: warp ``h`` computes only query columns ``[h * B_r/d_split, ...)`` of S^T and dP^T, and P^T and
dS^T go through shared memory (``sP``, ``sdS``), from where dV and dK read their A operands. Row counts
are whole numbers of the MMA's 16 rows, column counts of its k16. ``dq_split`` (0: off) gives dQ a warp grid of its
own: ``dq_split`` warps across its columns (d_head's share rounded as ``dw``), ``n_warps / dq_split`` down its query
rows (``B_r * dq_split / n_warps`` each), so that the dQ GEMM's warp tile can be squarer than dK and dV's.
"""
from __future__ import annotations

import hashlib
import itertools
import json
from typing import Any, Mapping

import attrs

from ..targets import TARGETS
from .config import MASKS, MMA_K, MMA_M, SMEM_LIMIT_BYTES, SWIZZLE_TILE_COLS, ConfigError, mma_cols, smem_cols
from .dtypes import DType

#: registers a thread may have: 255, or fewer where the CTA's threads share one register file
MAX_THREAD_REGS = 255
#: registers per thread kept for addresses, fragments and loop state beside the accumulators
OTHER_REGS = MAX_THREAD_REGS - 224
#: the register file one CTA may use (the smallest of the targets')
REGS_PER_CTA = min(t.regs_per_sm for t in TARGETS.values())
ENGINES = ("mma_sync", "wgmma")
#: wgmma: warpgroups of 4 warps; one producer, the rest consumers of 64 key rows each
WG_WARPS = 4
#: wgmma: query rows per block by head size, unmasked and masked (the N of S^T and dP^T: B_r / 2 accumulator
#: registers each per thread). d_head 64 takes 128 (two consumers each making 64 query rows of dQ): S^T, dP^T and dQ
#: read their shared-memory operands in wider GEMMs, which at 64 rows were bound by shared-memory bandwidth (H100:
#: 8-12% faster). d_head 128 takes 80 unmasked (dQ made transposed; H100: 10-16% faster than 64) but 64 under a
#: causal or window mask, whose diagonal cuts more of the 80-row blocks (there 80 was 1-4% slower)
WGMMA_B_R = {64: (128, 128), 128: (80, 64)}
#: wgmma: query block sizes the backward takes by head size (64 or 128, either consumer making 64 rows of dQ at 128;
#: 80 at d_head 128, dQ made transposed, dQ^T = K^T dS^T, so that its M is a consumer's 64 columns of d_head)
WGMMA_B_RS = {64: (64, 128), 128: (64, 80)}
#: wgmma: head sizes whose shipped two-stage backward runs ``exp_first``. H200, bf16, seq 2048 / 8192: d_head 64
#: (128 rows) +4% / +7% causal and faster unmasked too; d_head 128 (80 rows unmasked) -4% / +2%, so it keeps the split
#: order (and its causal 64 rows do not take the knob)
WGMMA_EXP_FIRST = (64,)
#: wgmma: head sizes its tiles take (whole 64-column TMA boxes; d_head 256's dK and dV do not fit the registers)
WGMMA_D_HEADS = (64, 128)


def _dtype(value: Any) -> DType:
    try:
        return DType.parse(value)
    except ValueError as e:
        raise ConfigError(str(e)) from None


@attrs.frozen
class BackwardConfig:
    """One backward kernel: ``B_c`` key rows per CTA, query blocks of ``B_r`` rows, ``n_warps`` warps."""

    dtype: DType = attrs.field(converter=_dtype)
    d_head: int = 128
    B_r: int = 64
    B_c: int = 64
    n_warps: int = 4
    swizzled: bool = True
    mask: str = "none"
    engine: str = "mma_sync"
    d_split: int = 1
    stages: int = 1
    deterministic: bool = False
    split_scores: bool = False
    #: the grid's last (kv head, batch) pairs, about two waves of CTAs, start key block by key block (a causal
    #: mask's longest CTAs of the tail first, so the launch ends on short ones) instead of each pair's key blocks
    #: together (:class:`~flashgen.attention.backward_grid.BackwardGrid`). Off by default and out of the tuning space:
    #: on an H200 (causal, bf16, seq 2048 / 8192) -2% to +5% on the wgmma backward, within its run-to-run spread, and
    #: +2-3% on the mma_sync one (docs/results/backward_longest_first_h200.json)
    longest_first: bool = False
    #: wgmma, query blocks past 64 rows: the exponentials of P^T while dP^T's wgmma is in flight (the plan's
    #: ``exp_first`` score order), instead of waiting for both GEMMs and making P^T and dS^T in one pass
    exp_first: bool = False
    #: mma_sync: the warps splitting dQ's columns (dQ's own warp grid: ``n_warps / dq_split`` rows of warps down the query
    #: block, ``dq_split`` across d_head); 0: the dK/dV grid's ``d_split``. Wider than ``d_split`` makes dQ's warp tile
    #: squarer (d_head 128, 8 warps, 64 rows: 32 x 32 instead of 16 x 64), so a warp reads fewer ldmatrix of dS and
    #: K^T per query block (32 instead of 40)
    dq_split: int = 0

    @classmethod
    def default(cls, dtype: "DType | str", d_head: int, mask: str = "none",
                smem_limit: int = SMEM_LIMIT_BYTES) -> "BackwardConfig | None":
        """The shipped config of a dtype, head size and mask: the first of :func:`_default_shapes` that fits
        ``smem_limit`` (a GPU's shared memory per block) with two stages (the next query block loads under
        this one's GEMMs), else the first with one. None where none fits, and above 256."""
        if not 0 < d_head <= 256:
            return None
        shapes = [cls(dtype, d_head=d_head, mask=mask, **knobs) for knobs in _default_shapes(d_head)]
        for stages in (2, 1):
            fits = [c for c in (s.replace(stages=stages) for s in shapes) if c.smem_bytes <= smem_limit]
            if fits:
                return fits[0]
        return None

    @classmethod
    def wgmma(cls, dtype: "DType | str", d_head: int, mask: str = "none", stages: int = 2) -> "BackwardConfig | None":
        """The shipped wgmma backward (sm_90a) of a dtype, head size and mask: query blocks of :data:`WGMMA_B_R`
        rows, two consumers of 64 key rows, ``stages`` ring stages, ``exp_first`` with two stages at the head sizes
        of :data:`WGMMA_EXP_FIRST`; None for head sizes it does not take."""
        if d_head not in WGMMA_D_HEADS:
            return None
        rows = WGMMA_B_R[d_head][mask != "none"]
        exp_first = d_head in WGMMA_EXP_FIRST and stages == 2 and rows > 64
        return cls(dtype, d_head=d_head, mask=mask, engine="wgmma", B_r=rows, B_c=128, n_warps=12, stages=stages,
                   exp_first=exp_first)

    def __attrs_post_init__(self) -> None:
        for rule in _RULES:
            rule(self)

    # ---- derived sizes -------------------------------------------------------------
    @property
    def threads(self) -> int:
        return 32 * self.n_warps

    @property
    def consumers(self) -> int:
        """wgmma: consumer warpgroups (64 key rows each); warpgroup 0 is the TMA producer."""
        return self.n_warps // WG_WARPS - 1

    @property
    def warp_groups(self) -> int:
        """Groups of ``d_split`` warps; each owns a share of the key rows and of dQ's query rows."""
        return self.n_warps // self.d_split

    @property
    def key_rows_per_warp(self) -> int:
        """Key rows of S^T, dP^T, dS^T, dK and dV owned by one warp (and its group)."""
        return self.B_c // self.warp_groups

    @property
    def dq_warp_cols(self) -> int:
        """Warps across dQ's columns: ``dq_split``, or where it is 0 the dK/dV grid's ``d_split``. Warp ``w`` owns dQ's
        query rows from ``(w // dq_warp_cols) * qr`` (:attr:`query_rows_per_warp`) and its columns from
        ``(w % dq_warp_cols) * dqw`` (:attr:`dq_cols_per_warp`)."""
        return self.dq_split or self.d_split

    @property
    def query_rows_per_warp(self) -> int:
        """Query rows of dQ owned by one warp (and the other warps of its row of dQ's warp grid)."""
        return self.B_r // (self.n_warps // self.dq_warp_cols)

    @property
    def d_cols_per_warp(self) -> int:
        """Columns of dK, dV and dQ owned by one warp: ``d_mma`` without a split; with one, d_head's
        share rounded up to a power of two (at least the MMA's 16). A power of two because warp ``h``'s
        columns start at ``h * dw``: the emitted addresses are one per-thread base xor/plus constants
        read off warp 0 (:mod:`flashgen.dsl.addressing`), which holds for every warp only where the
        warp's offset sets swizzle bits that the steps within its share never carry into."""
        return self._share_cols(self.d_split)

    def _share_cols(self, warps: int) -> int:
        """Columns per warp where ``warps`` warps split d_head: ``d_mma`` for one, else the share rounded up to a
        power of two, at least the MMA's 16 (:attr:`d_cols_per_warp`'s rule)."""
        return self.d_mma if warps == 1 else max(MMA_K, 1 << (-(-self.d_head // warps) - 1).bit_length())

    @property
    def dq_cols_per_warp(self) -> int:
        """Columns of dQ owned by one warp: :attr:`d_cols_per_warp`'s rule for ``dq_warp_cols`` warps (``d_mma`` for
        one; else d_head's share rounded up to a power of two, at least the MMA's 16)."""
        return self._share_cols(self.dq_warp_cols)

    @property
    def dq_cols(self) -> int:
        """Columns of dQ the warps of a row of dQ's grid compute together (the columns past d_head are dropped)."""
        return self.dq_warp_cols * self.dq_cols_per_warp

    @property
    def d_cols(self) -> int:
        """Columns of dK, dV and dQ the warps of a group compute together, ``d_split`` shares: ``d_mma``
        or more (d_head 192 in halves: 2 x 128). The columns past d_head read the zero-filled columns of
        the shared tiles, land in the staging tiles over sK / sV and are never stored; so they must fit
        ``d_smem`` (:func:`_rule_d_split`)."""
        return self.d_split * self.d_cols_per_warp

    @property
    def d_smem(self) -> int:
        """Columns of a Q/dO/K/V shared tile: d_head rounded up to 64, 128 or 256 (as the forward's)."""
        return smem_cols(self.d_head)

    @property
    def d_mma(self) -> int:
        """d_head rounded up to the MMA's k16."""
        return mma_cols(self.d_head)

    @property
    def score_cols_per_warp(self) -> int:
        """Query columns of S^T and dP^T one warp computes: all ``B_r``, or with ``split_scores`` its
        ``B_r / d_split`` (warp ``h`` of a group from ``h * B_r / d_split``)."""
        return self.B_r // self.d_split if self.split_scores else self.B_r

    @property
    def dq_passes(self) -> int:
        """Passes of the dQ GEMM over slices of a warp's ``dw`` columns (each reloading its dS fragments):
        2 where ``split_scores`` leaves dK, dV and a whole dQ at 192 accumulators or more (d_head 256 at
        d_split 4, 64 key rows: one pass spilled 64 bytes on sm_90a, two 32-column passes none), else 1."""
        kv = 2 * self.key_rows_per_warp * self.d_cols_per_warp // 32
        dq = self.query_rows_per_warp * self.dq_cols_per_warp // 32
        return 2 if self.split_scores and kv + dq >= 192 and self.dq_cols_per_warp >= 2 * MMA_K else 1

    @property
    def acc_regs(self) -> int:
        """Accumulator registers per thread at the peak: dK and dV, plus S^T and dP^T (while dS is
        formed) or dQ (while it is reduced), whichever is more."""
        kv = 2 * self.key_rows_per_warp * self.d_cols_per_warp // 32
        scores = 2 * self.key_rows_per_warp * self.score_cols_per_warp // 32
        dq = self.query_rows_per_warp * self.dq_cols_per_warp // 32 // self.dq_passes
        return kv + max(scores, dq)

    @property
    def smem_bytes(self) -> int:
        """K, V (resident), Q, dO, lse and D (fp32) of ``stages`` query blocks, dS^T (B_c x B_r, 16 bit),
        with ``split_scores`` P^T too (as dS^T); wgmma: two dS^T buffers, the ring's mbarriers and the slack
        that aligns the base to 1024 bytes."""
        if self.engine == "wgmma":
            from .hopper_backward_smem import smem_plan

            return smem_plan(self)[1]
        streamed = self.stages * (2 * self.B_r * self.d_smem * self.dtype.size + 2 * 4 * self.B_r)
        scores = (2 if self.split_scores else 1) * self.B_c * self.B_r * self.dtype.size
        return 2 * self.B_c * self.d_smem * self.dtype.size + streamed + scores

    # ---- names ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The knobs; ``split_scores``, ``longest_first``, ``exp_first`` and ``dq_split`` only where on, so that the
        names and hashes of the configs from before them are unchanged."""
        d = attrs.asdict(self)
        d["dtype"] = self.dtype.value
        for name in ("split_scores", "longest_first", "exp_first", "dq_split"):
            if not d[name]:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "BackwardConfig":
        unknown = sorted(set(data) - {f.name for f in attrs.fields(cls)})
        if unknown:
            raise ConfigError(f"unknown backward config key(s) {unknown}; valid keys: {', '.join(f.name for f in attrs.fields(cls))}")
        if "dtype" not in data:
            raise ConfigError("backward config is missing 'dtype' (fp16 or bf16)")
        return cls(**data)

    def replace(self, **changes: Any) -> "BackwardConfig":
        return attrs.evolve(self, **changes)

    def short_form(self) -> str:
        """``bwd(FP16, 128, 64, 64, 4): swizzled+causal`` = (dtype, d_head, B_r, B_c, n_warps): flags
        (``d_split_2`` among them when the warps split d, ``dq_split_4`` when dQ has its own warp grid, ``deterministic`` for dQ's ordered adds, ``longest_first``
        for the grid's order, ``exp_first`` for the wgmma exponentials under dP^T's GEMM)."""
        flags = (["wgmma"] if self.engine == "wgmma" else []) + (["swizzled"] if self.swizzled else [])
        flags += [self.mask] if self.mask != "none" else []
        flags += [f"d_split_{self.d_split}"] if self.d_split > 1 else []
        flags += [f"dq_split_{self.dq_split}"] if self.dq_split else []
        flags += ["split_scores"] if self.split_scores else []
        flags += [f"stages_{self.stages}"] if self.stages > 1 else []
        flags += ["deterministic"] if self.deterministic else []
        flags += ["longest_first"] if self.longest_first else []
        flags += ["exp_first"] if self.exp_first else []
        head = f"bwd({self.dtype.short}, {self.d_head}, {self.B_r}, {self.B_c}, {self.n_warps})"
        return head + (": " + "+".join(flags) if flags else "")

    def __str__(self) -> str:
        return self.short_form()

    def mangle(self) -> str:
        """A C identifier naming this config (also the .cu file stem)."""
        parts = [self.dtype.value, f"d{self.d_head}", f"br{self.B_r}", f"bc{self.B_c}", f"w{self.n_warps}"]
        parts += (["wgmma"] if self.engine == "wgmma" else []) + (["swz"] if self.swizzled else [])
        parts += [self.mask] if self.mask != "none" else []
        parts += [f"ds{self.d_split}"] if self.d_split > 1 else []
        parts += [f"dq{self.dq_split}"] if self.dq_split else []
        parts += ["ss"] if self.split_scores else []
        parts += [f"s{self.stages}"] if self.stages > 1 else []
        parts += ["det"] if self.deterministic else []
        parts += ["lf"] if self.longest_first else []
        parts += ["ef"] if self.exp_first else []
        return "_".join(["flash_bwd", *parts])

    def content_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


# ---- validity rules (each names itself and the values) ---------------------------------


def _rule_choices(c: BackwardConfig) -> None:
    if c.engine not in ENGINES:
        raise ConfigError(f"engine={c.engine!r}: the backward is built by {', '.join(ENGINES)} so far")
    if c.mask not in MASKS:
        raise ConfigError(f"mask={c.mask!r}: expected one of {', '.join(MASKS)}")
    for name in ("swizzled", "deterministic", "split_scores", "longest_first"):
        if not isinstance(getattr(c, name), bool):
            raise ConfigError(f"{name}={getattr(c, name)!r}: expected true or false")


def _rule_sizes(c: BackwardConfig) -> None:
    if c.engine == "wgmma":
        return _rule_wgmma(c)
    if c.d_head <= 0 or c.d_head % 8 or c.d_head > 256:
        raise ConfigError(f"d_head={c.d_head}: must be a multiple of 8 between 8 and 256 (rows move in 16-byte vectors)")
    if c.n_warps <= 0 or c.n_warps & (c.n_warps - 1) or c.n_warps > 16:
        raise ConfigError(f"n_warps={c.n_warps}: must be a power of two between 1 and 16")
    groups = f"n_warps={c.n_warps}" + (f" in groups of d_split={c.d_split}" if c.d_split > 1 else "")
    if c.B_c <= 0 or c.B_c % (MMA_M * c.warp_groups):
        raise ConfigError(f"B_c={c.B_c} with {groups}: each warp group owns B_c/{c.warp_groups} key rows (of dK, dV), "
                          f"which must be a positive multiple of the MMA's {MMA_M} rows")
    if c.dq_split:
        dq_rows = c.n_warps // c.dq_split
        if c.B_r <= 0 or c.B_r % (MMA_M * dq_rows):
            raise ConfigError(f"B_r={c.B_r} with n_warps={c.n_warps}, dq_split={c.dq_split}: each of dQ's {dq_rows} rows of "
                              f"warps owns B_r*dq_split/n_warps = B_r/{dq_rows} query rows of dQ, which must be a positive "
                              f"multiple of the MMA's {MMA_M} rows; use a larger dq_split (fewer rows of warps) or B_r")
    elif c.B_r <= 0 or c.B_r % (MMA_M * c.warp_groups):
        raise ConfigError(f"B_r={c.B_r} with {groups}: each warp group owns B_r/{c.warp_groups} query rows of dQ, "
                          f"which must be a positive multiple of the MMA's {MMA_M} rows")
    if c.B_r % SWIZZLE_TILE_COLS:
        raise ConfigError(f"B_r={c.B_r}: the dS^T tile (B_c x B_r) is stored in {SWIZZLE_TILE_COLS}-column swizzle blocks, "
                          f"so B_r must be a multiple of {SWIZZLE_TILE_COLS}")
    for name, rows in (("B_r", c.B_r), ("B_c", c.B_c)):
        chunks = rows * c.d_smem // 8
        if chunks % c.threads:
            raise ConfigError(f"{name}={rows}, d_head={c.d_head}, n_warps={c.n_warps}: the {rows}-row tile's {chunks} "
                              f"16-byte chunks must split evenly over the CTA's {c.threads} threads")


def lightest_default(cfg: BackwardConfig) -> "BackwardConfig | None":
    """The last of :func:`_default_shapes` for ``cfg``'s head size (the former default: its kernels with the
    example mods compiled free of local memory) with ``cfg``'s other knobs, or None where ``cfg`` has that
    shape: where a user's mods do not fit ``cfg``'s registers."""
    shape = BackwardConfig(cfg.dtype, d_head=cfg.d_head, **_default_shapes(cfg.d_head)[-1])
    knobs = {k: getattr(shape, k) for k in ("B_r", "B_c", "n_warps", "d_split", "split_scores", "dq_split")}
    lighter = cfg.replace(**knobs)
    return None if lighter == cfg else lighter


def _default_shapes(d_head: int) -> list[dict]:
    """The block shapes :meth:`BackwardConfig.default` tries, best first (timed on an H100, bf16, seq 2048 and
    8192, `docs/results/backward_shapes_mma_sync_h100.json`; the later ones serve GPUs with less shared memory
    per block). ``split_scores`` gives each warp of a ``d_split`` group its share of the query columns of S^T
    and dP^T, so the scores are computed once, not once per warp.

    * Up to 64 columns: 8 warps on 128 x 128 blocks, in pairs with split scores where halving d_head pads no
      column (d_head 64: 6-10% faster than the 8 warps alone, 13-21% than 4 warps on 64 x 64); where it would pad
      (d_head 48: to 64 columns) the 8 warps alone, each holding all of d_head's accumulators (4% faster).
    * Up to 128: 8 warps in pairs on 128 key rows with split scores, 1.05-1.16x the speed of 4 warps on 64 x 64
      (d_head 96 and 128), which hold every accumulator. At d_head 128 dQ on a grid of its own, four warps across
      its columns (``dq_split``: 32 x 32 warp tiles, 32 ldmatrix per warp and query block instead of 40), 1.5-2.4%
      faster on an H200 (`docs/results/backward_dq_split_h200.json`).
    * Past 128, 4 warps cannot hold the accumulators: 8 warps in fours on 64 key rows with split scores, each
      64 columns (:attr:`BackwardConfig.d_cols_per_warp`: d_head's share rounded up to a power of two), 1.2x
      (d_head 256) to 2.2x (192) the speed of the shapes without split scores that follow."""
    if d_head <= 64:
        pairs = dict(B_r=128, B_c=128, n_warps=8, d_split=2, split_scores=True)
        no_pad = BackwardConfig("fp16", d_head=d_head, **pairs).d_cols == mma_cols(d_head)
        return [pairs] * no_pad + [dict(B_r=128, B_c=128, n_warps=8), dict()]
    if d_head <= 128:
        return [dict(B_c=128, n_warps=8, d_split=2, split_scores=True, dq_split=4 if d_head == 128 else 0), dict()]
    old = dict(n_warps=8, d_split=2) if d_head == 256 else dict(B_c=32, n_warps=8, d_split=4)
    return [dict(n_warps=8, d_split=4, split_scores=True), old]


def _rule_d_split(c: BackwardConfig) -> None:
    if not isinstance(c.d_split, int) or c.d_split < 1 or c.d_split & (c.d_split - 1) or c.n_warps % c.d_split:
        raise ConfigError(f"d_split={c.d_split!r} with n_warps={c.n_warps}: must be a power of two dividing n_warps")
    if c.d_split == 1:
        return
    if c.d_cols > c.d_smem:
        raise ConfigError(f"d_split={c.d_split}, d_head={c.d_head}: each warp's share of d_head rounds up to "
                          f"{c.d_cols_per_warp} columns (a power of two, at least the MMA's {MMA_K}), and {c.d_split} shares "
                          f"make {c.d_cols} columns of dK and dV, more than the {c.d_smem} of the shared tiles they are staged in; "
                          "use a smaller d_split")


def _rule_dq_split(c: BackwardConfig) -> None:
    """dQ's own warp grid: ``n_warps / dq_split`` rows of warps (their query rows are checked by :func:`_rule_sizes`)
    by ``dq_split`` columns, each d_head's share rounded up to a power of two (as ``d_split``'s)."""
    if not isinstance(c.dq_split, int) or isinstance(c.dq_split, bool) or c.dq_split < 0:
        raise ConfigError(f"dq_split={c.dq_split!r}: the warps splitting dQ's columns, 0 (as d_split) or a power of two "
                          "dividing n_warps")
    if not c.dq_split:
        return
    if c.engine != "mma_sync":
        raise ConfigError(f"dq_split={c.dq_split} with engine={c.engine}: it gives the mma_sync backward's dQ GEMM a warp grid "
                          "of its own; the wgmma backward's consumers make dQ in their own way; leave it 0")
    if c.dq_split & (c.dq_split - 1) or c.n_warps % c.dq_split:
        raise ConfigError(f"dq_split={c.dq_split} with n_warps={c.n_warps}: must be a power of two dividing n_warps (the warps "
                          "splitting dQ's columns; n_warps/dq_split rows of warps down the query block)")
    if c.dq_cols > c.d_smem:
        raise ConfigError(f"dq_split={c.dq_split}, d_head={c.d_head}: each warp's share of dQ's columns rounds up to "
                          f"{c.dq_cols_per_warp} (a power of two, at least the MMA's {MMA_K}, the two n8 tiles of one "
                          f"ldmatrix.x4.trans of K^T), and {c.dq_split} shares make {c.dq_cols} columns, more than the {c.d_smem} "
                          "of sK that dQ's B operand reads; use a smaller dq_split")


def _rule_split_scores(c: BackwardConfig) -> None:
    if not c.split_scores:
        return
    if c.engine != "mma_sync" or c.d_split == 1:
        raise ConfigError(f"split_scores with engine={c.engine}, d_split={c.d_split}: it splits S^T and dP^T's query "
                          "columns over the warps of a d_split group, so it needs the mma_sync engine and d_split > 1")
    if c.B_r % (MMA_K * c.d_split):
        raise ConfigError(f"split_scores with B_r={c.B_r}, d_split={c.d_split}: each warp of a group computes B_r/{c.d_split} "
                          f"query columns of S^T and dP^T, read as B operands {MMA_K} rows at a time (ldmatrix x4), so "
                          f"B_r must be a multiple of {MMA_K * c.d_split}")


def _rule_exp_first(c: BackwardConfig) -> None:
    if not isinstance(c.exp_first, bool):
        raise ConfigError(f"exp_first={c.exp_first!r}: expected true or false")
    if not c.exp_first:
        return
    if c.engine != "wgmma":
        raise ConfigError(f"exp_first with engine={c.engine}: it runs the exponentials of P^T while dP^T's wgmma is in "
                          "flight, an order of the wgmma backward's score steps, so it needs engine=wgmma")
    if c.B_r <= 64:
        raise ConfigError(f"exp_first with B_r={c.B_r}: a query block of 64 rows or fewer already waits for S^T alone "
                          f"before its exponentials (dV issued before dP^T's wait); exp_first takes B_r > 64 (128 at "
                          f"d_head 64, 80 at d_head 128), or leave it off")


def acc_reg_limit(threads: int) -> int:
    """Accumulator registers a thread of a ``threads``-thread CTA may hold: its share of the register
    file (whole multiples of 8, at most 255) less the registers everything else needs."""
    return min(MAX_THREAD_REGS, REGS_PER_CTA // threads // 8 * 8) - OTHER_REGS


def _rule_registers(c: BackwardConfig) -> None:
    if c.engine == "wgmma":
        return  # the wgmma shapes are fixed per head size (_rule_wgmma); ptxas reports the rest
    limit = acc_reg_limit(c.threads)
    if c.acc_regs > limit:
        raise ConfigError(
            f"d_head={c.d_head}, B_r={c.B_r}, B_c={c.B_c}, n_warps={c.n_warps}"
            f"{f', d_split={c.d_split}' if c.d_split > 1 else ''}: the accumulators need {c.acc_regs} registers "
            f"per thread (dK + dV + max(S^T + dP^T, dQ); > {limit} for {c.threads} threads); use d_split"
            f"{'' if c.split_scores else ' (with split_scores)'}, smaller blocks or (up to 8) more warps")


def _rule_smem(c: BackwardConfig) -> None:
    if c.smem_bytes > SMEM_LIMIT_BYTES:
        raise ConfigError(f"shared memory {c.smem_bytes} bytes (K, V, Q, dO tiles of {c.d_smem} columns, dS^T"
                          f"{', P^T' if c.split_scores else ''}, lse and D) "
                          f"exceeds the {SMEM_LIMIT_BYTES}-byte per-block limit")


def _rule_stages(c: BackwardConfig) -> None:
    if c.stages not in (1, 2):
        raise ConfigError(f"stages={c.stages!r}: 1 (each query block's Q, dO, lse and D loaded before it is used) "
                          "or 2 (the next block's loaded while this one is computed)")


def _rule_wgmma(c: BackwardConfig) -> None:
    """The wgmma backward's shapes: one producer warpgroup and consumers of 64 key rows each."""
    if c.d_head not in WGMMA_D_HEADS:
        raise ConfigError(f"d_head={c.d_head}: the wgmma backward takes d_head {' or '.join(map(str, WGMMA_D_HEADS))} "
                          "(whole 64-column TMA boxes; dK and dV of larger heads do not fit a consumer's registers); "
                          "use engine=mma_sync")
    if c.n_warps % WG_WARPS or c.consumers not in (1, 2):
        raise ConfigError(f"n_warps={c.n_warps}: the wgmma backward runs one producer and 1 or 2 consumer warpgroups "
                          f"of {WG_WARPS} warps (n_warps 8 or 12)")
    if c.B_c != 64 * c.consumers:
        raise ConfigError(f"B_c={c.B_c} with n_warps={c.n_warps}: each of the {c.consumers} consumer warpgroup(s) owns 64 key "
                          f"rows (a wgmma's M), so B_c must be {64 * c.consumers}")
    if c.B_r not in WGMMA_B_RS[c.d_head]:
        raise ConfigError(f"B_r={c.B_r} at d_head={c.d_head}: the wgmma backward walks query blocks of 64 rows, 128 at "
                          f"d_head 64 or 80 at d_head 128 (S^T and dP^T of 64 x B_r per consumer beside dK and dV of 64 x "
                          f"d_head in its registers)")
    if c.B_r % 64 and c.d_head != 64 * c.consumers:
        raise ConfigError(f"B_r={c.B_r} with n_warps={c.n_warps}: a query block of no multiple of 64 rows makes dQ transposed, "
                          f"each consumer 64 columns of d_head (a wgmma's M), so d_head={c.d_head} needs "
                          f"{c.d_head // 64} consumer(s), n_warps {4 * (1 + c.d_head // 64)}")
    if c.B_r % 64 == 0 and c.B_r > 64 * c.consumers:
        raise ConfigError(f"B_r={c.B_r} with n_warps={c.n_warps}: each consumer makes 64 query rows of dQ (a wgmma's M) or "
                          f"fewer, so {c.consumers} consumer(s) take B_r up to {64 * c.consumers}")
    if c.d_split != 1 or not c.swizzled:
        raise ConfigError(f"{c.short_form()}: the wgmma backward has no d_split and needs swizzled tiles (TMA's 128-byte "
                          "swizzle)")


_RULES = (_rule_choices, _rule_stages, _rule_d_split, _rule_dq_split, _rule_split_scores, _rule_sizes, _rule_exp_first, _rule_registers, _rule_smem)


# ---- the tuning space ------------------------------------------------------------------

#: What ``flashgen tune --passes bwd`` varies: query and key block rows, warps, the warps' split of
#: d_head's columns (dK/dV's, and dQ's where wider), the swizzle and the query-block stages; the rules above decide
#: which combinations exist.
TUNING_KNOBS: dict[str, tuple] = {
    "B_r": (64, 128),
    "B_c": (16, 32, 64, 128),
    "n_warps": (2, 4, 8, 16),
    "d_split": (1, 2, 4, 8, 16),
    "swizzled": (True, False),
    "stages": (1, 2),
    "split_scores": (False, True),
    "dq_split": (0, 4),
}
def tuning_space(dtype: "DType | str", d_head: int, mask: str = "none") -> list[BackwardConfig]:
    """Every valid config of :data:`TUNING_KNOBS`'s product for a dtype, head size and mask, in the product's
    order (the shipped :meth:`BackwardConfig.default` is among them). Which of them spill
    depends on the arch, so the tuner asks ptxas (:mod:`flashgen.tune_backward`), not this list."""
    out = []
    for values in itertools.product(*TUNING_KNOBS.values()):
        knobs = dict(zip(TUNING_KNOBS, values))
        if 0 < knobs["dq_split"] <= knobs["d_split"]:
            continue  # as d_split's grid (equal) or narrower than it: nothing to gain
        try:
            out.append(BackwardConfig(dtype, d_head=d_head, mask=mask, **knobs))
        except ConfigError:
            continue
    return out
