"""The order in which a backward CTA walks its work items.

A CTA owns one key block of one kv head; its work items are every (query head of the group, visited query block)
pair, ``n_q * group`` of them (:class:`~flashgen.attention.query_blocks.QueryBlocks` gives the ``n_q`` visited
blocks). Item ``v`` is query head ``v // n_q`` and query block ``v % n_q`` of the visited ones. The walk starts at
item :meth:`ItemWalk.first` and takes each next item cyclically (query blocks fastest):

* ``rotates``: the CTA of key block ``kb`` starts at item ``kb`` (mod the items), so that the key blocks' CTAs, which
  run side by side, add into different query blocks of dQ at any one time instead of all into the same rows. Not
  with ordered dQ adds: there a CTA waits for the lower key blocks' adds of each query block, which they make
  soonest when every CTA walks the query blocks upwards (from item 0).

The kernel steps a cursor (query head, query block) once per item instead of dividing the item's index by ``n_q``
at every item, which cost about 60 instructions (an integer division and remainder), scheduled between the
wgmma of dP^T. :meth:`ItemWalk.to_cpp` renders the cursor; :meth:`ItemWalk.order` steps the same cursor in Python
for the simulator. Tests compile the C++ for the host and compare the two (tests/attention/test_item_walk.py).

Both engines' backwards walk their items in this order (the mma.sync one from its item index, without rotation).
The mma.sync backward carries the pointer of its dQ adds from item to item with :meth:`ItemWalk.step` (``item_step``):
a pointer made afresh at each item's adds lived only there, and ptxas gave its register to the next item's first
instruction, which then waited for the previous item's adds to read it (5% of the warps' samples at d_head 64 on an
H200; carried, d_head 64 ran 1.5-2.1% faster, 128 the same).
"""
from __future__ import annotations

import attrs


@attrs.frozen
class ItemWalk:
    """The walk over a backward CTA's (query head, query block) items; ``rotates``: key block ``kb`` starts at item ``kb``."""

    rotates: bool

    def first(self, work: int, kb: int) -> int:
        """The walk's first item of ``work`` items for key block ``kb``."""
        return kb % work if self.rotates and work else 0

    def order(self, n_q: int, group: int, kb: int) -> list[tuple[int, int]]:
        """(query head within the group, query block from the first visited) of each item in walk order: the cursor
        of :meth:`to_cpp`, stepped the same way."""
        if n_q <= 0 or group <= 0:
            return []
        work = n_q * group
        h, q = divmod(self.first(work, kb), n_q)
        out = []
        for _ in range(work):
            out.append((h, q))
            q += 1
            if q == n_q:
                q, h = 0, h + 1
                if h == group:
                    h = 0
        return out

    @staticmethod
    def step(h: int, q: int, n_q: int, group: int, block: int, head: int) -> int:
        """How much an offset of ``block`` per query block and ``head`` per query head of the group changes from the
        walk's previous item to item ``(h, q)`` (not its first; ``item_step`` of :meth:`step_cpp`)."""
        if q:
            return block
        back = (n_q - 1) * block
        return head - back if h else -(group - 1) * head - back

    def to_cpp(self) -> str:
        """``ItemCursor``, ``first_item(n_q, group, kb)`` and ``next_item(cursor, n_q, group)`` as ``__host__ __device__``
        code."""
        first = "kb % (n_q * group)" if self.rotates else "0;\n    (void)kb"
        return f"""// A backward CTA's walk of its work items (query head of the group, visited query block): from the first item,
// each next one cyclically, query blocks fastest; a cursor stepped once per item, no division per item
struct ItemCursor {{ int h, q; }};  // the item's query head within the group, its query block from the first visited
__host__ __device__ __forceinline__ ItemCursor first_item(int n_q, int group, int kb) {{
    if (n_q <= 0 || group <= 0) return ItemCursor{{0, 0}};  // no items
    const int v = {first};
    return ItemCursor{{v / n_q, v % n_q}};
}}
__host__ __device__ __forceinline__ void next_item(ItemCursor& c, int n_q, int group) {{
    if (++c.q == n_q) {{
        c.q = 0;
        if (++c.h == group) c.h = 0;
    }}
}}"""

    @staticmethod
    def step_cpp() -> str:
        """``item_step(h, q, n_q, group, block, head)`` (:meth:`step`) as ``__host__ __device__`` code."""
        return """// the change of an offset of `block` per query block and `head` per query head from the walk's previous item to
// item (h, q), not the first: the next query block, the next head's first, or (the walk wrapping) head 0's first
__host__ __device__ __forceinline__ int64_t item_step(int h, int q, int n_q, int group, int64_t block, int64_t head) {
    if (q != 0) return block;
    const int64_t back = int64_t(n_q - 1) * block;
    return h != 0 ? head - back : -int64_t(group - 1) * head - back;
}"""
