"""Which scores survive, and what a score_mod makes of them: the rule both engines' softmax stage applies.

:class:`ScoreMask` holds the built-in mask (none, causal, window; always the key tail) and, when the
kernel is built with them, the user's ``score_mod`` / ``mask_mod`` (:class:`flashgen.mods.KernelMods`).
It evaluates itself in Python and numpy (the simulators) and renders the same rule as C++: the mask
functions, and the per-value loop both emitters place before the online softmax (:meth:`apply_cpp`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import attrs
import numpy as np

from . import block_mask_cpp

if TYPE_CHECKING:
    from ..mods.kernel_mods import KernelMods


#: the key window that causal is: every key up to the query's own (left unbounded, nothing to the right)
CAUSAL_WINDOW = (-1, 0)


def key_window(causal: bool, window: "Sequence[int] | None") -> tuple[int, int]:
    """A call's ``(left, right)`` key window from its ``causal`` and ``window`` (-1: unbounded on that side); both
    given is a ValueError."""
    if causal and window is not None:
        raise ValueError(f"pass either causal=True or window=(left, right) (causal is window={CAUSAL_WINDOW})")
    if causal:
        return CAUSAL_WINDOW
    if window is None:
        return (-1, -1)
    if len(window) != 2:
        raise ValueError(f"window={tuple(window)!r}: expected (left, right), two key counts (-1: unbounded)")
    left, right = (int(x) for x in window)
    return left, right


@attrs.frozen
class ScoreMask:
    """Which scores S[i, j] (global query row i, key column j) survive; the others become -inf.

    Always: ``j < seq_k`` (tail blocks). ``causal``: ``j <= i + offset`` (offset 0 aligns
    the diagonal top-left, ``seq_k - seq_q`` bottom-right). ``window``: additionally
    ``i + offset - left <= j`` and ``j <= i + offset + right``, a negative size meaning
    unbounded on that side. Offsets and sizes are run-time arguments of the kernel.
    ``keep``/``block_range``/``block_needs_mask`` evaluate the rule in Python; ``to_cpp``
    renders the same rule as ``__host__ __device__`` functions (tests compare the two).
    """

    kind: str
    B_r: int
    B_c: int
    #: the user's score_mod / mask_mod (None: the built-in rule only). With a mask_mod a block mask (made on the
    #: GPU per call) says which blocks to skip and which are full; the scores of rows past seq_q reach no mod.
    mods: "KernelMods | None" = None

    @property
    def mask_mod(self):
        return self.mods.mask if self.mods is not None else None

    @property
    def mask_loads(self) -> bool:
        """Whether the mask_mod reads captured tensors (loads per score)."""
        if self.mask_mod is None:
            return False
        from ..mods.expr import Load, postorder  # mods' package imports torch: only for kernels with mods

        return any(isinstance(n, Load) for n in postorder(self.mask_mod.expr))

    @property
    def mask_bits(self) -> bool:
        """Whether the mask_mod is evaluated into bits at the start of a block (:meth:`bits_cpp`): when it
        reads captured tensors, whose loads then run under the S GEMM; an arithmetic mask_mod (causal, prefix
        LM) is cheaper evaluated in place."""
        return self.mask_loads

    @property
    def score_mod(self):
        return self.mods.score if self.mods is not None else None

    @property
    def bias(self) -> bool:
        """Whether the score_mod adds a bias to the score (:attr:`KernelMods.bias`): the forward kernels start
        the S accumulator at the bias over the scale (:meth:`init_cpp`) and run the softmax at the usual scale."""
        return self.mods is not None and self.mods.bias is not None

    def forward_softmax_scale(self, scale: float) -> float:
        """The scale the forward's softmax takes the rule's results at: 1 where a score_mod's results enter it
        as they are (the score_mod saw softmax_scale), else softmax_scale."""
        return 1.0 if self.score_mod is not None and not self.bias else scale

    def row_range(self, i: int, seq_k: int, offset: int = 0, left: int = -1, right: int = -1) -> tuple[int, int]:
        """Key columns ``[lo, hi)`` kept for query row ``i`` (possibly empty)."""
        lo, hi = 0, seq_k
        if self.kind == "causal":
            hi = min(hi, i + offset + 1)
        elif self.kind == "window":
            if right >= 0:
                hi = min(hi, i + offset + right + 1)
            if left >= 0:
                lo = max(lo, i + offset - left)
        return lo, hi

    def keep(self, i: int, j: int, seq_k: int, offset: int = 0, left: int = -1, right: int = -1) -> bool:
        lo, hi = self.row_range(i, seq_k, offset, left, right)
        return lo <= j < hi

    def block_range(self, q_row0: int, seq_q: int, seq_k: int, offset: int = 0, left: int = -1, right: int = -1) -> tuple[int, int]:
        """``[j_begin, j_end)``: the key blocks holding any kept score for rows ``[q_row0, q_row0 + B_r)``."""
        n = -(-seq_k // self.B_c)
        last = min(q_row0 + self.B_r, seq_q) - 1
        begin, end = 0, n
        if self.kind == "causal" or (self.kind == "window" and right >= 0):
            hi = last + offset + (right if self.kind == "window" else 0)
            end = min(n, max(0, hi // self.B_c + 1)) if hi >= 0 else 0
        if self.kind == "window" and left >= 0:
            lo = q_row0 + offset - left
            begin = max(0, lo // self.B_c)
        return begin, max(begin, end)

    def block_needs_mask(self, jb: int, q_row0: int, seq_q: int, seq_k: int, offset: int = 0, left: int = -1, right: int = -1) -> bool:
        """False when every score of key block ``jb`` for these rows is kept (the mask can be skipped)."""
        c0, c1 = jb * self.B_c, (jb + 1) * self.B_c - 1
        last = min(q_row0 + self.B_r, seq_q) - 1
        if c1 >= seq_k:
            return True
        if self.kind == "causal":
            return c1 > q_row0 + offset
        if self.kind == "window":
            return (right >= 0 and c1 > q_row0 + offset + right) or (left >= 0 and c0 < last + offset - left)
        return False

    def masked_path(self, jb: int, q_row0: int, seq_q: int, seq_k: int, offset: int = 0, left: int = -1,
                    right: int = -1, row: "Sequence[int] | None" = None) -> bool:
        """Whether key block ``jb`` takes the masked path: the built-in rule needs it, or a mask_mod is
        compiled in and the block mask's ``row`` (None: no block mask) does not call the block full."""
        if self.block_needs_mask(jb, q_row0, seq_q, seq_k, offset, left, right):
            return True
        return self.mask_mod is not None and (row is None or row[2 + jb] != 2)

    def tile_cpp(self, row: str, b: str, h: str, qb: str, heads: str, begin: str, end: str) -> list[str]:
        """Lines after a tile's ``kv_block_range``: its block-mask row ``row`` (a mask_mod only) and the key
        blocks ``[begin, end)`` clipped to the blocks the mask_mod keeps: they start and end on non-empty blocks,
        and :meth:`next_cpp` steps over the empty ones between."""
        if self.mask_mod is None:
            return []
        return [f"const int* {row} = block_mask_row(p.block_mask, {b}, {h}, {qb}, {heads}, p.seq_q, p.seq_k);",
                f"block_mask_clip({row}, &{begin}, &{end});  // key blocks the mask_mod keeps (block mask)"]

    def next_cpp(self, row: str, j: str, end: str) -> str:
        """The key block a tile walks after block ``j`` (of ``[begin, end)`` as :meth:`tile_cpp` leaves it):
        ``j + 1``, or with a mask_mod the next block the block mask does not call empty (``end`` if none)."""
        return f"{j} + 1" if self.mask_mod is None else f"block_mask_next({row}, {j}, {end})"

    def masked_cpp(self, row: str, j: str) -> str:
        """The condition, after ``block_needs_mask(...)``, that sends block ``j`` down the masked path."""
        return "" if self.mask_mod is None else f" || block_mask_partial({row}, {j})"

    def mask_blocks_cpp(self, name: str, transposed: bool = False, tile_order: bool = False) -> str:
        """The block mask's kernels and entry points (a mask_mod only): :func:`block_mask_cpp.kernels_cpp`;
        ``tile_order`` as in :meth:`to_cpp`."""
        return "" if self.mask_mod is None else block_mask_cpp.kernels_cpp(self.mods, name, transposed, tile_order)

    def kernel_name(self, base: str) -> str:
        """A kernel's name: ``base`` (the config's), tagged with the mods' structure where built with them."""
        return base if self.mods is None else self.mods.kernel_name(base)

    def params_cpp(self, backward: bool = False) -> list[str]:
        """The kernel parameters the mods read (none without mods; ``backward``: a backward kernel's)."""
        return [] if self.mods is None else self.mods.params_cpp(backward=backward)

    def fill_cpp(self, backward: bool = False) -> list[str]:
        """Host lines of the launch function filling them (``p`` from ``a``; ``backward``: a backward kernel's)."""
        return [] if self.mods is None else self.mods.fill_cpp(backward=backward)

    def keep_array(self, rows: np.ndarray, cols: np.ndarray, seq_k: int, offset: int = 0, left: int = -1,
                   right: int = -1) -> np.ndarray:
        """:meth:`keep` over broadcast index arrays (the built-in rule only)."""
        lo, hi = np.zeros_like(rows), np.full_like(rows, seq_k)
        if self.kind == "causal":
            hi = np.minimum(hi, rows + offset + 1)
        elif self.kind == "window":
            if right >= 0:
                hi = np.minimum(hi, rows + offset + right + 1)
            if left >= 0:
                lo = np.maximum(lo, rows + offset - left)
        return (lo <= cols) & (cols < hi)

    def apply(self, s: np.ndarray, rows: np.ndarray, cols: np.ndarray, masked: bool, *, b: int, h: int, seq_q: int,
              seq_k: int, mask_args: Sequence[int] = (), mod_values: tuple = (None, None), scale: float = 1.0,
              forward: bool = False) -> np.ndarray:
        """The scores after this rule, as :meth:`apply_cpp`'s loop leaves them (fp32): ``s`` the raw
        accumulator values, ``rows``/``cols`` their global indices (broadcast to ``s``), ``masked`` whether
        the block takes the masked path (:meth:`block_needs_mask`); ``mod_values``: the score and mask mods'
        values (:meth:`flashgen.mods.ModArgs.values`); ``scale``: softmax_scale, which a score_mod sees.
        ``forward``: as the forward kernels run it, where a score_mod that adds a bias gives ``s`` plus the bias
        over the scale where kept (:meth:`init_cpp` starts an unmasked block's accumulator at it, rows past seq_q
        at 0), at the softmax's usual scale (:meth:`forward_softmax_scale`)."""
        f32 = np.float32
        s = np.asarray(s, dtype=f32)
        rows, cols = np.broadcast_to(rows, s.shape), np.broadcast_to(cols, s.shape)
        if self.mods is None:
            return np.where(self.keep_array(rows, cols, seq_k, *mask_args), s, f32(-np.inf)) if masked else s
        keep = self.keep_scores(rows, cols, masked, b, h, seq_q, seq_k, mask_args, mod_values)
        out = np.where(keep, s, f32(-np.inf)) if masked else s.copy()
        sel = np.nonzero(keep)
        if forward and self.bias:
            from ..mods.bias import INV_SCALE
            from ..mods.evaluate import evaluate

            inputs = {"b": b, "h": h, "q_idx": rows[sel], "kv_idx": cols[sel], INV_SCALE.name: f32(1) / f32(scale)}
            out[sel] = (s[sel] + evaluate(self.mods.bias, inputs, mod_values[0] or {})).astype(f32)
        elif self.score_mod is not None:
            scaled = (s[sel] * f32(scale)).astype(f32)
            out[sel] = self.score_mod.evaluate(scaled, b, h, rows[sel], cols[sel], args=mod_values[0])
        return out

    def keep_scores(self, rows, cols, masked: bool, b: int, h: int, seq_q: int, seq_k: int, mask_args, mod_values) -> np.ndarray:
        """Where :meth:`apply` keeps a score (with mods): rows before seq_q, and in masked blocks the built-in rule
        and the mask_mod, which the kernel asks only where the rest of the rule keeps."""
        keep = rows < seq_q
        if masked:
            keep = keep & self.keep_array(rows, cols, seq_k, *mask_args)
            if self.mask_mod is not None:
                sel = np.nonzero(keep)
                keep[sel] = self.mask_mod.evaluate(b, h, rows[sel], cols[sel], args=mod_values[1]).astype(bool)
        return keep

    def score_grad(self, ds: np.ndarray, prob: np.ndarray, s: np.ndarray, rows: np.ndarray, cols: np.ndarray, *, b: int,
                   h: int, mod_values: tuple = (None, None), scale: float = 1.0) -> np.ndarray:
        """:meth:`score_grad_cpp` in numpy (the backward simulators'): ``ds`` (fp32, P (dP - D)) times the score_mod's
        derivative at the scaled raw scores ``s * scale`` where ``prob`` is not 0; ``rows``/``cols`` broadcast to ``s``."""
        f32 = np.float32
        kind = self.mods.derivative_kind if self.mods is not None else "one"
        ds = np.asarray(ds, dtype=f32)
        if kind == "one":
            return ds
        if kind == "zero":
            return np.zeros_like(ds)
        from ..mods.evaluate import evaluate  # mods' package imports torch: only for kernels with mods

        s = np.asarray(s, dtype=f32)
        rows, cols = np.broadcast_to(rows, s.shape), np.broadcast_to(cols, s.shape)
        sel = np.nonzero(np.asarray(prob) != 0)
        inputs = {"score": (s[sel] * f32(scale)).astype(f32), "b": b, "h": h, "q_idx": rows[sel], "kv_idx": cols[sel]}
        out = ds.copy()
        out[sel] = (ds[sel] * evaluate(self.mods.score_derivative(), inputs, mod_values[0] or {})).astype(f32)
        return out

    def bits_cpp(self, loops: Sequence[str], i: str, c0: str, bits: str, b: str, h: str) -> list[str]:
        """The mask_mod of one key block's fragment as bits (a mask_mod only), made at the start of the block
        so that its loads (a document id per key, say) run under the block's S GEMM rather than in the
        softmax after it: bit ``2 t + e`` of ``bits`` (one uint64_t per row half) is the mask_mod of n tile
        ``t``, element ``e``; 0 past seq_q and seq_k, where the mask_mod is not asked. Arguments as
        :meth:`apply_cpp` (``c0`` the same for every row half); in masked blocks only.

        Columns outer, the thread's rows inner, every score evaluated (a row past seq_q at the last row, a column
        past seq_k at the last key, their bits cleared): no load is conditional, so the compiler loads a row's
        values (a document id per query) once and a column's once for all rows, holding one column's at a time.
        (Without the clearing of columns past seq_k, which the built-in range test of the key tail's block
        would do too, ptxas spilled 4-32 bytes for a score_mod with a document mask.)"""
        if not self.mask_bits:
            return []
        row = [f"const int i = {i};",
               f"if (mask_mod({b}, {h}, i < p.seq_q ? i : p.seq_q - 1, c_at, p.mask_args) & real & (i < p.seq_q)) "
               f"{bits} |= uint64_t(1) << (2 * t + e);"]
        column = ["const int c = c0 + int(t * 8 + e);", "const bool real = c < p.seq_k;",
                  "const int c_at = real ? c : p.seq_k - 1;"] + _nest(loops, row)
        body = _nest(loops, [f"{bits} = 0;"]) + [f"const int c0 = {c0};"] + _per_value(column)
        return ["// the mask_mod's bits of this block, loads issued ahead of the S GEMM's wait"] + _if_masked(body)

    def apply_cpp(self, loops: Sequence[str], i: str, c0: str, value: str, b: str, h: str, bits: str = "") -> list[str]:
        """The rule on one S accumulator fragment, before the online softmax. ``loops``: the loop headers
        over the thread's row halves (innermost ``h``); ``i``/``c0``: the global row and the first key column
        there; ``value``: the accumulator value of n tile ``t`` and element ``e`` (a format string with
        ``{t}``); ``b``/``h``: the batch and query head; ``bits``: the row half's mask_mod bits
        (:meth:`bits_cpp`). The mask runs in masked blocks (``masked``, a compile-time flag of the enclosing
        function); a score_mod runs in every block."""
        at = value.format(t="t")
        masked = [f"const int i = {i};", "int lo, hi;",
                  "score_row_range(i, p.seq_k, p.mask_offset, p.window_left, p.window_right, &lo, &hi);",
                  f"const int c0 = {c0};", "lo -= c0; hi -= c0;"]
        if self.mods is None:
            masked += _per_value([f"if (int(t * 8 + e) < lo || int(t * 8 + e) >= hi) {at} = -INFINITY;"])
            return _if_masked(_nest(loops, masked))
        mods = []
        if self.mask_mod is not None:
            mods.append(f"keep = keep && (({bits} >> (2 * t + e)) & 1);" if self.mask_bits else
                        f"keep = keep && mask_mod_at({b}, {h}, i, 0, c0, c, p.mask_args);")
        # the column as base and compile-time offset (flashgen.mods.ranges: index conversions split), the raw score
        # and the scale the score_mod sees it at (folded into its factor where it has one: flashgen.mods.cpp); a
        # bias joins the raw score over the scale (init_cpp's, in masked blocks where kept)
        score = (f"{at} + score_bias_at(bias_tile, p.bias_scale, {b}, {h}, i, 0, c0, c, p.score_args)" if self.bias else
                 f"score_mod_at({at}, p.mod_scale, {b}, {h}, i, 0, c0, c, p.score_args)")
        mods.append(f"{at} = keep ? {score} : -INFINITY;" if self.score_mod is not None else f"if (!keep) {at} = -INFINITY;")
        masked.append("const bool real = i < p.seq_q;  // rows past seq_q reach no mod")
        ranged = _per_value(["const int c = int(t * 8 + e);", "bool keep = real && c >= lo && c < hi;"] + mods)
        split = self.mask_mod is not None and self.score_mod is None
        if not split:  # the built-in rule or the key tail sent the block here, or a score_mod's work dominates
            masked += ranged  # (and its registers: with a split, mma_sync d128's softcap + document spilled)
        else:  # most blocks come for the mask_mod alone: the built-in rule's range is tested where it cuts
            whole = "bool keep = true;  // the bits are 0 past seq_q" if self.mask_bits else "bool keep = real;"
            masked += ["if (ranged) {"] + ["    " + l for l in ranged] + ["} else {"] + ["    " + l for l in _per_value(
                ["const int c = int(t * 8 + e);", whole] + mods)] + ["}"]
        rows = _nest(loops, masked)
        if split:
            rows = ["const bool ranged = block_needs_mask(j, q_row0, p.seq_q, p.seq_k, p.mask_offset, p.window_left, p.window_right);"] + rows
        out = _if_masked(rows)
        if self.score_mod is None or self.bias:  # a bias is in unmasked blocks' accumulators already
            return out
        plain = [f"const int i = {i};", f"const int c0 = {c0};", "if (i < p.seq_q)  // rows past seq_q reach no mod"]
        plain += ["    " + l for l in _per_value([f"{at} = score_mod_at({at}, p.mod_scale, {b}, {h}, i, 0, c0, int(t * 8 + e), p.score_args);"])]
        return out[:-1] + ["} else {  // unmasked block: the score_mod alone"] + ["    " + l for l in _nest(loops, plain)] + ["}"]

    def init_cpp(self, loops: Sequence[str], i: str, c0: str, value: str, b: str, h: str) -> list[str]:
        """Where the forward's S accumulator starts, before the S GEMM (a score_mod that adds a bias only: else
        nothing, the GEMM starts from 0): in unmasked blocks the bias over the scale (:attr:`bias`), 0 in rows past
        seq_q; masked blocks start from 0 and :meth:`apply_cpp` adds it where kept. Arguments as :meth:`apply_cpp`.
        The engines start the GEMM on the accumulator in unmasked blocks (:meth:`s_gemm_adds_cpp`)."""
        if not self.bias:
            return []
        at = value.format(t="t")
        rows = [f"const int i = {i};", f"const int c0 = {c0};", "if (i < p.seq_q) {  // rows past seq_q reach no mod"]
        rows += ["    " + l for l in _per_value([f"{at} = score_bias_at(bias_tile, p.bias_scale, {b}, {h}, i, 0, c0, int(t * 8 + e), p.score_args);"])]
        rows += ["} else {"] + ["    " + l for l in _per_value([f"{at} = 0.f;"])] + ["}"]
        return (["if constexpr (!decltype(masked)::value) {  // S starts at the score_mod's bias over the scale"]
                + ["    " + l for l in _nest(loops, rows)] + ["}"])

    def bias_tile_cpp(self, b: str, h: str) -> list[str]:
        """A forward tile's first line (batch ``b``, head ``h``; a bias only): ``bias_tile``, the bias's values that
        hold for the whole tile (its captured tensors read once: ALiBi's slope), for :meth:`init_cpp` and
        :meth:`apply_cpp`."""
        if not self.bias:
            return []
        return [f"const score_bias_tile bias_tile = score_bias_tile_of(p.bias_scale, {b}, {h}, p.score_args);  // once per tile"]

    def s_gemm_adds_cpp(self) -> str:
        """Whether the S GEMM of a block adds onto the accumulator (C++ bool): in unmasked blocks of a kernel with a
        bias (:meth:`init_cpp` put it there), else never (the GEMM's first step overwrites it)."""
        return "!decltype(masked)::value" if self.bias else "false"

    # ---- the backward's side of the rule ----------------------------------------------------

    def backward_masked_cpp(self, needs: str) -> str:
        """The backward's ``masked`` flag of work item (query head ``head``, query block ``qb``) of key block ``kb``
        (batch ``batch``): the built-in rule's ``needs`` (a C++ bool), or with a mask_mod also where the block mask
        does not call the block full (every block without one)."""
        if self.mask_mod is None:
            return needs
        return f"{needs} || bwd_block_mask_partial(p.block_mask, batch, head, kb, qb, p.heads, p.seq_q, p.seq_k)"

    def backward_clip_cpp(self, deterministic: bool) -> list[str]:
        """Lines after a backward CTA's ``q_block_range``: its query blocks ``[qb_begin, qb_end)`` clipped to those
        the block mask keeps a score in for any query head of the kv head's group (a mask_mod only). Not in the
        deterministic variant: there a key block adds dQ of a query block at its rank among the key blocks of the
        built-in range (``key_rank``), each passing its turn, so every one of them must visit the block."""
        if self.mask_mod is None:
            return []
        if deterministic:
            return ["// deterministic: the built-in range unclipped (key_rank counts every key block of it); full blocks still skip the mask"]
        return ["bwd_block_mask_clip(p.block_mask, batch, kv_head * p.kv_group, p.kv_group, kb, p.heads, p.seq_q, p.seq_k, &qb_begin, &qb_end);"]

    def backward_masked(self, needs: bool) -> bool:
        """:meth:`backward_masked_cpp` in Python (the backward simulators')."""
        return needs or self.mask_mod is not None

    def backward_items_cpp(self, loop: Callable[[list[str]], list[str]], body: Callable[[bool], list[str]]) -> list[str]:
        """An item's loop over its recomputed scores: ``loop(lines)`` wraps ``lines`` in it and ``body(masked)``
        makes them (with :meth:`recompute_cpp`'s variant ``masked``: None for the one loop). Two loops under the
        item's ``masked`` but where a score_mod whose derivative reads the score (softcap) meets a mask_mod that
        loads captured tensors (a document mask): where nothing is masked (most items) no score
        pays for the rule's predicated range tests (the wgmma consumer's loop: 153 -> 62 ISETP) or for a mask_mod
        (evaluated, predicated, in full items too by one loop), and a score_mod runs on every score
        unconditionally, so the compiler hoists its index-free loads (ALiBi's slope: one load an item instead of
        one a score; softcap's wgmma consumer stopped spilling 96 bytes)."""
        if self.derivative_reads_score and self.mask_loads:  # a score-reading derivative beside a mask_mod that loads:
            return loop(body(None))  # the second loop made the wgmma consumer spill (8 bytes, softcap + document mask)
        return _block("if (masked) {", loop(body(True)))[:-1] + _block(
            "} else {  // nothing masked: the score_mod (if any) alone, on every score", loop(body(False)))

    def recompute_cpp(self, s: str, i: str, j: str, b: str, h: str, grad: str = "", masked: "bool | None" = None) -> list[str]:
        """The backward's rule on one recomputed score: lvalue ``s`` (the raw accumulator value of global query
        row ``i``, key ``j``; ``b``/``h`` the batch and query head) becomes the score the forward's softmax saw,
        -inf where not kept (the mask is evaluated where the item is ``masked``, the rows past seq_q included).
        ``grad``: a float lvalue taking ``d score_mod / d score`` there (0 where not kept), for a derivative that
        reads the score (``KernelMods.derivative_kind`` "score"), whose value dS needs after the score is gone.
        ``masked``: None, one loop for every item (the mask under the item's ``masked``); True, the loop of
        masked items; False, the loop of items where nothing is masked (every index in range: see
        :meth:`backward_items_cpp`), the score_mod alone."""
        if masked is False:
            return [] if self.score_mod is None else self._score_mod_cpp(s, i, j, b, h, grad)
        guard = (lambda lines: _block("if (masked) {", lines)) if masked is None else (lambda lines: lines)
        rule = ["int lo, hi;", f"score_row_range({i}, p.seq_k, p.mask_offset, p.window_left, p.window_right, &lo, &hi);"]
        if self.mods is None:
            return guard(rule + [f"if ({j} < lo || {j} >= hi || {i} >= p.seq_q) {s} = -INFINITY;"])
        keep = [f"keep = {j} >= lo && {j} < hi && {i} < p.seq_q;  // rows past seq_q reach no mod"]
        if self.mask_mod is not None:  # only where kept so far: evaluated at every score (as the forward's bits_cpp),
            # its loads shared across the fragment held registers the wgmma consumer spilled (44 bytes, document mask)
            keep.append(f"keep = keep && mask_mod({b}, {h}, {i}, {j}, p.mask_args);")
        out = ["bool keep = true;"] + guard(rule + keep)
        if self.score_mod is None:
            return out + [f"if (!keep) {s} = -INFINITY;"]
        dropped = [f"{s} = -INFINITY;"] + ([f"{grad} = 0.f;"] if self.derivative_reads_score else [])
        return out + _block("if (keep) {", self._score_mod_cpp(s, i, j, b, h, grad))[:-1] + _block("} else {", dropped)

    def recompute_reads_indices(self, masked: "bool | None" = None) -> bool:
        """Whether :meth:`recompute_cpp` with this ``masked`` reads the score's indices (a loop of items where nothing
        is masked, without a score_mod, reads none)."""
        return masked is not False or self.score_mod is not None

    def _score_mod_cpp(self, s: str, i: str, j: str, b: str, h: str, grad: str) -> list[str]:
        """:meth:`recompute_cpp`'s score_mod (and its derivative, where dS needs it from the score) on a kept score."""
        args = f"{b}, {h}, {i}, {j}, p.score_args"
        return [f"const float x = {s} * p.mod_scale;  // the score_mod sees the scaled score",
                *([f"{grad} = score_mod_grad(x, {args});"] if self.derivative_reads_score else []),
                f"{s} = score_mod(x, {args});"]

    def score_grad_cpp(self, ds: str, prob: str, i: str, j: str, b: str, h: str, grad: str = "") -> list[str]:
        """The score_mod's chain rule on the backward's ``ds`` (the gradient of the modded score, P (dP - D)):
        times ``d score_mod / d score`` (``grad`` as :meth:`recompute_cpp` left it, or evaluated here from the
        indices), where ``prob`` is not 0 (elsewhere ds is 0 and the derivative need not be finite). Nothing
        without a score_mod or for a bias (derivative 1)."""
        kind = self.mods.derivative_kind if self.mods is not None else "one"
        if kind == "one":
            return []
        if kind == "zero":
            return [f"{ds} = 0.f;  // the score_mod ignores the score: nothing flows back to Q and K"]
        g = grad if kind == "score" else f"score_mod_grad(0.f, {b}, {h}, {i}, {j}, p.score_args)"
        return [f"if ({prob} != 0.f) {ds} *= {g};  // d score_mod / d score"]

    @property
    def derivative_reads_score(self) -> bool:
        """Whether the score_mod's derivative reads the score (``KernelMods.derivative_kind`` "score"): the
        backward then makes dS in the pass that recomputes P (:meth:`recompute_cpp`'s ``grad``)."""
        return self.mods is not None and self.mods.derivative_kind == "score"

    def to_cpp(self, backward: bool = False, tile_order: bool = False) -> str:
        """The three functions above as C++ (floor division where operands may be negative); ``backward``: with
        the score_mod's derivative (a backward kernel's); ``tile_order``: a mask_mod's block mask holds a tile
        order (a persistent forward's, :attr:`flashgen.attention.scheduler.TileScheduler.ordered`)."""
        kind = self.kind
        row = ["int l = 0, h = seq_k;"]
        if kind == "causal":
            row.append("if (i + offset + 1 < h) h = i + offset + 1;")
        elif kind == "window":
            row.append("if (right >= 0 && i + offset + right + 1 < h) h = i + offset + right + 1;")
            row.append("if (left >= 0 && i + offset - left > l) l = i + offset - left;")
        row.append("*lo = l; *hi = h;")
        rng = [
            "const int n = (seq_k + B_c - 1) / B_c;",
            "const int last = (q_row0 + (int)B_r < seq_q ? q_row0 + (int)B_r : seq_q) - 1;",
            "int begin = 0, end = n;",
            "(void)last;",
        ]
        if kind in ("causal", "window"):
            hi = "last + offset" + (" + right" if kind == "window" else "")
            cond = "" if kind == "causal" else "if (right >= 0) "
            rng.append(f"{cond}{{ const int hi = {hi}; end = hi >= 0 ? (hi / (int)B_c + 1 < n ? hi / (int)B_c + 1 : n) : 0; }}")
        if kind == "window":
            rng.append("if (left >= 0) { const int lo = q_row0 + offset - left; begin = lo > 0 ? lo / (int)B_c : 0; }")
        rng.append("*j_begin = begin; *j_end = end > begin ? end : begin;")
        need = ["const int c0 = jb * (int)B_c, c1 = (jb + 1) * (int)B_c - 1;", "const int last = (q_row0 + (int)B_r < seq_q ? q_row0 + (int)B_r : seq_q) - 1;", "(void)c0; (void)last;", "if (c1 >= seq_k) return true;"]
        if kind == "causal":
            need.append("return c1 > q_row0 + offset;")
        elif kind == "window":
            need.append("return (right >= 0 && c1 > q_row0 + offset + right) || (left >= 0 && c0 < last + offset - left);")
        else:
            need.append("return false;")
        sig = "int seq_q, int seq_k, int offset, int left, int right"
        ind = lambda lines: "\n".join("    " + l for l in lines)
        return (
            f"// score mask '{kind}' (ScoreMask in the plan): key columns [lo, hi) kept for query row i\n"
            f"__host__ __device__ __forceinline__ void score_row_range(int i, int seq_k, int offset, int left, int right, int* lo, int* hi) {{\n"
            f"    (void)i; (void)offset; (void)left; (void)right;\n{ind(row)}\n}}\n"
            f"// key blocks [j_begin, j_end) holding any kept score of the CTA's rows [q_row0, q_row0 + B_r)\n"
            f"__host__ __device__ __forceinline__ void kv_block_range(int q_row0, {sig}, int* j_begin, int* j_end) {{\n"
            f"    (void)offset; (void)left; (void)right;\n{ind(rng)}\n}}\n"
            f"// false when every score of key block jb is kept for these rows\n"
            f"__host__ __device__ __forceinline__ bool block_needs_mask(int jb, int q_row0, {sig}) {{\n"
            f"    (void)offset; (void)left; (void)right; (void)seq_q;\n{ind(need)}\n}}"
        ) + (f"\n// ---- score_mod / mask_mod: {self.mods.describe()}\n{self.mods.to_cpp(backward)}" if self.mods is not None else "") + (
            self.block_mask_fns_cpp(backward, tile_order) if self.mask_mod is not None else "")

    def block_mask_fns_cpp(self, backward: bool = False, tile_order: bool = False) -> str:
        """The functions reading the block mask (a mask_mod only): :func:`block_mask_cpp.reading_cpp`."""
        return block_mask_cpp.reading_cpp(self.mods, backward, tile_order)


