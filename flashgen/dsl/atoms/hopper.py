"""Hopper (sm_90a) atoms: swizzle modes, wgmma descriptors, the wgmma accumulator map, TMA boxes.

Instruction metadata only; the ``asm`` text lives in ``flashgen.emit.ptx.hopper``.
PTX ISA sections (PTX ISA 8.x numbering drifts between versions, so the titles are
the reference):

* "Asynchronous Warpgroup Level Matrix Shared Memory Layout" -> "Matrix Descriptor"
  (anchor ``asynchronous-warpgroup-level-matrix-shared-memory-layout-matrix-descriptor``)
  and its swizzling-mode figures: :class:`GmmaSwizzle`, :class:`SmemDescriptor`.
* "Asynchronous Warpgroup Level Matrix Register Fragment" -> "Matrix fragments for
  wgmma.mma_async .m64nNk16", accumulator D: :class:`WGMMA_64xNx16`.
* "Parallel Synchronization and Communication Instructions: mbarrier" and
  "Data Movement: cp.async.bulk.tensor" plus CUDA driver ``cuTensorMapEncodeTiled``:
  :class:`Mbarrier`, :class:`TmaLoad`.
"""
from __future__ import annotations

import enum

import attrs
import numpy as np

from ..dtypes import DType
from ..layout import Layout
from ..swizzle import ComposedLayout, Swizzle
from ..tiling import TVMap

# --------------------------------------------------------------------------- swizzle modes


class GmmaSwizzle(enum.Enum):
    """Shared-memory swizzle modes shared by wgmma descriptors and TMA tensor maps.

    Byte-level definition (PTX ISA, wgmma "Shared Memory Matrix Layout" swizzling
    figures; CUDA ``CU_TENSOR_MAP_SWIZZLE_*``). For a mode of span ``W`` bytes
    (32, 64, 128) let ``B = log2(W / 16)`` (1, 2, 3). For a byte address ``a`` inside a
    1024-byte-aligned region::

        byte bits:  ... | 9 8 7 | 6 5 4 | 3 2 1 0
                          yyy     ccc     (16-byte granule kept)
        chunk  = (a >> 4) & (2**B - 1)      the 16-byte chunk within a W-byte row
        row8   = (a >> 7) & (2**B - 1)      which 128-byte line of the repeating pattern
        swz(a) = a ^ (row8 << 4)            == Swizzle(B, 4, 3) on byte offsets

    The pattern repeats every ``2**(7 + B)`` bytes (256/512/1024). In 16-bit element
    units the 16-byte granule is 8 elements (3 bits instead of 4), so the element-level
    swizzle is ``Swizzle(B, 3, 3)``: Sw<1,3,3> (32B), Sw<2,3,3> (64B), Sw<3,3,3> (128B).
    NONE is the 8x8 "core matrix" interleave: no XOR, 16-byte rows.
    """

    NONE = 0
    B32 = 32
    B64 = 64
    B128 = 128

    @property
    def span_bytes(self) -> int:
        """Row width of the atom in bytes: 16 for NONE (one core-matrix row), else the mode."""
        return self.value or 16

    @property
    def bits(self) -> int:
        """``B``: number of XORed chunk bits (0 for NONE)."""
        return {0: 0, 32: 1, 64: 2, 128: 3}[self.value]

    @property
    def swizzle(self) -> Swizzle:
        """Element-level (16-bit) swizzle: ``Swizzle(B, 3, 3)``."""
        return Swizzle(self.bits, 3, 3)

    @property
    def byte_swizzle(self) -> Swizzle:
        """Byte-level swizzle: ``Swizzle(B, 4, 3)``."""
        return Swizzle(self.bits, 4, 3)

    def atom(self, dtype: DType = DType.FP16) -> ComposedLayout:
        """The (8 rows, span/elem elements) row-major atom: Sw<B,3,3> o (8,W/2):(W/2,1)."""
        cols = self.span_bytes // dtype.size
        return ComposedLayout(self.swizzle, Layout((8, cols), (cols, 1)))

    @property
    def desc_code(self) -> int:
        """The 2-bit ``swizzle mode`` field of the wgmma matrix descriptor (bits 62-63)."""
        return {0: 0, 128: 1, 64: 2, 32: 3}[self.value]

    @classmethod
    def from_desc_code(cls, code: int) -> "GmmaSwizzle":
        for mode in cls:
            if mode.desc_code == code:
                return mode
        raise ValueError(f"wgmma descriptor swizzle code must be 0..3; got {code!r}")

    @property
    def tma_name(self) -> str:
        """The ``CUtensorMapSwizzle`` enumerator of the TMA tensor map."""
        return "CU_TENSOR_MAP_SWIZZLE_NONE" if self is GmmaSwizzle.NONE else f"CU_TENSOR_MAP_SWIZZLE_{self.value}B"

    def __str__(self) -> str:
        return "SW_NONE" if self is GmmaSwizzle.NONE else f"SW{self.value}"


