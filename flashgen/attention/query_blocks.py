"""The score mask seen from a key block: which query blocks the backward visits, and where it masks.

The forward walks key blocks for a block of query rows (:class:`flashgen.dsl.plan.ScoreMask`); the
backward's CTA owns key columns ``[c0, c0 + B_c)`` and walks query blocks of ``B_r`` rows. A score
``(i, j)`` is kept where the forward keeps it (``ScoreMask.row_range``) and ``i < seq_q`` (a query
tail row of the backward's last block must add nothing to dK and dV).

* :meth:`QueryBlocks.block_range`: ``[qb_begin, qb_end)``, the query blocks holding any kept score
  of the key block (causal: rows ``i >= c0 - offset``; a window's right side: ``i >= c0 - offset -
  right``; its left side: ``i <= c_last - offset + left``);
* :meth:`QueryBlocks.block_needs_mask`: False where every score of (query block, key block) is kept;
* :meth:`QueryBlocks.key_rank`: the place of key block ``kb`` among the key blocks that visit query
  block ``qb``, in ascending order. Those are a contiguous range, the forward's key-block range of
  the query block (:meth:`ScoreMask.block_range`), so the rank is ``kb`` less its first block. A
  deterministic backward adds dQ of ``qb`` in this order.

``to_cpp`` renders both as ``__host__ __device__`` functions next to the forward's
``score_row_range`` (which the kernel's element mask calls); tests compile them for the host and
compare them with these methods and with a brute-force walk over :meth:`keep`.
"""
from __future__ import annotations

import attrs

from .score_mask import ScoreMask


@attrs.frozen
class QueryBlocks:
    """The key-block view of ``mask`` (its ``B_r`` query rows per block, ``B_c`` key columns per CTA)."""

    mask: ScoreMask

    @property
    def B_r(self) -> int:
        return self.mask.B_r

    @property
    def B_c(self) -> int:
        return self.mask.B_c

    def keep(self, i: int, j: int, seq_q: int, seq_k: int, offset: int = 0, left: int = -1, right: int = -1) -> bool:
        return i < seq_q and self.mask.keep(i, j, seq_k, offset, left, right)

    def keep_array(self, rows, cols, seq_q: int, seq_k: int, offset: int = 0, left: int = -1, right: int = -1):
        """:meth:`keep` over broadcast numpy index arrays (query rows, key columns)."""
        return (rows < seq_q) & self.mask.keep_array(rows, cols, seq_k, offset, left, right)

    def block_range(self, kb: int, seq_q: int, seq_k: int, offset: int = 0, left: int = -1, right: int = -1) -> tuple[int, int]:
        """``[qb_begin, qb_end)``: the query blocks holding any kept score of key block ``kb``."""
        n_q = -(-seq_q // self.B_r)
        c0 = kb * self.B_c
        c_last = min(c0 + self.B_c, seq_k) - 1
        begin, end = 0, n_q
        kind = self.mask.kind
        if kind == "causal" or (kind == "window" and right >= 0):
            lo = c0 - offset - (right if kind == "window" else 0)
            begin = n_q if lo >= seq_q else max(0, lo // self.B_r)
        if kind == "window" and left >= 0:
            hi = c_last - offset + left
            end = min(n_q, hi // self.B_r + 1) if hi >= 0 else 0
        begin = min(begin, n_q)
        return begin, max(begin, end)

    def block_needs_mask(self, qb: int, kb: int, seq_q: int, seq_k: int, offset: int = 0, left: int = -1, right: int = -1) -> bool:
        """False when every score of (query block ``qb``, key block ``kb``) is kept."""
        q_row0 = qb * self.B_r
        if q_row0 + self.B_r > seq_q:
            return True
        return self.mask.block_needs_mask(kb, q_row0, seq_q, seq_k, offset, left, right)

    def key_rank(self, qb: int, kb: int, seq_q: int, seq_k: int, offset: int = 0, left: int = -1, right: int = -1) -> int:
        """How many key blocks below ``kb`` visit query block ``qb`` (for a ``kb`` that visits it): ``kb``
        less the first block of the forward's key-block range of the query block's rows."""
        return kb - self.mask.block_range(qb * self.B_r, seq_q, seq_k, offset, left, right)[0]

    def to_cpp(self) -> str:
        """``q_block_range``, ``bwd_block_needs_mask`` and ``key_rank`` (after the forward mask's C++, whose
        ``block_needs_mask`` and ``kv_block_range`` they call; ``B_r`` and ``B_c`` are the kernel's constants)."""
        kind = self.mask.kind
        lines = [
            "const int n_q = (seq_q + (int)B_r - 1) / (int)B_r;",
            "const int c0 = kb * (int)B_c;",
            "const int c_last = (c0 + (int)B_c < seq_k ? c0 + (int)B_c : seq_k) - 1;",
            "int begin = 0, end = n_q;",
            "(void)c_last; (void)offset; (void)left; (void)right;",
        ]
        if kind in ("causal", "window"):
            lo = "c0 - offset" + (" - right" if kind == "window" else "")
            cond = "" if kind == "causal" else "if (right >= 0) "
            # a first row past the queries: no block; a negative one (floor division): block 0
            lines.append(f"{cond}{{ const int lo = {lo}; begin = lo >= seq_q ? n_q : lo > 0 ? lo / (int)B_r : 0; }}")
        if kind == "window":
            lines.append("if (left >= 0) { const int hi = c_last - offset + left; "
                         "end = hi >= 0 ? (hi / (int)B_r + 1 < n_q ? hi / (int)B_r + 1 : n_q) : 0; }")
        lines.append("if (begin > n_q) begin = n_q;")
        lines.append("*qb_begin = begin; *qb_end = end > begin ? end : begin;")
        body = "\n".join("    " + l for l in lines)
        sig = "int seq_q, int seq_k, int offset, int left, int right"
        return (
            f"// query blocks [qb_begin, qb_end) holding any kept score of key block kb (QueryBlocks, mask '{kind}')\n"
            f"__host__ __device__ __forceinline__ void q_block_range(int kb, {sig}, int* qb_begin, int* qb_end) {{\n{body}\n}}\n"
            f"// false when every score of (query block qb, key block kb) is kept: no query tail, and the forward's rule\n"
            f"__host__ __device__ __forceinline__ bool bwd_block_needs_mask(int qb, int kb, {sig}) {{\n"
            f"    const int q_row0 = qb * (int)B_r;\n"
            f"    if (q_row0 + (int)B_r > seq_q) return true;\n"
            f"    return block_needs_mask(kb, q_row0, seq_q, seq_k, offset, left, right);\n}}\n"
            f"// how many key blocks below kb visit query block qb (kb visiting it): kb less the first block of the\n"
            f"// forward's key-block range of the query block's rows (the visiting key blocks are that range)\n"
            f"__host__ __device__ __forceinline__ int key_rank(int qb, int kb, {sig}) {{\n"
            f"    int j_begin, j_end;\n"
            f"    kv_block_range(qb * (int)B_r, seq_q, seq_k, offset, left, right, &j_begin, &j_end);\n"
            f"    return kb - j_begin;\n}}"
        )
