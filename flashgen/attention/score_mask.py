"""Which scores survive, and what a score_mod makes of them: the rule both engines' softmax stage applies.

:class:`ScoreMask` holds the built-in mask (none, causal, window; always the key tail) and, when the
kernel is built with them, the user's ``score_mod`` / ``mask_mod`` (:class:`flashgen.mods.KernelMods`).
It evaluates itself in Python and numpy (the simulators) and renders the same rule as C++: the mask
functions, and the per-value loop both emitters place before the online softmax (:meth:`apply_cpp`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import attrs
import numpy as np

if TYPE_CHECKING:
    from ..mods.kernel_mods import KernelMods


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
    def mask_bits(self) -> bool:
        """Whether the mask_mod is evaluated into bits at the start of a block (:meth:`bits_cpp`): when it
        reads captured tensors, whose loads then run under the S GEMM; an arithmetic mask_mod (causal, prefix
        LM) is cheaper evaluated in place."""
        if self.mask_mod is None:
            return False
        from ..mods.expr import Load, postorder  # mods' package imports torch: only for kernels with mods

        return any(isinstance(n, Load) for n in postorder(self.mask_mod.expr))

    @property
    def score_mod(self):
        return self.mods.score if self.mods is not None else None

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

    def _block_row_cpp(self) -> str:
        b = "b" if self.mods.uses("b") else "0"
        extent, h = ("heads", "h") if self.mods.uses("h") else ("1", "0")
        return f"(({b}) * {extent} + {h}) * n_qb + qb"

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

    def mask_blocks_cpp(self, name: str, transposed: bool = False) -> str:
        """The block mask's kernels, ``<name>_block_mask_numel(args)`` and ``<name>_mask_blocks(args, out, stream)``
        (a mask_mod only; ``args`` the TU's own argument struct). ``transposed``: the backward's, a row per key block
        and a class per query block (:meth:`flashgen.mods.KernelMods.block_mask_shape`)."""
        if self.mask_mod is None:
            return ""
        fill = "\n".join("    " + l for l in self.mods.fill_cpp(p="m"))
        fields = " ".join(f.split("//")[0].strip() for f in self.mods.params_cpp())
        rows, classes, what = ("kb", "qb", "query") if transposed else ("qb", "kb", "key")
        return _MASK_BLOCKS.replace("$NAME", name).replace("$FILL", fill).replace("$FIELDS", fields).replace(
            "$NH", "a->heads" if self.mods.uses("h") else "1").replace("$NB", "a->batch" if self.mods.uses("b") else "1").replace(
            "$RB", rows).replace("$CB", classes).replace("$CWHAT", what)

    def kernel_name(self, base: str) -> str:
        """A kernel's name: ``base`` (the config's), tagged with the mods' structure where built with them."""
        return base if self.mods is None else self.mods.kernel_name(base)

    def params_cpp(self) -> list[str]:
        """The kernel parameters the mods read (none without mods)."""
        return [] if self.mods is None else self.mods.params_cpp()

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
              seq_k: int, mask_args: Sequence[int] = (), mod_values: tuple = (None, None), scale: float = 1.0) -> np.ndarray:
        """The scores after this rule, as :meth:`apply_cpp`'s loop leaves them (fp32): ``s`` the raw
        accumulator values, ``rows``/``cols`` their global indices (broadcast to ``s``), ``masked`` whether
        the block takes the masked path (:meth:`block_needs_mask`); ``mod_values``: the score and mask mods'
        values (:meth:`flashgen.mods.ModArgs.values`); ``scale``: softmax_scale, which a score_mod sees."""
        f32 = np.float32
        s = np.asarray(s, dtype=f32)
        rows, cols = np.broadcast_to(rows, s.shape), np.broadcast_to(cols, s.shape)
        if self.mods is None:
            return np.where(self.keep_array(rows, cols, seq_k, *mask_args), s, f32(-np.inf)) if masked else s
        real = rows < seq_q
        keep = real & self.keep_array(rows, cols, seq_k, *mask_args) if masked else real
        if masked and self.mask_mod is not None:
            sel = np.nonzero(keep)  # the kernel asks the mask_mod only where the rest of the rule keeps
            keep[sel] = self.mask_mod.evaluate(b, h, rows[sel], cols[sel], args=mod_values[1]).astype(bool)
        out = np.where(keep, s, f32(-np.inf)) if masked else s.copy()
        if self.score_mod is not None:
            sel = np.nonzero(keep)
            scaled = (s[sel] * f32(scale)).astype(f32)
            out[sel] = self.score_mod.evaluate(scaled, b, h, rows[sel], cols[sel], args=mod_values[0])
        return out

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
        :meth:`apply_cpp`; in masked blocks only."""
        if not self.mask_bits:
            return []
        per = ["const int c = c0 + int(t * 8 + e);",
               f"if (c < p.seq_k && mask_mod({b}, {h}, i, c, p.mask_args)) m |= uint64_t(1) << (2 * t + e);"]
        body = [f"const int i = {i};", f"const int c0 = {c0};", "uint64_t m = 0;", "if (i < p.seq_q)  // rows past seq_q reach no mod"]
        body += ["    " + l for l in _per_value(per)] + [f"{bits} = m;"]
        return ["// the mask_mod's bits of this block, loads issued ahead of the S GEMM's wait"] + _if_masked(_nest(loops, body))

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
        per = ["const int c = int(t * 8 + e);", "bool keep = real && c >= lo && c < hi;"]
        if self.mask_mod is not None:
            per.append(f"keep = keep && (({bits} >> (2 * t + e)) & 1);" if self.mask_bits else
                       f"keep = keep && mask_mod({b}, {h}, i, c0 + c, p.mask_args);")
        score = f"score_mod({at} * p.mod_scale, {b}, {h}, i, c0 + c, p.score_args)"
        per.append(f"{at} = keep ? {score} : -INFINITY;" if self.score_mod is not None else f"if (!keep) {at} = -INFINITY;")
        masked += ["const bool real = i < p.seq_q;  // rows past seq_q reach no mod"] + _per_value(per)
        out = _if_masked(_nest(loops, masked))
        if self.score_mod is None:
            return out
        plain = [f"const int i = {i};", f"const int c0 = {c0};", "if (i < p.seq_q)  // rows past seq_q reach no mod"]
        plain += ["    " + l for l in _per_value([f"{at} = score_mod({at} * p.mod_scale, {b}, {h}, i, c0 + int(t * 8 + e), p.score_args);"])]
        return out[:-1] + ["} else {  // unmasked block: the score_mod alone"] + ["    " + l for l in _nest(loops, plain)] + ["}"]

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

    def recompute_cpp(self, s: str, i: str, j: str, b: str, h: str, grad: str = "") -> list[str]:
        """The backward's rule on one recomputed score: lvalue ``s`` (the raw accumulator value of global query
        row ``i``, key ``j``; ``b``/``h`` the batch and query head) becomes the score the forward's softmax saw,
        -inf where not kept (the mask is evaluated where ``masked``, the rows past seq_q included). ``grad``: a
        float lvalue taking ``d score_mod / d score`` there (0 where not kept), for a derivative that reads the
        score (``KernelMods.derivative_kind`` "score"), whose value dS needs after the score is gone."""
        rule = ["int lo, hi;", f"score_row_range({i}, p.seq_k, p.mask_offset, p.window_left, p.window_right, &lo, &hi);"]
        if self.mods is None:
            return _block("if (masked) {", rule + [f"if ({j} < lo || {j} >= hi || {i} >= p.seq_q) {s} = -INFINITY;"])
        keep = [f"keep = {j} >= lo && {j} < hi && {i} < p.seq_q;  // rows past seq_q reach no mod"]
        if self.mask_mod is not None:
            keep.append(f"keep = keep && mask_mod({b}, {h}, {i}, {j}, p.mask_args);")
        out = ["bool keep = true;"] + _block("if (masked) {", rule + keep)
        if self.score_mod is None:
            return out + [f"if (!keep) {s} = -INFINITY;"]
        args, keeps_grad = f"{b}, {h}, {i}, {j}, p.score_args", self.mods.derivative_kind == "score"
        kept = [f"const float x = {s} * p.mod_scale;  // the score_mod sees the scaled score"]
        kept += [f"{grad} = score_mod_grad(x, {args});"] if keeps_grad else []
        return out + _block("if (keep) {", kept + [f"{s} = score_mod(x, {args});"])[:-1] + _block(
            "} else {", [f"{s} = -INFINITY;"] + ([f"{grad} = 0.f;"] if keeps_grad else []))

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

    def to_cpp(self, backward: bool = False) -> str:
        """The three functions above as C++ (floor division where operands may be negative); ``backward``: with
        the score_mod's derivative (a backward kernel's)."""
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
            self.block_mask_fns_cpp(backward) if self.mask_mod is not None else "")

    def block_mask_fns_cpp(self, backward: bool = False) -> str:
        """The functions reading the block mask (a mask_mod only): the forward's (``block_mask_row``, ``_clip``,
        ``_next``, ``_partial``) or, ``backward``, the transposed mask's (``bwd_block_mask_row``, ``_clip``, ``_partial``)."""
        if not backward:
            return _BLOCK_MASK_FNS.replace("$ROW", self._block_row_cpp())
        b = "b" if self.mods.uses("b") else "0"
        extent, h = ("heads", "h") if self.mods.uses("h") else ("1", "0")
        return _BWD_BLOCK_MASK_FNS.replace("$ROW", f"(({b}) * {extent} + {h}) * n_kb + kb").replace(
            "$GROUP", "group" if self.mods.uses("h") else "1")


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