# --------------------------------------------------------------------------- descriptor

_FIELD14 = 1 << 14
_RESERVED_MASK = (0b11 << 14) | (0b11 << 30) | (0b111 << 46) | (((1 << 10) - 1) << 52)


def _check_offset(what: str, value: object, limit: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"SmemDescriptor.{what} must be an int; got {value!r}")
    if value < 0 or value >= limit:
        raise ValueError(f"SmemDescriptor.{what} must be in [0, {limit:#x}); got {value:#x}")
    if value % 16:
        raise ValueError(f"SmemDescriptor.{what} must be a multiple of 16 bytes (the low 4 bits are not encoded); got {value:#x}")
    return value


@attrs.frozen
class SmemDescriptor:
    """64-bit wgmma shared-memory matrix descriptor (PTX ISA "Matrix Descriptor" of wgmma).

    ::

        bits  0-13  start address      (addr & 0x3FFFF) >> 4
        bits 16-29  leading byte offset  LBO >> 4
        bits 32-45  stride byte offset   SBO >> 4
        bits 49-51  matrix base offset   (pattern phase when the start is not pattern-aligned)
        bits 62-63  swizzle mode         0 none, 1 128B, 2 64B, 3 32B
        bits 14-15, 30-31, 46-48, 52-61: zero

    (The sm_100 ``tcgen05`` descriptor differs: 3-bit swizzle at 61-63 and a fixed
    ``0b001`` at 46-48; this class is the sm_90 wgmma one.) Addresses are shared-window
    byte addresses; shared memory is below 256 KiB, so all three fit 18 bits.
    """

    start_address: int
    leading_byte_offset: int
    stride_byte_offset: int
    swizzle: GmmaSwizzle = attrs.field(validator=attrs.validators.instance_of(GmmaSwizzle))
    base_offset: int = 0

    def __attrs_post_init__(self) -> None:
        _check_offset("start_address", self.start_address, 1 << 18)
        _check_offset("leading_byte_offset", self.leading_byte_offset, 1 << 18)
        _check_offset("stride_byte_offset", self.stride_byte_offset, 1 << 18)
        if not isinstance(self.base_offset, int) or not 0 <= self.base_offset < 8:
            raise ValueError(f"SmemDescriptor.base_offset is a 3-bit field (0..7); got {self.base_offset!r}")

    def encode(self) -> int:
        return (
            ((self.start_address & 0x3FFFF) >> 4)
            | (self.leading_byte_offset >> 4) << 16
            | (self.stride_byte_offset >> 4) << 32
            | self.base_offset << 49
            | self.swizzle.desc_code << 62
        )

    @classmethod
    def decode(cls, desc: int) -> "SmemDescriptor":
        if not isinstance(desc, int) or not 0 <= desc < 1 << 64:
            raise ValueError(f"a wgmma descriptor is a 64-bit unsigned int; got {desc!r}")
        if desc & _RESERVED_MASK:
            raise ValueError(f"wgmma descriptor {desc:#018x} has reserved bits set ({desc & _RESERVED_MASK:#018x})")
        field = lambda lo: (desc >> lo) % _FIELD14 << 4  # noqa: E731
        return cls(field(0), field(16), field(32), GmmaSwizzle.from_desc_code(desc >> 62), (desc >> 49) & 7)

    def __str__(self) -> str:
        return (f"desc(addr={self.start_address:#x}, lbo={self.leading_byte_offset}, "
                f"sbo={self.stride_byte_offset}, {self.swizzle}, base={self.base_offset})")


