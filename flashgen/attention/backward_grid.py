"""Which block of the backward's grid computes which key block, and in what order the blocks start.

A backward CTA owns key block ``kb`` of one kv head of one batch entry. The grid is ``(key blocks, kv heads,
batch)``; the hardware starts blocks in linear order (``blockIdx.x`` fastest, then ``.y``, then ``.z``),
linear block ``(b * kv_heads + h) * key_blocks + kb``. Two orders, chosen by the backward's ``longest_first``:

* **Default**: block ``(x, y, z)`` is key block ``x`` of kv head ``y`` of batch entry ``z``. The CTAs running at
  once are all key blocks of a few (kv head, batch) pairs, which share their query heads' Q, dO, lse, D and dQ
  sums in L2. Under a causal mask a CTA's work falls with ``kb`` (key block 0 meets every query block), so the
  last pairs' long key blocks start late and the launch ends on them: in a model of 132 SMs with dynamic
  dispatch the launch takes 6-7% past its work's share at 16-64 key blocks.
* **Longest first**: the same for the first pairs; the last :meth:`BackwardGrid.tail_pairs` pairs, about two
  waves of CTAs (``2 * SMs / key_blocks``, the SMs from ``%nsmid``), start key block by key block (every tail
  pair's key block 0, then every key block 1, ...), so the launch ends on short CTAs (1-2% in the same model).
  Every pair's key blocks outside the tail still run together. Starting every pair key block by key block
  instead (the whole grid in the tail's order) cost 17-38% more time on an H200 (causal, bf16, seq 2048 and
  8192): the CTAs running at once then belong to as many pairs and share nothing in L2.

* **Grid** (:meth:`BackwardGrid.grid`): None past gridDim.x's limit of 2^31 - 1 or .y's and .z's of 65535, the
  launch's own limits (kv heads and batch entries up to 65535; an ``int`` seq_k never makes 2^31 key blocks),
  which it refuses itself.
* **Decode** (:meth:`BackwardGrid.cta`): block ``(x, y, z)``'s (key block, kv head, batch entry). The default
  reads each from one block index, which ptxas reads again where it needs it instead of keeping it in a
  register (a value computed from them would stay live across the query-block loop); longest first computes
  the tail's from the linear block once.
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


#: the SM count the Python rule assumes where none is given (an H100's or H200's)
SMS = 132
#: CTAs in the tail longest first reorders, in waves of one CTA per SM
TAIL_WAVES = 2
#: the decode's line reading the SM count (``%nsmid``: the SM ids' bound, the SM count where they are contiguous)
SMS_CPP = 'asm("mov.u32 %0, %%nsmid;" : "=r"(sms));'


@attrs.frozen
class BackwardGrid:
    """The grid rule of the backward's main kernel (both engines); ``longest_first``: the last pairs' key
    blocks started longest first."""

    longest_first: bool = False

    # ---- the rule in Python (the simulators' and the tests') ----------------------------------

    def grid(self, key_blocks: int, kv_heads: int, batch: int) -> "tuple[int, int, int] | None":
        """(gridDim.x, .y, .z) of a launch of ``key_blocks`` per (kv head, batch entry); None where no grid holds it."""
        return None if key_blocks > MAX_X or max(kv_heads, batch) > MAX_YZ else (key_blocks, kv_heads, batch)

    def tail_pairs(self, key_blocks: int, pairs: int, sms: int = SMS) -> int:
        """Longest first: the (kv head, batch) pairs at the end of the grid started key block by key block (0
        for the default), about :data:`TAIL_WAVES` waves of ``sms`` CTAs."""
        return min(pairs, -(-TAIL_WAVES * sms // key_blocks)) if self.longest_first else 0

    def cta(self, x: int, y: int, z: int, dims: tuple[int, int, int], sms: int = SMS) -> tuple[int, int, int]:
        """(key block, kv head, batch entry) of block ``(x, y, z)`` of a grid ``dims`` on ``sms`` SMs."""
        key_blocks, kv_heads, batch = dims
        tail = self.tail_pairs(key_blocks, kv_heads * batch, sms)
        first, pair = kv_heads * batch - tail, z * kv_heads + y
        if pair < first:
            return x, y, z
        linear = (pair - first) * key_blocks + x
        kb, pair = divmod(linear, tail)
        return kb, (first + pair) % kv_heads, (first + pair) // kv_heads

    def dispatch_order(self, key_blocks: int, kv_heads: int, batch: int, sms: int = SMS) -> list[tuple[int, int, int]]:
        """The (key block, kv head, batch entry) of every CTA, in linear block order, on ``sms`` SMs."""
        dims = self.grid(key_blocks, kv_heads, batch)
        if dims is None:
            raise ValueError(f"{key_blocks} key blocks of {kv_heads} kv heads x {batch} batch entries: no grid holds them")
        gx, gy, gz = dims
        return [self.cta(x, y, z, dims, sms) for z in range(gz) for y in range(gy) for x in range(gx)]

    # ---- the rule in C++ (the kernels' and launchers' text) ----------------------------------

    def block_index(self, index: str) -> str:
        """The unsigned block index that is ``index`` (:data:`KB`, :data:`KV_HEAD` or :data:`BATCH`), e.g.
        ``blockIdx.z``; longest first: the decoded int as unsigned (it is never negative)."""
        return f"unsigned({index})" if self.longest_first else "blockIdx." + "xyz"[(KB, KV_HEAD, BATCH).index(index)]

    def kernel_cpp(self) -> str:
        """The main kernel's lines naming this CTA's ``kb``, ``kv_head`` and ``batch`` (ints)."""
        if not self.longest_first:
            return "const int kb = int(blockIdx.x), kv_head = int(blockIdx.y), batch = int(blockIdx.z);"
        return "\n".join([
            "int kb = int(blockIdx.x), kv_head = int(blockIdx.y), batch = int(blockIdx.z);",
            f"{{  // longest first: the last pairs, about {TAIL_WAVES} waves of CTAs, start key block by key block",
            "    unsigned sms;",
            f"    {SMS_CPP}",
            "    const long long n_kb = gridDim.x, pairs = (long long)gridDim.y * gridDim.z;",
            f"    const long long want = ({TAIL_WAVES}LL * sms + n_kb - 1) / n_kb, tail = want < pairs ? want : pairs;",
            "    const long long first = pairs - tail, pair = (long long)batch * gridDim.y + kv_head;",
            "    if (pair >= first) {",
            "        const long long linear = (pair - first) * n_kb + kb, moved = first + linear % tail;",
            "        kb = int(linear / tail), kv_head = int(moved % gridDim.y), batch = int(moved / gridDim.y);",
            "    }",
            "}"])

    def launch_dims_cpp(self, args: str = "a") -> str:
        """The main kernel's grid argument, from the launcher's arguments ``args`` (and the kernel's ``B_c``)."""
        return "dim3(" + ", ".join(_COUNT_CPP[i].format(a=args) for i in (KB, KV_HEAD, BATCH)) + ")"

    def launch_check_cpp(self, args: str = "a") -> str:
        """What the launcher appends to its refusal (cudaErrorInvalidValue): nothing, in either order (the launch
        itself refuses kv heads or batch entries past .y's and .z's limit, and an ``int`` seq_k never makes more
        key blocks than .x holds)."""
        return ""

    def wait_note(self) -> list[str]:
        """The comment on a wait for the lower key blocks' dQ adds (both engines' ordered adds)."""
        return [f"// deadlock-free only because a CTA of lower {'kb' if self.longest_first else 'blockIdx.x'} (key block) is dispatched no later than this one:",
                "// the key blocks waited for are lower ones of the same (kv head, batch), and the lowest never waits"]

    def described(self, B_c: int) -> str:
        """The grid in words (the files' headers and manifests): ``(ceil(seq_k / 64), kv_heads, batch)``."""
        return "(" + ", ".join(_COUNT_WORDS[i].format(B_c=B_c) for i in (KB, KV_HEAD, BATCH)) + ")"

    def indices_described(self) -> str:
        """What the block indices are, in words: ``blockIdx.x, .y, .z = key block, kv head, batch``."""
        words = "blockIdx.x, .y, .z = " + ", ".join(_INDEX_WORDS[i] for i in (KB, KV_HEAD, BATCH))
        return words + (", the last pairs' reordered longest first" if self.longest_first else "")