#: Reading the block mask (:meth:`flashgen.mods.KernelMods.block_mask_shape`); ``$ROW`` indexes its rows.
_BLOCK_MASK_FNS = """
// ---- block mask: per (batch, head, query block) the kept key blocks [lo, hi), then a class per key block
// (0 empty, 1 partial, 2 full), made by <name>_mask_blocks; nullptr: every block partial, none skipped
__host__ __device__ __forceinline__ const int* block_mask_row(const int* bm, int b, int h, int qb, int heads, int seq_q, int seq_k) {
    (void)b; (void)h; (void)heads;
    if (bm == nullptr) return nullptr;
    const int n_qb = (seq_q + int(B_r) - 1) / int(B_r), n_kb = (seq_k + int(B_c) - 1) / int(B_c);
    return bm + int64_t($ROW) * (2 + n_kb);
}
// [j_begin, j_end) narrowed to the row's [lo, hi), then to its first and last non-empty block (never reversed)
__host__ __device__ __forceinline__ void block_mask_clip(const int* r, int* j_begin, int* j_end) {
    if (r == nullptr) return;
    if (r[0] > *j_begin) *j_begin = r[0];
    if (r[1] < *j_end) *j_end = r[1];
    if (*j_end < *j_begin) *j_end = *j_begin;
    while (*j_begin < *j_end && r[2 + *j_begin] == 0) ++*j_begin;  // a split tile's part may start or end
    while (*j_end > *j_begin && r[2 + *j_end - 1] == 0) --*j_end;    // on an empty block
}
// The key block a tile walks after block j of its clipped [j_begin, j_end): the next non-empty one, else j_end
__host__ __device__ __forceinline__ int block_mask_next(const int* r, int j, int j_end) {
    if (r == nullptr) return j + 1;
    for (++j; j < j_end && r[2 + j] == 0; ++j) {}
    return j;
}
__host__ __device__ __forceinline__ bool block_mask_partial(const int* r, int kb) { return r == nullptr || r[2 + kb] != 2; }"""

