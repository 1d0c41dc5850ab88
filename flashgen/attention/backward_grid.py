"""Which block of the backward's grid computes which key block, and in what order the blocks start.

A backward CTA owns key block ``kb`` of one kv head of one batch entry. The hardware starts blocks in
linear order (``blockIdx.x`` fastest, then ``.y``, then ``.z``), so the grid's order of its three indices
is the order the CTAs start in. Two orders, chosen by the backward's ``longest_first`` knob:

* **Default** ``(key blocks, kv heads, batch)``: linear block ``(b * kv_heads + h) * key_blocks + kb``. The
  CTAs running at once are all key blocks of a few (kv head, batch) pairs, which share their query heads'
  Q, dO, lse, D and dQ sums in L2.
* **Longest first** ``(kv heads, batch, key blocks)``: linear block ``(kb * batch + b) * kv_heads + h``.
  Under a causal mask a CTA's work falls with ``kb`` (key block 0 meets every query block, top-left and
  bottom-right alike); every pair's key block 0 starts before any pair's key block 1, so the longest CTAs
  start first and the last wave is made of short ones, at the price of the CTAs running at once belonging
  to as many pairs (their Q, dO and dQ sums no longer shared in L2). Not yet timed; not the default.

* **Grid** (:meth:`BackwardGrid.grid`): None past gridDim.x's limit of 2^31 - 1 or .y's and .z's of 65535.
  The default's limits are those of the launch (kv heads and batch entries up to 65535; an ``int`` seq_k
  never makes 2^31 key blocks), which refuses a larger grid itself; longest first puts the key blocks on
  .z, and its launcher refuses more than 65535 of them (cudaErrorInvalidValue) before any kernel runs.
* **Decode** (:meth:`BackwardGrid.cta`): block ``(x, y, z)``'s (key block, kv head, batch entry), each one
  block index, which ptxas reads again where it needs it instead of keeping it in a register (a value
  computed from them would stay live across the query-block loop).
* **Order** (:meth:`BackwardGrid.dispatch_order`): the CTAs in linear block order. In both orders a lower
  key block of the same pair has a lower linear index, so it starts no later: the ordered dQ adds
  (``deterministic``), where a key block waits for the lower ones of its pair, are free of deadlock
  because of it.

The C++ is the kernels' and launchers' own text: :meth:`BackwardGrid.kernel_cpp` (the block's decode),
:meth:`BackwardGrid.block_index`, :meth:`BackwardGrid.launch_dims_cpp` and :meth:`BackwardGrid.launch_check_cpp`;
the default renders the lines the kernels had before the rule existed. Tests compile them for the host and
compare them with these methods (tests/attention/test_backward_grid.py).
"""
from __future__ import annotations

import attrs

#: gridDim.x's and gridDim.y's / .z's largest values
MAX_X, MAX_YZ = 2**31 - 1, 65535
#: the three indices of a CTA, as the decode names them
KB, KV_HEAD, BATCH = "kb", "kv_head", "batch"
#: per index: the launch's count (C++, of the launcher's arguments ``{a}``, B_c the kernel's) and its words
_COUNT_CPP = {KB: "({a}->seq_k + B_c - 1) / B_c", KV_HEAD: "{a}->kv_heads", BATCH: "{a}->batch"}
_COUNT_WORDS = {KB: "ceil(seq_k / {B_c})", KV_HEAD: "kv_heads", BATCH: "batch"}
_INDEX_WORDS = {KB: "key block", KV_HEAD: "kv head", BATCH: "batch"}


@attrs.frozen
class BackwardGrid:
    """The grid rule of the backward's main kernel (both engines); ``longest_first``: key blocks slowest."""

    longest_first: bool = False

    @property
    def order(self) -> tuple[str, str, str]:
        """The index each of blockIdx.x, .y, .z is."""
        return (KV_HEAD, BATCH, KB) if self.longest_first else (KB, KV_HEAD, BATCH)

    # ---- the rule in Python (the simulators' and the tests') ----------------------------------

    def grid(self, key_blocks: int, kv_heads: int, batch: int) -> "tuple[int, int, int] | None":
        """(gridDim.x, .y, .z) of a launch of ``key_blocks`` per (kv head, batch entry); None where no grid holds it."""
        count = {KB: key_blocks, KV_HEAD: kv_heads, BATCH: batch}
        dims = tuple(count[i] for i in self.order)
        return None if dims[0] > MAX_X or max(dims[1:]) > MAX_YZ else dims

    def cta(self, x: int, y: int, z: int) -> tuple[int, int, int]:
        """(key block, kv head, batch entry) of block ``(x, y, z)``."""
        index = dict(zip(self.order, (x, y, z)))
        return index[KB], index[KV_HEAD], index[BATCH]

    def dispatch_order(self, key_blocks: int, kv_heads: int, batch: int) -> list[tuple[int, int, int]]:
        """The (key block, kv head, batch entry) of every CTA, in linear block order."""
        dims = self.grid(key_blocks, kv_heads, batch)
        if dims is None:
            raise ValueError(f"{key_blocks} key blocks of {kv_heads} kv heads x {batch} batch entries: no grid holds them")
        gx, gy, gz = dims
        return [self.cta(x, y, z) for z in range(gz) for y in range(gy) for x in range(gx)]

    # ---- the rule in C++ (the kernels' and launchers' text) ----------------------------------

    def block_index(self, index: str) -> str:
        """The block index (unsigned) that is ``index`` (:data:`KB`, :data:`KV_HEAD` or :data:`BATCH`): ``blockIdx.z``."""
        return "blockIdx." + "xyz"[self.order.index(index)]

    def kernel_cpp(self) -> str:
        """The main kernel's line naming this CTA's ``kb``, ``kv_head`` and ``batch`` (ints)."""
        return ", ".join(f"{'const int ' if i == KB else ''}{i} = int({self.block_index(i)})" for i in (KB, KV_HEAD, BATCH)) + ";"

    def launch_dims_cpp(self, args: str = "a") -> str:
        """The main kernel's grid argument, from the launcher's arguments ``args`` (and the kernel's ``B_c``)."""
        return "dim3(" + ", ".join(_COUNT_CPP[i].format(a=args) for i in self.order) + ")"

    def launch_check_cpp(self, args: str = "a") -> str:
        """What the launcher appends to its refusal (cudaErrorInvalidValue): ``|| key blocks > 65535`` where the
        key blocks are on .y or .z, else nothing (the launch itself refuses kv heads or batch entries past .y's
        and .z's limit, and an ``int`` seq_k never makes more key blocks than .x holds)."""
        if self.order[0] == KB:
            return ""
        return f" || {_COUNT_CPP[KB].format(a=args)} > {MAX_YZ}"

    def wait_note(self) -> list[str]:
        """The comment on a wait for the lower key blocks' dQ adds (both engines' ordered adds)."""
        return [f"// deadlock-free only because a CTA of lower {self.block_index(KB)} (key block) is dispatched no later than this one:",
                "// the key blocks waited for are lower ones of the same (kv head, batch), and the lowest never waits"]

    def described(self, B_c: int) -> str:
        """The grid in words (the files' headers and manifests): ``(ceil(seq_k / 64), kv_heads, batch)``."""
        return "(" + ", ".join(_COUNT_WORDS[i].format(B_c=B_c) for i in self.order) + ")"

    def indices_described(self) -> str:
        """What the block indices are, in words: ``blockIdx.x, .y, .z = key block, kv head, batch``."""
        return "blockIdx.x, .y, .z = " + ", ".join(_INDEX_WORDS[i] for i in self.order)