# --------------------------------------------------------------------------- wgmma atom


@attrs.frozen
class WGMMA_64xNx16:
    """``wgmma.mma_async.sync.aligned.m64n{N}k16.f32.{t}.{t}``: one warpgroup, D(64xN, f32) += A(64x16) B(16xN).

    Accumulator fragment (PTX ISA "Matrix fragments for wgmma .m64nNk16", D of f32):
    thread ``t`` of the warpgroup, ``warp = t / 32``, ``lane = t % 32``,
    ``group = lane / 4``, ``quad = lane % 4``; register ``i`` in ``0 .. N/2-1``::

        row = 16*warp + group + 8*((i / 2) % 2)
        col = 8*(i / 4) + 2*quad + i % 2

    i.e. each warp owns 16 rows and, per 8-column chunk ``i / 4``, holds the mma.m16n8
    C-fragment arrangement.
    """

    dtype: DType
    n: int = 64
    M: int = 64
    K: int = 16

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n % 8 or not 8 <= self.n <= 256:
            raise ValueError(f"wgmma m64nNk16 needs N a multiple of 8 in 8..256; got N={self.n!r}")

    @property
    def N(self) -> int:
        return self.n

    @property
    def name(self) -> str:
        t = self.dtype.ptx.upper()
        return f"SM90_64x{self.n}x16_F32{t}{t}_SS"

    @property
    def ptx(self) -> str:
        t = self.dtype.ptx
        return f"wgmma.mma_async.sync.aligned.m64n{self.n}k16.f32.{t}.{t}"

    @property
    def threads(self) -> int:
        return 128

    @property
    def c_regs(self) -> int:
        """f32 accumulator registers per thread: 64*N / 128."""
        return self.n // 2

    # A from registers (PTX ISA "Matrix fragments for wgmma .m64nNk16", A of .f16/.bf16): each warp
    # holds 16 rows as the mma.m16n8k16 A fragment. Value v = 2 * reg + half of 4 32-bit registers:
    #   row = 16*warp + group + 8*(reg % 2),  col = 2*quad + half + 8*(reg / 2)
    @property
    def a_map(self) -> TVMap:
        shape = ((4, 8, 4), (2, 2, 2))
        return TVMap(
            "A_rs", 128, 8,
            row=Layout(shape, ((0, 1, 16), (0, 8, 0))),
            col=Layout(shape, ((2, 0, 0), (1, 0, 8))),
        )

    # thread = (quad 4, group 8, warp 4); value = (i%2, (i/2)%2, i/4)
    @property
    def c_map(self) -> TVMap:
        shape = ((4, 8, 4), (2, 2, self.n // 8))
        return TVMap(
            "C", 128, self.c_regs,
            row=Layout(shape, ((0, 1, 16), (0, 8, 0))),
            col=Layout(shape, ((2, 0, 0), (1, 0, 8))),
        )


# --------------------------------------------------------------------------- mbarrier + TMA

MBARRIER_MAX_COUNT = (1 << 20) - 1
"""Largest arrive count and largest pending transaction count of an mbarrier (PTX ISA mbarrier)."""


@attrs.frozen
class Mbarrier:
    """A 64-bit shared-memory ``mbarrier`` expecting ``arrive_count`` arrivals per phase."""

    name: str
    arrive_count: int = 1

    def __attrs_post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"Mbarrier name must be a C identifier; got {self.name!r}")
        if not isinstance(self.arrive_count, int) or not 1 <= self.arrive_count <= MBARRIER_MAX_COUNT:
            raise ValueError(f"Mbarrier {self.name}: arrive_count must be in 1..{MBARRIER_MAX_COUNT}; got {self.arrive_count!r}")

    @property
    def bytes(self) -> int:
        return 8


@attrs.frozen
class Box:
    """One TMA box of a tile: global origin (row0, col0) relative to the tile, smem byte offset."""

    row0: int
    col0: int
    smem_offset: int


@attrs.frozen
class TmaLoad:
    """A 2-D ``cp.async.bulk.tensor`` load of a ``box_rows x box_cols`` box (cols innermost).

    Tensor-map rules (``cuTensorMapEncodeTiled``): each box extent is 1..256, the inner
    extent times the element size is a multiple of 16 bytes, and with a swizzle it is
    at most the swizzle span. The transaction counts ``box_rows * box_cols * size``
    bytes on the mbarrier (``expect_tx``), out-of-bounds elements included (zero-filled).
    """

    box_rows: int
    box_cols: int
    dtype: DType
    swizzle: GmmaSwizzle = GmmaSwizzle.B128

    def __attrs_post_init__(self) -> None:
        for what, v in (("box_rows", self.box_rows), ("box_cols", self.box_cols)):
            if not isinstance(v, int) or not 1 <= v <= 256:
                raise ValueError(f"TmaLoad.{what} must be in 1..256 (tensor-map boxDim); got {v!r}")
        inner = self.box_cols * self.dtype.size
        if inner % 16:
            raise ValueError(f"TmaLoad inner box extent must be a multiple of 16 bytes; got {self.box_cols} x {self.dtype.size} B = {inner} B")
        if self.swizzle is not GmmaSwizzle.NONE and inner > self.swizzle.span_bytes:
            raise ValueError(
                f"TmaLoad inner box extent {inner} B exceeds the {self.swizzle} span of {self.swizzle.span_bytes} B "
                f"(box_cols={self.box_cols} {self.dtype}); split the columns into several boxes"
            )

    @property
    def bytes(self) -> int:
        """Bytes per transaction: the ``expect_tx`` count of one box."""
        return self.box_rows * self.box_cols * self.dtype.size

    def coverage(self, rows: int, cols: int) -> tuple[Box, ...]:
        """Boxes covering a ``rows x cols`` tile; box order: rows fastest, then column blocks.

        Box ``(i, j)`` (i-th row block, j-th column block) lands at smem byte offset
        ``(j * rows/box_rows + i) * bytes``: each column block is a contiguous stack of
        row blocks, the layout wgmma's K-major descriptors step through.
        """
        if rows <= 0 or cols <= 0 or rows % self.box_rows or cols % self.box_cols:
            raise ValueError(f"a {rows}x{cols} tile is not a whole number of {self.box_rows}x{self.box_cols} boxes")
        nr = rows // self.box_rows
        return tuple(
            Box(i * self.box_rows, j * self.box_cols, (j * nr + i) * self.bytes)
            for j in range(cols // self.box_cols)
            for i in range(nr)
        )



@attrs.frozen
class TmaStore(TmaLoad):
    """The same boxes written back: ``cp.async.bulk.tensor`` from shared to global memory.

    Issued by one thread after the tile's shared-memory writes were made visible to the
    async proxy (``fence.proxy.async`` + a barrier); completion is tracked by bulk groups
    (``cp.async.bulk.commit_group``, ``cp.async.bulk.wait_group.read`` before the source
    bytes are written again), not by an mbarrier. Out-of-bounds box rows are not written.
    """

# --------------------------------------------------------------------------- K-major operand tiles
#
# PTX ISA facts used here ("Asynchronous Warpgroup Level Matrix Shared Memory Layout":
# "Shared Memory Matrix Layout", "Strides", "Matrix Descriptor"):
#
# * A K-major operand is built of swizzle atoms of 8 rows (M/N) x span bytes (K); for
#   NONE the atom is one 8 x 16-byte core matrix (128 contiguous bytes).
# * SBO ("stride dimension byte offset") is the distance between consecutive 8-row
#   groups along M/N. LBO ("leading dimension byte offset") for K-major is, without
#   swizzle, the distance between the two core matrices along K of one k16 slice; for
#   swizzled K-major layouts it is not used and assumed to be 1 (encoded field 1 = 16 B).
# * The swizzle is applied to the absolute shared-memory byte address; base offset 0
#   requires the repeating pattern to start at a 256/512/1024-byte boundary
#   (32B/64B/128B), which this module requires of the tile base.


def _pattern_bytes(swizzle: GmmaSwizzle) -> int:
    """Bytes of one swizzle repeating pattern (8 rows x span); 128 (one core matrix) for NONE."""
    return 8 * swizzle.span_bytes


def _check_kmajor_tile(rows: int, k_cols: int, dtype: DType, swizzle: GmmaSwizzle) -> int:
    """Validate a K-major tile; returns the atom width in elements (span / element size)."""
    if not isinstance(swizzle, GmmaSwizzle):
        raise ValueError(f"swizzle must be a GmmaSwizzle; got {swizzle!r}")
    if dtype.size != 2:
        raise ValueError(f"K-major wgmma tiles are implemented for 16-bit elements; got {dtype}")
    span = swizzle.span_bytes // dtype.size
    if not isinstance(rows, int) or rows <= 0 or rows % 8 or rows > 256:
        raise ValueError(f"K-major tile rows must be a multiple of 8 in 8..256 (one TMA box per K block); got {rows!r}")
    if not isinstance(k_cols, int) or k_cols <= 0 or k_cols % max(span, 16):
        raise ValueError(
            f"K-major tile k_cols must be a positive multiple of {max(span, 16)} "
            f"(the {swizzle} atom width and the k16 step); got {k_cols!r}"
        )
    return span


def kmajor_tile_layout(rows: int, k_cols: int, dtype: DType = DType.FP16,
                       swizzle: GmmaSwizzle = GmmaSwizzle.B128) -> ComposedLayout:
    """(row, k) -> element offset of a K-major ``rows x k_cols`` operand tile in shared memory.

    The tile is written by ``TmaLoad(box_rows=rows, box_cols=span/2, swizzle=swizzle)``
    boxes stacked along K (``coverage(rows, k_cols)``): K block ``j`` is one box of
    ``rows`` rows x ``span`` bytes at byte ``j * rows * span``. Inside, the swizzle atom
    (8 rows x span, :meth:`GmmaSwizzle.atom`) is tiled over rows::

        Sw<B,3,3> o ((8, rows/8), (span/2, k_cols/(span/2))) : ((span/2, 4*span), (1, rows*span/2))

    Offsets are relative to a tile base aligned to the swizzle pattern
    (:func:`wgmma_kmajor_descriptors` checks that alignment).
    """
    span = _check_kmajor_tile(rows, k_cols, dtype, swizzle)
    layout = Layout(((8, rows // 8), (span, k_cols // span)), ((span, 8 * span), (1, rows * span)))
    return ComposedLayout(swizzle.swizzle, layout)


def wgmma_kmajor_descriptors(tile_base_byte_addr: int, rows: int, k_cols: int, dtype: DType = DType.FP16,
                             swizzle: GmmaSwizzle = GmmaSwizzle.B128,
                             rows_per_wgmma: int = 64) -> list[list[SmemDescriptor]]:
    """Descriptors ``[row_block][k16_step]`` for a K-major tile laid out as :func:`kmajor_tile_layout`.

    ``rows_per_wgmma`` is the wgmma M (64, operand A) or N (8..256, operand B) extent;
    row block ``m`` covers rows ``m*rows_per_wgmma ..``, k16 step ``s`` covers K
    ``16*s .. 16*s+15``. Start address: tile base + ``j * rows * span`` (the K block's
    TMA box) + ``m * rows_per_wgmma * span`` (whole atoms down the rows) + ``32 * t``
    for the ``t``-th k16 slice inside the atom's span (128B: t in 0..3; the hardware
    swizzles the absolute address, so advancing inside the atom is exact only because
    the base is pattern-aligned). Swizzled: SBO = 8 * span (next 8-row group),
    LBO = 16 (field value 1, unused). NONE: each 8-element K block is a ``rows x 16 B``
    column of core matrices, SBO = 128, LBO = rows * 16 (next core matrix along K).
    """
    span = _check_kmajor_tile(rows, k_cols, dtype, swizzle)
    align = _pattern_bytes(swizzle)
    if not isinstance(tile_base_byte_addr, int) or isinstance(tile_base_byte_addr, bool) or tile_base_byte_addr < 0:
        raise ValueError(f"tile_base_byte_addr must be a shared-memory byte address (int >= 0); got {tile_base_byte_addr!r}")
    if tile_base_byte_addr % align:
        raise ValueError(
            f"K-major {swizzle} tile base {tile_base_byte_addr:#x} is not {align}-byte aligned: the {swizzle} "
            f"pattern repeats every {align} bytes of absolute address and descriptors with base_offset 0 "
            f"(and TMA's swizzle) assume the tile starts on that boundary"
        )
    if not isinstance(rows_per_wgmma, int) or rows_per_wgmma <= 0 or rows_per_wgmma % 8 or rows % rows_per_wgmma:
        raise ValueError(f"rows_per_wgmma must be a positive multiple of 8 dividing rows={rows}; got {rows_per_wgmma!r}")
    span_b = swizzle.span_bytes
    row_bytes = rows * span_b  # one K block (TMA box)
    k16_bytes = 16 * dtype.size
    if tile_base_byte_addr + (k_cols // span) * row_bytes > 1 << 18:
        raise ValueError(f"tile at {tile_base_byte_addr:#x} of {rows}x{k_cols} does not fit the 18-bit shared-memory window")
    if swizzle is GmmaSwizzle.NONE:
        lbo, sbo = row_bytes, 128
    else:
        lbo, sbo = 16, 8 * span_b
    out: list[list[SmemDescriptor]] = []
    for m in range(rows // rows_per_wgmma):
        row_off = m * rows_per_wgmma * span_b
        descs = []
        for s in range(k_cols // 16):
            kbyte = s * k16_bytes  # byte of K within an unswizzled K-row of the tile
            if swizzle is GmmaSwizzle.NONE:
                start = tile_base_byte_addr + (kbyte // span_b) * row_bytes + row_off
            else:
                start = tile_base_byte_addr + (kbyte // span_b) * row_bytes + row_off + kbyte % span_b
            descs.append(SmemDescriptor(start, lbo, sbo, swizzle))
        out.append(descs)
    return out


def wgmma_mnmajor_descriptors(tile_base_byte_addr: int, k_rows: int, n_cols: int, dtype: DType = DType.FP16,
                              swizzle: GmmaSwizzle = GmmaSwizzle.B128) -> list[SmemDescriptor]:
    """Descriptors per k16 step for an MN-major B operand stored as :func:`kmajor_tile_layout` ``(k_rows, n_cols)``.

    The V tile of ``O += P V`` is a row-major ``keys x d`` tile (the same TMA placement as K),
    but its reduction runs down the rows, so wgmma reads it MN-major (``imm-trans-b = 1``).
    The PTX ISA canonical MN-major swizzled layout is, in elements with ``T`` per 16 bytes,
    ``((T, W/16, m), (8, k)) : ((1, T, LBO), (W/2, SBO))``: an atom is ``W`` bytes of N by 8
    rows of K, LBO steps to the next atom along N (the next TMA column box,
    ``k_rows * W`` bytes) and SBO to the next 8 rows of K (``8 * W``). k16 step ``s``
    starts ``16 * s`` rows down: ``+ 16 * s * W`` bytes.
    """
    if swizzle is GmmaSwizzle.NONE:
        raise ValueError("MN-major descriptors are implemented for the swizzled modes (32B/64B/128B)")
    _check_kmajor_tile(k_rows, n_cols, dtype, swizzle)
    if k_rows % 16:
        raise ValueError(f"an MN-major operand's K extent must be a multiple of the k16 step; got k_rows={k_rows}")
    align = _pattern_bytes(swizzle)
    if not isinstance(tile_base_byte_addr, int) or tile_base_byte_addr < 0 or tile_base_byte_addr % align:
        raise ValueError(f"MN-major {swizzle} tile base must be a {align}-byte aligned shared-memory address; got {tile_base_byte_addr!r}")
    span_b = swizzle.span_bytes
    if tile_base_byte_addr + (n_cols * dtype.size // span_b) * k_rows * span_b > 1 << 18:
        raise ValueError(f"tile at {tile_base_byte_addr:#x} of {k_rows}x{n_cols} does not fit the 18-bit shared-memory window")
    return [SmemDescriptor(tile_base_byte_addr + 16 * s * span_b, k_rows * span_b, 8 * span_b, swizzle)
            for s in range(k_rows // 16)]


def descriptor_addresses_mn(desc: SmemDescriptor, n_cols: int, k: int = 16, dtype: DType = DType.FP16) -> np.ndarray:
    """Byte address wgmma reads for element ``(n, kk)`` of an MN-major descriptor's k16 slice.

    From the ISA's canonical MN-major swizzled layout alone: ``n`` splits into the
    element within a ``W``-byte atom row and the atom index (LBO apart); ``kk`` into the
    row within 8 (``W`` bytes apart) and the 8-row group (SBO apart); then the absolute
    address is XOR-swizzled like the K-major case.
    """
    if desc.swizzle is GmmaSwizzle.NONE or desc.base_offset:
        raise NotImplementedError("descriptor_addresses_mn models swizzled, pattern-aligned descriptors only")
    width = desc.swizzle.span_bytes
    per_atom = width // dtype.size
    n = np.arange(n_cols, dtype=np.int64)[:, None]
    kk = np.arange(k, dtype=np.int64)[None, :]
    addr = (desc.start_address + (n // per_atom) * desc.leading_byte_offset + (n % per_atom) * dtype.size
            + (kk // 8) * desc.stride_byte_offset + (kk % 8) * width)
    mask = (1 << desc.swizzle.bits) - 1
    return addr ^ (((addr >> 7) & mask) << 4)


def descriptor_addresses(desc: SmemDescriptor, n_rows: int, k: int = 16, dtype: DType = DType.FP16) -> np.ndarray:
    """Byte address the hardware reads for element ``(row, kk)`` of a K-major descriptor's k slice.

    Written from the PTX ISA canonical K-major layouts, not from :func:`kmajor_tile_layout`:
    element ``(row, kk)`` sits in core matrix ``(row // 8, kbyte // 16)`` (8 rows x 16 B),
    ``kbyte = kk * size``. Without swizzle the core matrices are 128 contiguous bytes
    placed at ``SBO`` steps along rows and ``LBO`` steps along K. With a ``W``-byte
    swizzle an 8-row group is 8 rows of ``W`` bytes (SBO apart) and the K chunks are
    consecutive 16-byte granules of the row; the hardware then XORs the 16-byte granule
    bits [4, 4+B) of the *absolute* address with bits [7, 7+B) (B = 1, 2, 3 for 32/64/128B).
    """
    if desc.base_offset:
        raise NotImplementedError("descriptor_addresses models base_offset == 0 (pattern-aligned tiles) only")
    kbytes = k * dtype.size
    if desc.swizzle is not GmmaSwizzle.NONE and kbytes > desc.swizzle.span_bytes:
        raise ValueError(f"a {kbytes}-byte K slice does not fit the {desc.swizzle} span of {desc.swizzle.span_bytes} B")
    row = np.arange(n_rows, dtype=np.int64)[:, None]
    kb = (np.arange(k, dtype=np.int64) * dtype.size)[None, :]
    group, r8 = row // 8, row % 8
    chunk, within = kb // 16, kb % 16
    if desc.swizzle is GmmaSwizzle.NONE:
        return (desc.start_address + group * desc.stride_byte_offset + chunk * desc.leading_byte_offset
                + r8 * 16 + within)
    width = desc.swizzle.span_bytes
    addr = desc.start_address + group * desc.stride_byte_offset + r8 * width + chunk * 16 + within
    bits = {32: 1, 64: 2, 128: 3}[width]
    mask = (1 << bits) - 1
    return addr ^ (((addr >> 7) & mask) << 4)