#: Reading the backward's (transposed) block mask: ``$ROW`` indexes its rows, ``$GROUP`` counts the rows a CTA's
#: kv head reads (its group's query heads where the mask_mod reads h, else its one row).
_BWD_BLOCK_MASK_FNS = """
// ---- block mask (backward): per (batch, head, key block) the query blocks [lo, hi) holding a kept score, then a
// class per query block (0 empty, 1 partial, 2 full), made by <name>_mask_blocks; nullptr: every block partial
__host__ __device__ __forceinline__ const int* bwd_block_mask_row(const int* bm, int b, int h, int kb, int heads, int seq_q, int seq_k) {
    (void)b; (void)h; (void)heads;
    if (bm == nullptr) return nullptr;
    const int n_qb = (seq_q + int(B_r) - 1) / int(B_r), n_kb = (seq_k + int(B_c) - 1) / int(B_c);
    return bm + int64_t($ROW) * (2 + n_qb);
}
// [qb_begin, qb_end) narrowed to the union of the rows' [lo, hi) over query heads h0 .. h0 + group - 1 (never reversed)
__host__ __device__ __forceinline__ void bwd_block_mask_clip(const int* bm, int b, int h0, int group, int kb, int heads, int seq_q, int seq_k,
                                                             int* qb_begin, int* qb_end) {
    (void)group;
    if (bm == nullptr) return;
    int lo = 0, hi = 0;  // the union; empty until a non-empty row
    for (int g = 0; g < $GROUP; ++g) {
        const int* r = bwd_block_mask_row(bm, b, h0 + g, kb, heads, seq_q, seq_k);
        if (r[1] <= r[0]) continue;
        lo = hi > lo && lo < r[0] ? lo : r[0];
        hi = hi > r[1] ? hi : r[1];
    }
    if (hi <= lo) { *qb_end = *qb_begin; return; }  // no kept score in this key block
    if (lo > *qb_begin) *qb_begin = lo;
    if (hi < *qb_end) *qb_end = hi;
    if (*qb_end < *qb_begin) *qb_end = *qb_begin;
}
// whether work item (query head h, query block qb) of key block kb takes the masked path: not a full block
__host__ __device__ __forceinline__ bool bwd_block_mask_partial(const int* bm, int b, int h, int kb, int qb, int heads, int seq_q, int seq_k) {
    const int* r = bwd_block_mask_row(bm, b, h, kb, heads, seq_q, seq_k);
    return r == nullptr || r[2 + qb] != 2;
}"""