def _block(head: str, body: Sequence[str]) -> list[str]:
    return [head] + ["    " + l for l in body] + ["}"]


def _per_value(body: Sequence[str]) -> list[str]:
    """``body`` for every value of the fragment's row half: n tiles ``t``, elements ``e``."""
    head = ["#pragma unroll", "for (uint32_t t = 0; t < B_c / 8; ++t)", "    #pragma unroll"]
    if len(body) == 1:
        return head + ["    for (uint32_t e = 0; e < 2; ++e)", "        " + body[0]]
    return head + ["    for (uint32_t e = 0; e < 2; ++e) {"] + ["        " + l for l in body] + ["    }"]


def _nest(loops: Sequence[str], body: Sequence[str]) -> list[str]:
    """``body`` inside the unrolled ``loops`` (the last one opens the body's braces)."""
    out: list[str] = []
    for depth, loop in enumerate(loops):
        pad = "    " * depth
        out += [pad + "#pragma unroll", pad + loop + (" {" if depth == len(loops) - 1 else "")]
    pad = "    " * len(loops)
    return out + [pad + l for l in body] + ["    " * (len(loops) - 1) + "}"]


def _if_masked(lines: Sequence[str]) -> list[str]:
    return ["if constexpr (decltype(masked)::value) {  // score mask + key tail, only in blocks that need it"] + [
        "    " + l for l in lines] + ["}"]