#: The block mask's two kernels and their C entry point; ``$FILL`` fills ``m.mask_args`` from the words; ``$RB``:
#: the blocks of a row (qb forward, kb backward), ``$CB`` those with a class in it (kb, qb), ``$CWHAT`` their name.
_MASK_BLOCKS = """
namespace $NAME {
// one CTA per (key block, query block, batch x head of the mask): does the mask_mod keep all, some or none
__global__ void mask_blocks_kernel(const mask_mod_args ma, int seq_q, int seq_k, int nh, int n_qb, int n_kb, int* out) {
    const int kb = blockIdx.x, qb = blockIdx.y, b = int(blockIdx.z) / nh, h = int(blockIdx.z) % nh;
    bool any = false, all = true;
    for (int e = threadIdx.x; e < int(B_r * B_c); e += blockDim.x) {
        const int i = qb * int(B_r) + e / int(B_c), j = kb * int(B_c) + e % int(B_c);
        if (i < seq_q && j < seq_k) {  // the key tail is the kernels' own rule
            const bool keep = mask_mod(b, h, i, j, ma);
            any = any || keep;
            all = all && keep;
        }
    }
    any = __syncthreads_or(any);
    all = __syncthreads_and(all);
    if (threadIdx.x == 0) out[(int64_t(blockIdx.z) * n_$RB + $RB) * (2 + n_$CB) + 2 + $CB] = any ? (all ? 2 : 1) : 0;
}
// one thread per row: the range [lo, hi) of its non-empty $CWHAT blocks ([0, 0) when there is none)
__global__ void mask_ranges_kernel(int rows, int n_$CB, int* out) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows) return;
    int* r = out + int64_t(row) * (2 + n_$CB);
    int lo = n_$CB, hi = 0;
    for (int $CB = 0; $CB < n_$CB; ++$CB)
        if (r[2 + $CB] != 0) { lo = $CB < lo ? $CB : lo; hi = $CB + 1; }
    r[0] = lo < hi ? lo : 0;
    r[1] = hi;
}
}  // namespace $NAME

// The int32 count of the block mask of a call with these sizes (KernelMods.block_mask_shape); 0 for invalid sizes.
extern "C" int64_t $NAME_block_mask_numel(const $NAME_args* a) {
    using namespace $NAME;
    if (a->batch <= 0 || a->heads <= 0 || a->seq_q <= 0 || a->seq_k <= 0) return 0;
    const int64_t nb = $NB, nh = $NH, n_qb = (a->seq_q + int(B_r) - 1) / int(B_r), n_kb = (a->seq_k + int(B_c) - 1) / int(B_c);
    return nb * nh * n_$RB * (2 + n_$CB);
}

// The block mask of a call with these arguments into `out` (int32, KernelMods.block_mask_shape), on `stream`.
extern "C" int $NAME_mask_blocks(const $NAME_args* a, int* out, void* stream) {
    using namespace $NAME;
    if (a->batch <= 0 || a->heads <= 0 || a->seq_q <= 0 || a->seq_k <= 0 || out == nullptr) return (int)cudaErrorInvalidValue;
    struct { $FIELDS float scale, scale_log2; } m{};
$FILL
    const int nb = $NB, nh = $NH, n_qb = (a->seq_q + int(B_r) - 1) / int(B_r), n_kb = (a->seq_k + int(B_c) - 1) / int(B_c);
    mask_blocks_kernel<<<dim3(n_kb, n_qb, nb * nh), 128, 0, (cudaStream_t)stream>>>(m.mask_args, a->seq_q, a->seq_k, nh, n_qb, n_kb, out);
    const int rows = nb * nh * n_$RB;
    mask_ranges_kernel<<<(rows + 127) / 128, 128, 0, (cudaStream_t)stream>>>(rows, n_$CB, out);
    return (int)cudaGetLastError();
}"""
